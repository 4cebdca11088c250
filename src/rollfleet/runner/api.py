"""``run_workers``: a fleet of runners from Python (notebooks, trainers), ended by ``.stop()``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from rollfleet.client import connect, default_store_url
from rollfleet.errors import AgentError, InvalidInput
from rollfleet.runner.agent import load_agent
from rollfleet.runner.fleet import BACKENDS, FleetOptions, make_fleet
from rollfleet.runner.runner import Runner
from rollfleet.server.embedded import ServerThread


class Fleet:
    """Runners working in the background; ``stop()`` drains them, ``join()`` waits for the end."""

    def __init__(
        self, start: Callable[[asyncio.Event], Any], server: ServerThread | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._server = server
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(start,), name="rollfleet-fleet", daemon=True
        )
        self._thread.start()
        self._ready.wait()

    def _main(self, start: Callable[[asyncio.Event], Any]) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            self._loop.run_until_complete(start(self._stop))
        except BaseException as exc:  # surfaced to the caller by join()
            self.error = exc
        finally:
            self._loop.close()

    def stop(self, wait: bool = True) -> None:
        """Drain every runner (running rollouts finish, the rest go back to the queue)."""
        if self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if wait:
            self.join()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the fleet to end; re-raise what ended it badly."""
        self._thread.join(timeout)
        if not self._thread.is_alive() and self._server is not None:
            self._server.stop()
            self._server = None
        if self.error is not None:
            raise self.error

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_workers(
    agent: str | Callable[..., Any],
    store: str | None = None,
    *,
    n: int = 4,
    concurrency: int = 1,
    backend: str = "thread",
    token: str | None = None,
    on_event: Callable[..., None] | None = None,
    prefix: str = "worker",
    grace_s: float = 30.0,
    ray_address: str | None = None,
    cpus_per_runner: float = 1.0,
) -> Fleet:
    """Start ``n`` runners of ``agent`` on a store: ``thread`` (here), ``local`` or ``ray``."""
    load_agent(agent)
    url = store or default_store_url()
    if backend == "thread":

        async def start(stop: asyncio.Event) -> None:
            st = connect(url, token=token)
            runners = [
                Runner(
                    st,
                    agent,
                    worker_id=f"{prefix}-{i}",
                    concurrency=concurrency,
                    grace_s=grace_s,
                    on_event=on_event,
                )
                for i in range(n)
            ]
            tasks = [asyncio.create_task(r.run()) for r in runners]
            await stop.wait()
            for r in runners:
                r.stop()
            await asyncio.gather(*tasks)
            await st.close()

        return Fleet(start)
    if backend not in BACKENDS:
        raise InvalidInput(f"backend {backend!r}: choose thread, {' or '.join(BACKENDS)}")
    if not isinstance(agent, str):
        raise AgentError(
            "backend 'local' and 'ray' run agents in other processes: "
            "pass 'package.module:function'"
        )
    server = None
    if not url.startswith(("http://", "https://")):
        server = ServerThread(url, token=token).start()
        url = server.url
    options = FleetOptions(
        url,
        agent,
        n=n,
        concurrency=concurrency,
        backend=backend,
        token=token,
        ray_address=ray_address,
        cpus_per_runner=cpus_per_runner,
        grace_s=grace_s,
        prefix=prefix,
    )
    fleet = make_fleet(options, on_event)

    async def start_fleet(stop: asyncio.Event) -> None:
        task = asyncio.create_task(fleet.run())
        await stop.wait()
        fleet.stop()
        await task

    return Fleet(start_fleet, server)
