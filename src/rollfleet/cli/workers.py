"""``rollfleet workers``: start N runners (local processes or Ray actors) against a store."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import time

import typer
from rich.live import Live

from rollfleet.cli.common import StoreOpt, TokenOpt, console, job_start, store_url, token_of
from rollfleet.cli.fleet_view import FleetView, summary_line
from rollfleet.client import connect
from rollfleet.compose import control_plane_parts
from rollfleet.envs import EnvSpec
from rollfleet.runner.agent import load_agent
from rollfleet.runner.fleet import BACKENDS, FleetOptions, make_fleet
from rollfleet.runner.spec import LlmAccess
from rollfleet.server.embedded import ServerThread

STATS_TIMEOUT_S = 2.0  # the live summary's statistics call; a slow store only skips an update


def workers(
    n: int = typer.Option(4, "-n", "--num-workers", min=1, help="number of runner processes"),
    agent: str = typer.Option(..., "--agent", help="package.module:function"),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="rollouts at once per runner"),
    backend: str = typer.Option("local", "--backend", help="local (processes) or ray (actors)"),
    ray_address: str = typer.Option(
        None, "--ray-address", help="Ray cluster to join (default: start a local one)"
    ),
    cpus_per_runner: float = typer.Option(
        1.0, "--cpus-per-runner", help="Ray CPUs reserved per runner"
    ),
    grace_s: float = typer.Option(
        30.0, "--grace", help="seconds running rollouts get to finish on shutdown"
    ),
    prefix: str = typer.Option(
        None,
        "--prefix",
        help="worker ids are PREFIX-0 … PREFIX-(n-1) (default: this host's name); a worker id must"
        " name one runner process in the whole fleet",
    ),
    llm_url: str = typer.Option(
        None,
        "--llm-url",
        help="an OpenAI-compatible base URL that gives every rollout ctx.llm (e.g. the control "
        "plane's gateway: URL/v1)",
    ),
    llm_token: str = typer.Option(
        None,
        "--llm-token",
        envvar="ROLLFLEET_LLM_TOKEN",
        help="API key for --llm-url (default with --llm-mint: the --token); runners get it in "
        "their environment, never on a command line",
    ),
    llm_mint: bool = typer.Option(
        False,
        "--llm-mint",
        help="--llm-url is a rollfleet gateway: give each attempt a capability made from the "
        "token (its calls are recorded to that attempt only), never the token",
    ),
    mode: str = typer.Option(
        None, "--mode", help="give every rollout ctx.env as this mode's environment"
    ),
    store: str = StoreOpt,
    token: str = TokenOpt,
) -> None:
    """Run N runners until interrupted; a runner that crashes is restarted with backoff.

    SIGINT/SIGTERM: running rollouts get ``--grace`` seconds, then what still runs is released and
    a runner that has not exited a few seconds later is killed; a second signal releases at once,
    a third kills.
    """
    load_agent(agent)  # a broken agent is one clear error now, not a stream of failed rollouts
    if backend not in BACKENDS:
        raise typer.BadParameter("--backend must be local or ray")
    url, tok = store_url(store), token_of(token)
    prefix = prefix or host_prefix()
    server = None
    if not url.startswith(("http://", "https://")):
        server = ServerThread(url, token=tok, parts=control_plane_parts()).start()
        console.print(f"control plane for {url} at {server.url}")
        url = server.url
    console.print(
        f"▶ Initializing {n} workers ({backend}, concurrency {concurrency}) — agent {agent}"
    )
    if llm_mint and llm_url is None:
        raise typer.BadParameter("--llm-mint needs --llm-url")
    options = FleetOptions(
        url,
        agent,
        n=n,
        concurrency=concurrency,
        backend=backend,
        token=tok,
        ray_address=ray_address,
        cpus_per_runner=cpus_per_runner,
        grace_s=grace_s,
        prefix=prefix,
        llm=LlmAccess(url=llm_url, mint=llm_mint) if llm_url else None,
        llm_token=llm_token or (tok if llm_mint else None),
        env=EnvSpec(mode=job_start(mode, True)) if mode else None,
    )
    try:
        asyncio.run(_run(options))
    finally:
        if server is not None:
            server.stop()


def host_prefix() -> str:
    """This host's short name as a worker id prefix: runners on two machines never share an id
    (a runner registering under an id takes over that id's live attempts)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0])[:60]
    return name or "worker"


async def _run(options: FleetOptions) -> None:
    view = FleetView(console)
    fleet = make_fleet(options, view.event)
    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_signal() -> None:
        signals["n"] += 1
        console.print(
            f"[yellow]stopping: running rollouts get {options.grace_s:g}s to finish, the rest go "
            "back to the queue (again to stop at once)[/]"
            if signals["n"] == 1
            else "[red]stopping now: running rollouts go back to the queue (again to kill)[/]"
            if signals["n"] == 2
            else "[red]killing the runners[/]"
        )
        fleet.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    store = connect(options.store_url, token=options.token)
    started = time.monotonic()
    task = asyncio.create_task(fleet.run())
    try:
        with Live(console=console, refresh_per_second=4, transient=True) as live:
            while not task.done():
                with contextlib.suppress(Exception):  # the summary is bounded: shutdown never waits
                    stats = await asyncio.wait_for(store.statistics(), STATS_TIMEOUT_S)
                    live.update(summary_line(stats, started))
                await asyncio.wait([task], timeout=0.5)
        await task
        with contextlib.suppress(Exception):
            stats = await asyncio.wait_for(store.statistics(), STATS_TIMEOUT_S)
            console.print(summary_line(stats, started))
    finally:
        await store.close()
    if fleet.agent_error:
        raise SystemExit(f"rollfleet: agent cannot start: {fleet.agent_error}")


def register(app: typer.Typer) -> None:
    """Add the workers command to the app."""
    app.command()(workers)
