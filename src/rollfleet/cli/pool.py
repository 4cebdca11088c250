"""``rollfleet pool``: serve pools declared in a config file, show their stats.

The lead's CLI calls :func:`register`; ``python -m rollfleet.cli.pool`` runs the group alone.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from rollfleet.errors import RollfleetError
from rollfleet.pool.base import PoolStats

console = Console()


def pool_stats_table(stats: list[PoolStats]) -> Table:
    """A rich table of pools: states, waiting, wait percentiles, utilisation, health."""
    table = Table(title="pools")
    for column in (
        "pool",
        "provider",
        "size",
        "healthy",
        "states",
        "waiting",
        "wait p50/p99 (s)",
        "utilisation",
        "replaced",
    ):
        table.add_column(column)
    for s in stats:
        states = " ".join(f"{k.lower()}={v}" for k, v in s.states.items() if v)
        healthy = f"[red]{s.healthy} (degraded)[/red]" if s.degraded else str(s.healthy)
        table.add_row(
            s.name,
            s.provider,
            str(s.size),
            healthy,
            states,
            str(s.waiting),
            f"{s.wait_p50_s:.3f}/{s.wait_p99_s:.3f}",
            f"{s.utilisation:.0%}",
            str(s.replacements),
        )
    return table


def serve(
    config: Annotated[Path, typer.Option("--config", help="pools config file (TOML or JSON)")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8787,
    token: Annotated[
        str | None, typer.Option(envvar="ROLLFLEET_TOKEN", help="require this bearer token")
    ] = None,
) -> None:
    """Serve the pools declared in CONFIG under /pools (leases, renewals, stats)."""
    import uvicorn

    from rollfleet.pool.config import load_registry
    from rollfleet.pool.service import pool_app
    from rollfleet.web.serving import check_bind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        check_bind(host, token)
        registry = load_registry(config)
    except RollfleetError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from exc
    console.print(f"serving pools {', '.join(registry.names)} on http://{host}:{port}/pools")
    from rollfleet.web.guard import GUARD
    from rollfleet.web.serving import uvicorn_options

    uvicorn.run(
        pool_app(registry, token=token),
        host=host,
        port=port,
        log_level="warning",
        **uvicorn_options(GUARD),
    )


def status(
    url: Annotated[
        str, typer.Option(help="the pools root of a server")
    ] = "http://127.0.0.1:8787/pools",
    token: Annotated[str | None, typer.Option(envvar="ROLLFLEET_TOKEN")] = None,
) -> None:
    """Show every pool's instances, waiting acquires and utilisation."""
    from rollfleet.pool.remote import fetch_pool_stats

    try:
        stats = asyncio.run(fetch_pool_stats(url, token=token))
    except RollfleetError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from exc
    console.print(pool_stats_table(stats))


def register(app: typer.Typer) -> None:
    """Add the ``pool`` command group to the rollfleet CLI."""
    group = typer.Typer(
        help="Resource pools: M expensive environments shared by N rollouts.", no_args_is_help=True
    )
    group.command("serve")(serve)
    group.command("status")(status)
    app.add_typer(group, name="pool")


if __name__ == "__main__":
    root = typer.Typer(no_args_is_help=True)
    register(root)
    root(prog_name="rollfleet")
