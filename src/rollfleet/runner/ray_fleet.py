"""``RayFleet``: runners as Ray actors, spread across nodes and restarted by Ray when they die.

Each actor runs one ``Runner`` on its own thread from its constructor, so an actor that Ray
restarts resumes claiming by itself. Their rollouts' leases expire and the reaper requeues them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from rollfleet.errors import RollfleetError

log = logging.getLogger("rollfleet.runner")


class RunnerActor:
    """A Ray actor body: one Runner on a background thread."""

    def __init__(
        self,
        store_url: str,
        agent: str,
        worker_id: str,
        concurrency: int,
        token: str | None,
        grace_s: float,
    ) -> None:
        from rollfleet.runner.agent import load_agent

        load_agent(agent)  # fail the actor's construction, visibly, for a broken agent
        self.worker_id = worker_id
        self._args = (store_url, agent, worker_id, concurrency, token, grace_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"runner-{worker_id}")
        self._thread.start()

    def _main(self) -> None:
        asyncio.run(self._run())
        self._done.set()

    async def _run(self) -> None:
        from rollfleet.client import connect
        from rollfleet.runner.runner import Runner

        store_url, agent, worker_id, concurrency, token, grace_s = self._args
        store = connect(store_url, token=token)
        self._loop = asyncio.get_running_loop()
        self._runner = Runner(
            store, agent, worker_id=worker_id, concurrency=concurrency, grace_s=grace_s
        )
        try:
            await self._runner.run()
        finally:
            await store.close()

    def ready(self) -> str:
        """Return the worker id once the actor is constructed."""
        return self.worker_id

    def pid(self) -> int:
        """The actor process's id."""
        import os

        return os.getpid()

    def stop(self, timeout: float = 60.0) -> bool:
        """Drain the runner and wait for it to stop."""
        if self._loop is not None and self._runner is not None:
            self._loop.call_soon_threadsafe(self._runner.stop)
        return self._done.wait(timeout)


class RayFleet:
    """N runner actors on a Ray cluster with the LocalFleet interface (run/stop)."""

    def __init__(
        self,
        store_url: str,
        agent: str,
        *,
        n: int = 4,
        concurrency: int = 1,
        token: str | None = None,
        address: str | None = None,
        cpus_per_runner: float = 1.0,
        prefix: str = "worker",
        grace_s: float = 30.0,
        on_event: Any = None,
    ) -> None:
        try:
            import ray
        except ImportError as exc:
            raise RollfleetError("the Ray backend needs: pip install 'rollfleet[ray]'") from exc
        self._ray = ray
        self.store_url, self.agent, self.n, self.concurrency = store_url, agent, n, concurrency
        self.token, self.address, self.cpus, self.prefix, self.grace_s = (
            token,
            address,
            cpus_per_runner,
            prefix,
            grace_s,
        )
        self.on_event = on_event or (lambda e: None)
        self.actors: dict[str, Any] = {}
        self._stopping = asyncio.Event()
        self.agent_error: str | None = None

    def start(self) -> None:
        """Connect to (or start) Ray and create the actors."""
        ray = self._ray
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(
                    include_dashboard=False,
                    log_to_driver=False,
                    num_cpus=max(2, int(self.n * self.cpus) + 1),
                    object_store_memory=100 * 1024 * 1024,
                )
        cls = ray.remote(num_cpus=self.cpus, max_restarts=-1, scheduling_strategy="SPREAD")(
            RunnerActor
        )
        for i in range(self.n):
            worker_id = f"{self.prefix}-{i}"
            self.actors[worker_id] = cls.options(
                name=f"rollfleet-{worker_id}-{time.time_ns()}"
            ).remote(
                self.store_url, self.agent, worker_id, self.concurrency, self.token, self.grace_s
            )
        for worker_id, actor in self.actors.items():
            try:
                self._await_ready(actor, time.monotonic() + 120)
            except Exception as exc:
                self.agent_error = str(exc)
                raise RollfleetError(f"runner actor {worker_id} failed to start: {exc}") from exc
            self.on_event({"event": "worker_started", "worker_id": worker_id})

    def _await_ready(self, actor: Any, deadline: float) -> None:
        """Wait for an actor's constructor; one that Ray restarts meanwhile is asked again."""
        ray = self._ray
        while True:
            try:
                ray.get(actor.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except ray.exceptions.ActorUnavailableError:
                # killed or crashed while starting: Ray restarts it (max_restarts=-1)
                if time.monotonic() >= deadline:
                    raise

    async def run(self) -> None:
        """Start the actors and keep them until stop()."""
        await asyncio.to_thread(self.start)
        await self._stopping.wait()
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        ray = self._ray
        refs = [a.stop.remote(self.grace_s + 10) for a in self.actors.values()]
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=self.grace_s + 30)
        for worker_id, actor in self.actors.items():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            self.on_event({"event": "worker_stopped", "worker_id": worker_id})

    def stop(self) -> None:
        """Ask every runner actor to drain and exit."""
        self._stopping.set()
