"""``rollfleet run``: the seed's parallel rollout command (N rollout processes sharing M VMs)."""

from __future__ import annotations

import asyncio
from typing import Any

import typer
from rich.table import Table

from rollfleet.cli.common import console, job_start
from rollfleet.cli.flags import options_command
from rollfleet.refs import absolute
from rollfleet.run import run
from rollfleet.run.options import DesktopFlags, RunOptions


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: dict[str, Any]) -> None:
    """The summary as a table."""
    table = Table(
        title=(
            f"--mode {summary['mode']}: {summary['rollouts']} rollouts in {summary['wall_s']:.1f}s"
        )
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row(
        "run now / kept from before", f"{summary['ran_now']} / {summary['kept_from_before']}"
    )
    for status, count in sorted(summary["counts"].items()):
        table.add_row(f"status {status}", str(count))
    for kind, count in sorted(summary.get("failures", {}).items()):
        table.add_row(f"failed: {kind}", str(count))
    reward = summary["reward"]
    table.add_row("reward mean ± std", f"{_fmt(reward['mean'])} ± {_fmt(reward['std'])}")
    table.add_row("accuracy (of scored)", _fmt(summary["accuracy"]))
    for name, value in (summary.get("pass_at_k") or {}).items():
        table.add_row(name, _fmt(value))
    table.add_row(
        "latency p50 / p95 (s)",
        f"{_fmt(summary['latency_s']['p50'], '.2f')} / {_fmt(summary['latency_s']['p95'], '.2f')}",
    )
    table.add_row(
        "tokens prompt / completion",
        f"{summary['tokens']['prompt']} / {summary['tokens']['completion']}",
    )
    table.add_row("completion tokens/s", _fmt(summary["tokens_per_s"], ".1f"))
    startup = summary.get("startup_s") or {}
    if "first_token" in startup:
        table.add_row("start-up: first token after (s)", _fmt(startup["first_token"], ".2f"))
    console.print(table)


def run_command(values: dict[str, Any]) -> None:
    """Run every task of --data in --mode with N parallel rollouts; resumable; writes OUTPUT/."""
    values["mode"] = job_start(values["mode"], values.pop("verbose"))
    values["agent"] = absolute(values["agent"])
    opts = RunOptions.from_flags(values)
    try:
        summary = asyncio.run(run(opts, console))
    except KeyboardInterrupt:
        console.print(
            "interrupted: finished rollouts are kept in the store; run the same command to resume",
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    print_summary(summary)
    console.print(
        f"wrote {opts.output_dir / 'trajectories.jsonl'} and {opts.output_dir / 'summary.json'}",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add ``run`` to the app: its flags are RunOptions' and DesktopFlags' fields."""
    verbose = (bool, typer.Option(False, "--verbose", help="log every lifecycle event"))
    app.command("run")(options_command(run_command, RunOptions, DesktopFlags, verbose=verbose))
