"""``rollfleet replay ROLLOUT_ID``: re-drive a finished rollout's loop agent against its recorded
model replies and say whether it reproduces the recording, or where it first diverges.

One line per check, then the verdict; exit 0 when it reproduces, 1 when it diverges, 2 (one line
on stderr) when the rollout cannot be replayed. The logic is :mod:`rollfleet.run.replay`.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import typer
from rich.console import Console

from rollfleet.cli.common import stderr_bar
from rollfleet.errors import InvalidInput, RollfleetError, StoreUnavailable
from rollfleet.run.options import DEFAULT_OUTPUT

PROGRESS_AFTER_S = 1.0  # a bar appears once the replay has taken this long


def store_of(store: str | None, output_dir: Path | None) -> str:
    """The store URL: ``--store``, else OUTPUT/store.db (which must exist: a replay never
    creates a store)."""
    if store is not None and output_dir is not None:
        raise InvalidInput("give --store or --output-dir, not both")
    if store is not None:
        return store
    db = (output_dir or DEFAULT_OUTPUT) / "store.db"
    if not db.is_file():
        raise InvalidInput(f"no {db}: --output-dir names the directory of a rollfleet run")
    return f"sqlite:///{db.resolve()}"


def replay_command(
    rollout_id: str = typer.Argument(..., help="the rollout to replay"),
    store: str = typer.Option(
        None, "--store", help="the control plane's URL (http://…), or sqlite:///… / postgresql://…"
    ),
    output_dir: Path = typer.Option(
        None,
        "--output-dir",
        help=f"a run's output directory: its store.db (default {DEFAULT_OUTPUT})",
    ),
    token: str = typer.Option(
        None, "--token", envvar="ROLLFLEET_TOKEN", help="bearer token for --store"
    ),
    model: Path = typer.Option(
        None,
        "--model",
        help="the GGUF the run served, for the token-id checks (default: the bundled model)",
    ),
    verbose: bool = typer.Option(False, "--verbose", help="log what the pieces do"),
) -> None:
    """Re-drive a finished rollout against its recorded model replies: does it reproduce?"""
    import asyncio

    if not verbose:
        for name in ("rollfleet", "gguf"):
            logging.getLogger(name).setLevel(logging.WARNING)
    url = store_of(store, output_dir)
    reproduces = asyncio.run(_replay(url, token, rollout_id, model))
    raise typer.Exit(0 if reproduces else 1)


async def _replay(url: str, token: str | None, rollout_id: str, model: Path | None) -> bool:
    from rollfleet.client import connect
    from rollfleet.run.recording import Recording
    from rollfleet.run.replay import replay
    from rollfleet.run.replay_report import Check

    out = Console(highlight=False, soft_wrap=True)
    bar = stderr_bar()
    task = bar.add_task(f"replaying {rollout_id}: model calls", total=None)
    started = time.monotonic()

    def tick() -> None:
        if not bar.live.is_started and time.monotonic() - started > PROGRESS_AFTER_S:
            bar.start()

    def on_start(rec: Recording, why: str | None) -> None:
        bar.update(task, total=len(rec.calls))
        reward = rec.rollout.result.reward if rec.rollout.result is not None else None
        out.print(
            f"replaying {rollout_id}: mode {rec.rollout.mode}, attempt {rec.attempt_id},"
            f" {len(rec.calls)} recorded model calls, recorded reward {reward}",
            markup=False,
        )
        if why:
            out.print(f"not checked  token ids: {why}", markup=False)

    def on_check(check: Check) -> None:
        out.print(check.line(), markup=False, style=None if check.ok else "bold red")
        for line in check.diff:
            out.print(f"    {line}", markup=False)
        tick()

    def on_call(done: int, total: int) -> None:
        bar.update(task, completed=done)
        tick()

    try:
        store = connect(url, token=token)
    except RollfleetError:
        raise
    except Exception as exc:  # a URL the store cannot open
        raise InvalidInput(f"cannot open the store {url}: {exc}") from None
    try:
        try:
            report = await replay(
                store,
                rollout_id,
                model=model,
                on_check=on_check,
                on_call=on_call,
                on_start=on_start,
            )
        except RollfleetError:
            raise
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(f"the store {url} does not answer: {exc}") from None
        finally:
            if bar.live.is_started:  # (a bar never started would still print a blank line)
                bar.stop()
    finally:
        await store.close()
    out.print(
        report.verdict(), markup=False, style="bold green" if report.reproduces else "bold red"
    )
    return report.reproduces


def register(app: typer.Typer) -> None:
    """Add ``replay`` to the app."""
    app.command("replay")(replay_command)
