"""``rollfleet batches …``: submit, finalize, abort and list batches, write experiences.

With an ``http(s)://`` store the commands talk to the server's coordinator (``/batches``); with a
``sqlite:///`` or ``postgresql://`` URL they run a coordinator in this process on that store.
"""

# ruff: noqa: B008  (typer declares options as calls in defaults, as in src/rollfleet/cli/)

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from rollfleet.coordinator.client import CoordinatorClient
from rollfleet.coordinator.coordinator import RolloutCoordinator
from rollfleet.coordinator.state import BatchInfo, BatchType, StragglerPolicy

batches_app = typer.Typer(
    name="batches",
    help="Train/eval batches: submit, finalize, abort, experiences.",
    no_args_is_help=True,
)
console = Console()
StoreOpt = typer.Option(
    None, "--store", help="store URL (default: ROLLFLEET_STORE, else the embedded store)"
)
TokenOpt = typer.Option(
    None, "--token", help="bearer token for an http(s) store (default: ROLLFLEET_TOKEN)"
)
Api = RolloutCoordinator | CoordinatorClient  # the same async methods, answering the same records


def _open(url: str | None, token: str | None) -> tuple[Api, Callable[[], Awaitable[None]]]:
    import os

    from rollfleet.client import default_store_url

    url = url or default_store_url()
    if url.startswith(("http://", "https://")):
        client = CoordinatorClient(url, token=token or os.environ.get("ROLLFLEET_TOKEN"))
        return client, client.close
    coordinator = RolloutCoordinator(url)
    return coordinator, coordinator.shutdown


def _run(url: str | None, token: str | None, fn: Callable[[Api], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        api, close = _open(url, token)
        try:
            return await fn(api)
        finally:
            await close()

    return asyncio.run(go())


def _show(record: BaseModel) -> None:
    result = record.model_dump(mode="json")
    metrics = result.get("metrics", {})
    head = {k: v for k, v in result.items() if k != "metrics"}
    console.print_json(json.dumps(head, default=str))
    if metrics:
        table = Table("metric", "value")
        for name, value in metrics.items():
            table.add_row(name, f"{value:.4g}" if isinstance(value, float) else str(value))
        console.print(table)


@batches_app.command("submit")
def submit(
    file: Path = typer.Argument(..., help="tasks: .jsonl (one per line) or .json (a list)"),
    batch_id: str = typer.Option(..., "--batch", help="the batch id (never reused)"),
    batch_type: str = typer.Option("train", "--type", help="train or eval"),
    repeat: int = typer.Option(1, "--repeat", help="rollouts per task (a GRPO group)"),
    min_wait: int = typer.Option(
        None, "--min-wait", help="tasks finalize waits for before the grace period"
    ),
    policy: StragglerPolicy = typer.Option(None, "--policy", help="cancel, carry_over or wait"),
    mode: str = typer.Option(None, "--mode", help="mode for tasks that do not name one"),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """Submit every task of a file as one batch."""
    from rollfleet.taskfile import read_specs

    specs = read_specs(file, mode)
    if batch_type not in ("train", "eval"):
        raise typer.BadParameter("--type must be train or eval")
    kind = cast(BatchType, batch_type)

    async def go(api: Api) -> Any:
        return await api.submit_batch(batch_id, specs, kind, min_wait, repeat, policy=policy)

    _run(store, token, go)
    console.print(f"[green]submitted batch {batch_id}[/]: {len(specs)} tasks × {repeat}")


@batches_app.command("finalize")
def finalize(
    batch_id: str = typer.Argument(...),
    timeout: float = typer.Option(None, "--timeout", help="stop waiting after this many seconds"),
    wait_after_min: float = typer.Option(
        None, "--wait-after-min", help="grace seconds after min_wait_num"
    ),
    eval_batch: bool = typer.Option(False, "--eval", help="the batch is an eval batch"),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """Wait for a batch, apply its straggler policy and print its metrics."""

    async def go(api: Api) -> Any:
        if eval_batch:
            return await api.finalize_eval_batch(batch_id, timeout=timeout)
        return await api.finalize_train_batch(
            batch_id, timeout=timeout, wait_after_min=wait_after_min
        )

    _show(_run(store, token, go))


@batches_app.command("abort")
def abort(
    batch_id: str = typer.Argument(...),
    reason: str = typer.Option(..., "--reason"),
    keep_partial: bool = typer.Option(False, "--keep-partial", help="keep the finished results"),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """Cancel a batch's queued and running rollouts."""

    async def go(api: Api) -> Any:
        return await api.abort_batch(batch_id, reason=reason, keep_partial_results=keep_partial)

    _show(_run(store, token, go))


@batches_app.command("experiences")
def experiences(
    batch_id: str = typer.Argument(...), store: str = StoreOpt, token: str = TokenOpt
) -> None:
    """Write a finalized batch's experiences as Parquet and print their figures."""

    async def go(api: Api) -> Any:
        return await api.process_experiences(batch_id)

    _show(_run(store, token, go))


@batches_app.command("list")
def list_batches(store: str = StoreOpt, token: str = TokenOpt) -> None:
    """Every batch with its state and task counts."""

    async def go(api: Api) -> list[BatchInfo]:
        return await api.list_batches()

    table = Table("batch", "type", "state", "policy", "tasks", "completed", "finished")
    for b in _run(store, token, go):
        done = "-" if b.final_result is None else b.final_result.finished_task_count
        table.add_row(
            b.batch_id,
            b.batch_type,
            b.state.value,
            b.policy.value,
            str(b.expected_task_count),
            str(b.completed_task_count),
            str(done),
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``rollfleet batches …`` to the main command line."""
    app.add_typer(batches_app, name="batches")
