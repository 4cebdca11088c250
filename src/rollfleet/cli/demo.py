"""``rollfleet demo``: the seed's flow end to end: a store, 4 workers sharing the queue, a
summary."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from importlib import resources
from pathlib import Path

import typer
from rich.table import Table

from rollfleet.cli.common import console
from rollfleet.cli.fleet_view import FleetView
from rollfleet.run.stack import local_stack
from rollfleet.runner.local import LocalFleet
from rollfleet.taskfile import read_specs


def demo(
    n: int = typer.Option(4, "-n", help="number of workers"),
    home: Path = typer.Option(
        Path(".rollfleet/demo"), "--home", help="where the demo's store file goes"
    ),
) -> None:
    """Start an embedded store, queue the bundled tasks, run them with the echo agent on N
    workers."""
    home.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{home}/demo.db{suffix}").unlink(missing_ok=True)
    asyncio.run(_demo(home / "demo.db", n))


async def _demo(db: Path, n: int) -> None:
    started: set[str] = set()
    ready = asyncio.Event()
    view = FleetView(console)

    def on_event(event: dict[str, object]) -> None:
        view.event(event)
        if event.get("event") == "worker_started":
            started.add(str(event.get("worker_id")))
            if len(started) == n:
                ready.set()

    async with local_stack(db) as stack:
        console.print(f"embedded store {db}, control plane at {stack.url}")
        console.print(f"▶ Initializing {n} workers…")
        stack.start_runners(LocalFleet(stack.url, "rollfleet.agents.echo", n=n, on_event=on_event))
        await asyncio.wait_for(ready.wait(), 120)
        tasks_file = resources.files("rollfleet.examples").joinpath("echo_tasks.jsonl")
        with resources.as_file(tasks_file) as path:
            specs = read_specs(path, mode="test")
        t0 = time.perf_counter()
        rollouts = await stack.store.enqueue_many(specs)
        console.print(f"✅ Created and enqueued {len(rollouts)} rollouts")
        ids = [r.rollout_id for r in rollouts]
        done = await stack.store.wait_for_rollouts(ids, timeout=120)
        elapsed = time.perf_counter() - t0
        await stack.stop_runners(drain=True)
    _summary(done, elapsed)


def _summary(done: list, elapsed: float) -> None:  # type: ignore[type-arg]
    by_status = Counter(r.status.value.upper() for r in done)
    by_worker = Counter(r.attempt.worker_id for r in done if r.attempt is not None)
    table = Table(title=f"{len(done)} rollouts in {elapsed:.2f}s")
    table.add_column("worker")
    table.add_column("rollouts", justify="right")
    for worker, count in sorted(by_worker.items()):
        table.add_row(str(worker), str(count))
    console.print(table)
    console.print("status: " + ", ".join(f"{k}={v}" for k, v in sorted(by_status.items())))


def register(app: typer.Typer) -> None:
    """Add the demo command to the app."""
    app.command()(demo)
