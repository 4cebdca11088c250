"""Store commands: serve, enqueue, requeue, cancel, status, rollouts."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from rollfleet.cli.common import (
    StoreOpt,
    TokenOpt,
    console,
    fmt_age,
    run,
    store_url,
    token_of,
    with_store,
)
from rollfleet.errors import InvalidInput
from rollfleet.model import SUSPECT_RUNNERS, RolloutStatus
from rollfleet.store.base import Store
from rollfleet.taskfile import read_specs

log = logging.getLogger("rollfleet.server")


def serve(
    db: str = typer.Option(
        None, "--db", help="sqlite:///path.db (default: the embedded store) or postgresql://…"
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8300, "--port"),
    token: str | None = TokenOpt,
    pools: Path = typer.Option(
        None, "--pools", help="pool config file to host pools in the control plane"
    ),
    engine: str = typer.Option(
        None,
        "--engine",
        help="serve an OpenAI-compatible gateway at /v1 over this engine: "
        "llamacpp, hf, openai, vllm, sglang",
    ),
    engine_url: str = typer.Option(
        None, "--engine-url", help="base URL of an OpenAI-compatible server (--engine openai)"
    ),
    model: str = typer.Option(
        None, "--model", help="model name or path for the engine (hf: tiny, tiny-vlm, or a path)"
    ),
    mmproj: str = typer.Option(
        None, "--mmproj", help="llama.cpp: a multimodal projector GGUF; the engine then sees images"
    ),
    replicas: int = typer.Option(1, "--replicas", min=1, help="engine replicas behind the gateway"),
    advertise_url: str = typer.Option(
        None,
        "--advertise-url",
        help="this replica's URL for the others (PostgreSQL: they forward /batches to the "
        "elected one); default http://HOST:PORT",
    ),
    max_connections: int = typer.Option(
        None,
        "--max-connections",
        help="open connections (and requests) past which the server answers 503 at once; default "
        "16,384, or what the open-file limit holds (it is raised to the hard limit first)",
    ),
) -> None:
    """Run the control plane: HTTP API, reaper, dashboard."""
    import dataclasses

    import uvicorn

    from rollfleet.compose import EngineOptions, control_plane
    from rollfleet.store import open_sql_store
    from rollfleet.web.guard import GUARD
    from rollfleet.web.serving import (
        check_bind,
        connection_limit,
        raise_fd_limit,
        uvicorn_options,
    )

    token = token_of(token)
    check_bind(host, token)
    fds_before, fds = raise_fd_limit()
    guard = dataclasses.replace(GUARD, limit_concurrency=connection_limit(max_connections, fds))
    log.info(
        "open-file limit %d (was %d): up to %d connections",
        fds,
        fds_before,
        guard.limit_concurrency,
    )
    url = store_url(db)
    store = open_sql_store(url)
    from rollfleet.server.app import create_app

    if engine is not None:
        from rollfleet.engines.factory import EngineKind

        if engine not in {k.value for k in EngineKind}:
            raise InvalidInput(
                f"--engine {engine!r}: choose one of {', '.join(k.value for k in EngineKind)}"
            )
    options = (
        None
        if engine is None
        else EngineOptions(engine, replicas, model, engine_url, token, mmproj=mmproj)
    )
    advertise = advertise_url or f"http://{host}:{port}"
    parts = control_plane(store, pools=pools, engine=options, advertise=advertise)
    app = create_app(
        store,
        token=token,
        routers=parts.routers,
        checked_routers=parts.checked,
        on_startup=parts.on_startup,
        on_shutdown=parts.on_shutdown,
        middleware=parts.middleware,
    )
    log.info("serving %s on http://%s:%d (auth %s)", url, host, port, "on" if token else "off")
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=3,
        **uvicorn_options(guard),
    )


def enqueue(
    file: Path = typer.Argument(..., help="tasks: .jsonl (one object per line) or .json (a list)"),
    mode: str = typer.Option(None, "--mode", help="mode for tasks that do not name one"),
    batch_id: str = typer.Option(None, "--batch", help="tag every rollout with this batch id"),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """Queue every task of a file; a bad line names file:line and field, and nothing is queued."""
    extra: dict[str, Any] = {"batch_id": batch_id} if batch_id else {}
    specs = read_specs(file, mode, **extra)

    async def go(s: Store) -> int:
        return len(await s.enqueue_many(specs))

    n = run(with_store(store, token, go))
    console.print(f"[green]queued {n} rollouts[/] from {file}")


def requeue(
    status: list[RolloutStatus] = typer.Option(
        [RolloutStatus.PREPARING],
        "--status",
        case_sensitive=False,
        help="which stuck statuses to reset (preparing, running)",
    ),
    older_than: float = typer.Option(
        0.0, "--older-than", help="only those unchanged for this many seconds"
    ),
    ids: list[str] = typer.Option(None, "--id", help="only these rollout ids"),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """Put stuck rollouts back in the queue (their current attempt is marked LOST)."""

    async def go(s: Store) -> list[str]:
        return await s.requeue(status, ids or None, older_than)

    done = run(with_store(store, token, go))
    console.print(f"requeued {len(done)} rollouts")
    for rid in done[:20]:
        console.print(f"  {rid}")


def cancel(
    rollout_id: str = typer.Argument(...), store: str = StoreOpt, token: str = TokenOpt
) -> None:
    """Cancel a rollout that has not finished."""

    async def go(s: Store) -> Any:
        return await s.cancel(rollout_id)

    rollout = run(with_store(store, token, go))
    console.print(f"{rollout.rollout_id}: {rollout.status.value}")


def status(store: str = StoreOpt, token: str = TokenOpt) -> None:
    """Show workers and rollout counts as tables."""

    async def go(s: Store) -> Any:
        return await s.statistics(), (await s.query_workers(limit=1000)).items

    stats, workers = run(with_store(store, token, go))
    now = time.time()
    wt = Table(title=f"Workers ({len(workers)})")
    for col in ("worker", "status", "running", "succeeded", "failed", "last heartbeat"):
        wt.add_column(col)
    for w in workers:
        wt.add_row(
            w.worker_id,
            w.status.value.upper(),
            str(len(w.current_attempts)),
            str(w.rollouts_succeeded),
            str(w.rollouts_failed),
            fmt_age(now - w.last_heartbeat_at) + " ago",
        )
    console.print(wt)
    rt = Table(title=f"Rollouts ({stats.total_rollouts})")
    for col in ("status", "count"):
        rt.add_column(col)
    for key, count in stats.rollouts.items():
        rt.add_row(key.upper(), str(count))
    console.print(rt)
    if stats.reward_mean is not None:
        console.print(f"reward mean {stats.reward_mean:.3f} · steps {stats.steps}")
    if stats.suspects:
        console.print(
            f"[red]suspected poison[/red] (lost on {SUSPECT_RUNNERS}+ different runners in a row,"
            f" not succeeded): {', '.join(stats.suspects)}"
        )
    url = store_url(store)
    if url.startswith(("http://", "https://")):
        from rollfleet.cli.pool import pool_stats_table
        from rollfleet.pool import fetch_pool_stats

        pools = run(fetch_pool_stats(f"{url.rstrip('/')}/pools", token=token_of(token)))
        if pools:
            console.print(pool_stats_table(pools))
        replicas = run(_replicas(url, token_of(token)))
        if replicas:
            console.print(_replica_table(replicas))


async def _replicas(url: str, token: str | None) -> list[dict[str, Any]]:
    """The engine replicas of a control plane serving a gateway ([] when it serves none)."""
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as client:
        reply = await client.get(f"{url.rstrip('/')}/v1/rollfleet/replicas")
    if reply.status_code != 200:
        return []  # no gateway mounted here
    found: list[dict[str, Any]] = reply.json().get("replicas", [])
    return found


def _replica_table(replicas: list[dict[str, Any]]) -> Table:
    table = Table(title=f"Engines ({len(replicas)})")
    for col in ("replica", "engine", "model", "weights version", "in flight", "served"):
        table.add_column(col)
    for r in replicas:
        table.add_row(
            str(r.get("replica_id")),
            str(r.get("engine")),
            str(r.get("model")),
            str(r.get("weights_version")),
            f"{r.get('in_flight')}/{r.get('capacity')}",
            str(r.get("served")),
        )
    return table


def rollouts(
    status: list[RolloutStatus] = typer.Option(None, "--status", case_sensitive=False),
    mode: str = typer.Option(None, "--mode"),
    batch_id: str = typer.Option(None, "--batch"),
    limit: int = typer.Option(20, "--limit"),
    as_json: bool = typer.Option(False, "--json"),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """List rollouts, newest first (``--json``: one JSON object per line)."""

    async def go(s: Store) -> Any:
        return await s.query_rollouts(
            status=status or None, mode=mode, batch_id=batch_id, limit=limit, order="desc"
        )

    page = run(with_store(store, token, go))
    if as_json:
        for r in page.items:
            typer.echo(r.model_dump_json())
        return
    table = Table()
    for col in ("rollout", "status", "mode", "worker", "attempts", "reward", "age"):
        table.add_column(col)
    now = time.time()
    for r in page.items:
        reward = "-" if r.result is None or r.result.reward is None else f"{r.result.reward:.3f}"
        worker = r.attempt.worker_id if r.attempt and r.attempt.worker_id else "-"
        table.add_row(
            r.rollout_id,
            r.status.value.upper(),
            r.mode or "-",
            worker,
            str(r.num_attempts),
            reward,
            fmt_age(now - r.created_at),
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add the store commands to the app."""
    for fn in (serve, enqueue, requeue, cancel, status, rollouts):
        app.command()(fn)
