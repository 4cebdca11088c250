"""``rollfleet train``: GRPO through the fleet on a local model, the bundled SmolLM2 by default
(docs/train.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from rollfleet.cli.common import console, job_start
from rollfleet.refs import absolute
from rollfleet.run.options import AGENT, AGENT_HELP, MODE_HELP


def train_command(
    mode: str = typer.Option(..., "--mode", help=MODE_HELP),
    data: Path = typer.Option(..., "--data", help="training tasks, .json or .jsonl"),
    eval_data: Path | None = typer.Option(
        None, "--eval-data", help="held-out tasks answered greedily every --eval-every steps"
    ),
    steps: int = typer.Option(10, "--steps", help="training steps (one batch each)"),
    tasks_per_step: int = typer.Option(4, "--tasks-per-step", help="tasks in a step's batch"),
    group_size: int = typer.Option(8, "--group-size", help="samples per task (a GRPO group)"),
    max_staleness: int = typer.Option(
        0, "--max-staleness", help="0: synchronous; K: the fleet generates up to K steps ahead"
    ),
    lr: float = typer.Option(5e-4, "--lr", help="Adam's learning rate"),
    lora_rank: int = typer.Option(16, "--lora-rank", help="LoRA rank on q/v; 0: full fine-tuning"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="tokens per answer"),
    temperature: float = typer.Option(1.0, "--temperature", help="sampling temperature"),
    eval_every: int = typer.Option(5, "--eval-every", help="steps between evaluations"),
    eval_samples: int = typer.Option(
        1, "--eval-samples", help="1: greedy; n: n samples a task at --temperature (pass@k)"
    ),
    max_turns: int = typer.Option(
        4, "--max-turns", help="model calls per rollout (tool modes need 2 or more)"
    ),
    estimator: str = typer.Option("grpo", "--estimator", help="advantages: grpo, drgrpo or rloo"),
    kl_coef: float = typer.Option(0.0, "--kl-coef", help="weight of the KL to the initial policy"),
    entropy_coef: float = typer.Option(0.0, "--entropy-coef", help="weight of the entropy bonus"),
    dynamic_sampling: bool = typer.Option(
        False, "--dynamic-sampling", help="groups that all scored alike leave the token mean"
    ),
    mask_truncated: bool = typer.Option(
        False, "--mask-truncated", help="do not train on rows cut by --max-tokens"
    ),
    report_to: str | None = typer.Option(
        None, "--report-to", help="tensorboard: event files in OUTPUT/tensorboard"
    ),
    seed: int = typer.Option(0, "--seed", help="the trainer's random seed"),
    trainer: str = typer.Option(
        "builtin", "--trainer", help="builtin (rollfleet's GRPO) or trl (TRL's GRPOTrainer)"
    ),
    engine: str = typer.Option(
        "llamacpp", "--engine", help="what serves the policy: llamacpp or hf (transformers)"
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="a local GGUF file or transformers model directory (config.json and weights) to "
        "train (default: the bundled SmolLM2-135M); nothing is downloaded",
    ),
    engine_threads: int | None = typer.Option(
        None, "--engine-threads", help="llama.cpp threads (default: every core)"
    ),
    output_dir: Path = typer.Option(
        Path("train-out"), "--output-dir", help="store, checkpoints, metrics.jsonl, reward.png"
    ),
    agent: str = typer.Option(AGENT, "--agent", help=AGENT_HELP),
    verbose: bool = typer.Option(False, "--verbose", help="log every lifecycle event"),
) -> None:
    """Train a model (--model, default the bundled one) with GRPO on --data in --mode; the same
    command resumes it."""
    from rollfleet.errors import InvalidInput
    from rollfleet.run.train import train
    from rollfleet.run.train_options import TrainOptions

    mode = job_start(mode, verbose)
    if lora_rank < 0:
        raise InvalidInput(f"--lora-rank must be 0 (full fine-tuning) or more, got {lora_rank}")
    opts = TrainOptions(
        mode=mode,
        data=data,
        output_dir=output_dir,
        steps=steps,
        tasks_per_step=tasks_per_step,
        group_size=group_size,
        max_staleness=max_staleness,
        lr=lr,
        lora_rank=lora_rank or None,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        eval_data=eval_data,
        eval_every=eval_every,
        engine=engine,
        model=model,
        max_turns=max_turns,
        estimator=estimator,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        dynamic_sampling=dynamic_sampling,
        mask_truncated=mask_truncated,
        eval_samples=eval_samples,
        report_to=report_to,
        agent=absolute(agent),
        extra={"engine_threads": engine_threads} if engine_threads else {},
    )
    if trainer not in ("builtin", "trl"):
        raise InvalidInput(f"--trainer {trainer!r}: choose builtin or trl")
    if trainer == "trl" and model is not None:
        raise InvalidInput("--model: --trainer trl trains the bundled model only; drop --model")
    try:
        if trainer == "trl":
            from rollfleet.run.trl import train_with_trl

            records = train_with_trl(opts, console)
        else:
            records = asyncio.run(train(opts, console))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    steps_done = sum(r["kind"] == "step" for r in records)
    console.print(
        f"{steps_done} steps; wrote {output_dir / 'metrics.jsonl'} and {output_dir / 'reward.png'}",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add ``train`` to the app."""
    app.command("train")(train_command)
