"""``rollfleet train``: GRPO through the fleet on the bundled SmolLM2 (first cut; docs/train.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from rollfleet.cli.common import console, job_start
from rollfleet.envs import MODES


def train_command(
    mode: str = typer.Option(..., "--mode", help=f"the environment: {', '.join(MODES)}"),
    data: Path = typer.Option(..., "--data", help="tasks, .json or .jsonl"),
    steps: int = typer.Option(10, "--steps", help="training steps (one batch each)"),
    tasks_per_step: int = typer.Option(4, "--tasks-per-step", help="tasks in a step's batch"),
    group_size: int = typer.Option(4, "--group-size", help="samples per task (a GRPO group)"),
    max_staleness: int = typer.Option(
        0, "--max-staleness", help="0: synchronous; K: the fleet generates up to K steps ahead"
    ),
    lr: float = typer.Option(1e-5, "--lr", help="Adam's learning rate"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="tokens per answer"),
    temperature: float = typer.Option(1.0, "--temperature", help="sampling temperature"),
    output_dir: Path = typer.Option(Path("train-out"), "--output-dir", help="metrics and store"),
    verbose: bool = typer.Option(False, "--verbose", help="log every lifecycle event"),
) -> None:
    """Train the bundled model with GRPO on --data in --mode; writes OUTPUT/metrics.jsonl."""
    from rollfleet.run.train import TrainOptions, train

    job_start(mode, verbose)
    opts = TrainOptions(
        mode=mode, data=data, output_dir=output_dir, steps=steps, tasks_per_step=tasks_per_step,
        group_size=group_size, max_staleness=max_staleness, lr=lr, max_tokens=max_tokens,
        temperature=temperature,
    )  # fmt: skip
    try:
        records = asyncio.run(train(opts, console))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    console.print(f"{len(records)} steps; wrote {output_dir / 'metrics.jsonl'}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``train`` to the app."""
    app.command("train")(train_command)
