"""``RayFleet``: runners as Ray actors, spread across nodes and restarted by Ray when they die.

Each actor runs one ``Runner`` on its own thread from its constructor, so an actor that Ray
restarts resumes claiming by itself. Their rollouts' leases expire and the reaper requeues them.

Ray restarts a dead actor at once, as often as it dies. The local supervisor's policy
(``local.restart_delay``) applies to it too: each incarnation records in the store's state, under
``ray-runner/<worker_id>``, when it started and how many rollouts its worker had finished by
then; a restarted actor reads that back, and backs off (0.5 s, 1 s, ... 30 s) only when the
incarnation before it died without progress: no rollout finished and less than 60 s of life.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollfleet.envs import EnvSpec
from rollfleet.errors import RollfleetError
from rollfleet.runner.process import Tokens, spec_runner
from rollfleet.runner.spec import LlmAccess, RunnerSpec

log = logging.getLogger("rollfleet.runner")

STATE_PREFIX = "ray-runner/"


def restart_decision(previous: dict[str, Any] | None, finished: int, now: float) -> dict[str, Any]:
    """How long a restarted runner actor waits and why, from what the incarnation before it
    recorded (``previous``) and its worker's finished rollouts now (the supervisor's policy)."""
    from rollfleet.runner.local import restart_delay

    prev = previous or {}
    progress = max(0, finished - int(prev.get("finished", 0)))
    ran_s = now - float(prev.get("started_at", now))
    decided = restart_delay(int(prev.get("restarts", 0)), progress, ran_s)
    return {"delay_s": decided.delay_s, "reason": decided.reason, "restarts": decided.in_a_row}


async def _finished(store: Any, worker_id: str) -> int:
    """Rollouts ``worker_id`` has finished (succeeded or failed) according to the store."""
    cursor = None
    while True:
        page = await store.query_workers(cursor=cursor)
        for worker in page.items:
            if worker.worker_id == worker_id:
                return int(worker.rollouts_succeeded + worker.rollouts_failed)
        cursor = page.next_cursor
        if not page.items or cursor is None:
            return 0


async def begin_incarnation(
    store: Any,
    worker_id: str,
    reconstructed: bool,
    wait: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> dict[str, Any] | None:
    """Back off as the previous incarnation deserves (when Ray restarted this actor), then
    record this one's start; returns the decision (None for a first start)."""
    key = STATE_PREFIX + worker_id
    decision = None
    restarts = 0
    if reconstructed:
        finished = await _finished(store, worker_id)
        decision = restart_decision(await store.get_state(key), finished, time.time())
        restarts, delay = decision["restarts"], decision["delay_s"]
        log.warning("%s: restarted by Ray; %s (in %.1f s)", worker_id, decision["reason"], delay)
        await wait(delay)
    record = {"started_at": time.time(), "finished": await _finished(store, worker_id)}
    await store.put_state(key, {**record, "restarts": restarts, "last": decision})
    return decision


class RunnerActor:
    """A Ray actor body: one Runner on a background thread."""

    def __init__(
        self, spec: RunnerSpec, tokens: Tokens, agent: Callable[..., Any] | None = None
    ) -> None:
        """Start the runner ``spec`` describes (``agent``: a callable in place of its agent)."""
        import ray

        from rollfleet.runner.agent import load_agent

        begin = self._begin(spec.store, tokens.store, spec.worker_id, ray.get_runtime_context())
        with ThreadPoolExecutor(1) as apart:  # Ray runs this constructor inside an event loop
            apart.submit(asyncio.run, begin).result()
        load_agent(agent or spec.agent)  # fail the actor's construction, visibly, when broken
        self.worker_id = spec.worker_id
        self._spec, self._tokens, self._agent = spec, tokens, agent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._main, daemon=True, name=f"runner-{spec.worker_id}"
        )
        self._thread.start()

    @staticmethod
    async def _begin(
        store_url: str, token: str | None, worker_id: str, context: Any
    ) -> dict[str, Any] | None:
        from rollfleet.client import connect

        store = connect(store_url, token=token)
        try:
            return await begin_incarnation(
                store, worker_id, bool(context.was_current_actor_reconstructed)
            )
        except Exception as exc:  # noqa: BLE001 - the policy is best effort; the runner reports
            log.warning("%s: restart policy skipped, the store did not answer: %s", worker_id, exc)
            return None
        finally:
            await store.close()

    def _main(self) -> None:
        asyncio.run(self._run())
        self._done.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        async with spec_runner(self._spec, self._tokens, agent=self._agent) as runner:
            self._runner = runner
            await runner.run()

    def ready(self) -> str:
        """Return the worker id once the actor is constructed."""
        return self.worker_id

    def pid(self) -> int:
        """The actor process's id."""
        import os

        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def stop(self, timeout: float = 60.0, drain: bool = True) -> bool:
        """Stop the runner (``drain``: running rollouts finish first) and wait for it."""
        if self._loop is not None and self._runner is not None:
            self._loop.call_soon_threadsafe(lambda: self._runner.stop(drain=drain))
        return self._done.wait(timeout)


def runner_actor_class(cpus: float) -> Any:
    """RunnerActor as a Ray actor class: ``cpus`` each, spread over nodes, restarted by Ray."""
    import ray

    return ray.remote(num_cpus=cpus, max_restarts=-1, scheduling_strategy="SPREAD")(RunnerActor)


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
        llm: LlmAccess | None = None,
        llm_token: str | None = None,
        env: EnvSpec | None = None,
    ) -> None:
        try:
            import ray
        except ImportError as exc:
            raise RollfleetError("the Ray backend needs: pip install 'rollfleet[ray]'") from exc
        self._ray = ray
        self.spec = RunnerSpec(  # each actor's, under its own worker id
            store=store_url,
            agent=agent,
            worker_id=prefix,
            concurrency=concurrency,
            grace_s=grace_s,
            llm=llm or LlmAccess(),
            env=env,
        )
        self.tokens = Tokens(token, llm_token)
        self.n, self.address, self.cpus, self.prefix, self.grace_s = (
            n,
            address,
            cpus_per_runner,
            prefix,
            grace_s,
        )
        self.on_event = on_event or (lambda e: None)
        self.actors: dict[str, Any] = {}
        self._stopping = asyncio.Event()
        self._drain = True
        self.agent_error: str | None = None
        self._connected = False  # this fleet called ray.init, so it disconnects at the end

    def start(self) -> None:
        """Connect to (or start) Ray and create the actors."""
        ray = self._ray
        if not ray.is_initialized():
            self._connected = True
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(
                    include_dashboard=False,
                    log_to_driver=False,
                    num_cpus=max(2, int(self.n * self.cpus) + 1),
                    object_store_memory=100 * 1024 * 1024,
                )
        cls = runner_actor_class(self.cpus)
        for i in range(self.n):
            worker_id = f"{self.prefix}-{i}"
            self.actors[worker_id] = cls.options(
                name=f"rollfleet-{worker_id}-{time.time_ns()}"
            ).remote(self.spec.model_copy(update={"worker_id": worker_id}), self.tokens)
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
        """Start the actors and keep them until stop(); disconnect from Ray if this fleet
        connected (left to exit time, Ray's teardown aborted the process: exit status -6)."""
        try:
            await asyncio.to_thread(self.start)
            await self._stopping.wait()
            await asyncio.to_thread(self._shutdown)
        finally:
            if self._connected:
                await asyncio.to_thread(self._ray.shutdown)

    def _shutdown(self) -> None:
        ray = self._ray
        refs = [a.stop.remote(self.grace_s + 10, self._drain) for a in self.actors.values()]
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=self.grace_s + 30)
        for worker_id, actor in self.actors.items():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            self.on_event({"event": "worker_stopped", "worker_id": worker_id})

    def stop(self, *, drain: bool = True) -> None:
        """Ask every runner actor to exit (``drain``: running rollouts finish first)."""
        self._drain = self._drain and drain
        self._stopping.set()
