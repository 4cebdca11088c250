"""``Runner``: one process's loop that claims rollouts and runs many of them at once.

It long-polls for work (no fixed interval), runs up to ``concurrency`` agents as asyncio tasks,
heartbeats every live attempt (stopping an agent the moment the store says its rollout was
cancelled or its lease lost), sends steps in batches, and completes with the result, shielded
from cancellation. ``stop()`` once drains: no new claims, running rollouts get ``grace_s`` to
finish, the rest go back to the queue. ``stop()`` twice releases everything at once.

What it writes for its attempts (steps, ends) goes through :mod:`.recorder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollfleet.aio import TaskSet
from rollfleet.client.endpoints import Backoff
from rollfleet.errors import RollfleetError
from rollfleet.model import AttemptStatus, HeartbeatReply, Resources, Rollout, WorkerStatus
from rollfleet.runner.agent import Agent, agent_defaults, load_agent, to_result
from rollfleet.runner.batching import NaturalBatcher
from rollfleet.runner.context import AttemptContext
from rollfleet.runner.describe import describe, input_preview
from rollfleet.runner.recorder import (
    AttemptRecorder,
    EventFn,
    Outcome,
    Refill,
    RunnerStats,
    until_reached,
)
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.runner")
RECORD_S = 30.0  # shutdown waits this long for the ends of attempts to be recorded,
CUT_OFF_S = 5.0  # then cancels what is left and waits this long for it to end
# an orphan's (stop(record_s=...)): its launcher, and often the control plane it held, are gone;
# an end not recorded by then comes back to the queue when its lease lapses
ORPHAN_RECORD_S = 5.0
Hook = Callable[[Rollout], Any]


@dataclass
class _Live:
    rollout: Rollout
    ctx: AttemptContext
    task: asyncio.Task[None] | None = None
    release: bool = False
    stopped_by_store: bool = False


def default_worker_id() -> str:
    """A worker id unique on this machine: ``<host>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Runner:
    """Claims rollouts from a store and runs an agent on each, up to ``concurrency`` at once."""

    def __init__(
        self,
        store: Store,
        agent: Agent | str,
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        claim_wait_s: float = 2.0,
        grace_s: float = 30.0,
        lease_s: float = 15.0,
        llm_factory: Hook | None = None,
        env: Any = None,
        on_event: EventFn | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.store = store
        self.agent = load_agent(agent)
        # @agent(timeout_s=…) fills in for rollouts that set no timeout themselves
        self.agent_timeout_s = agent_defaults(self.agent).get("timeout_s")
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency
        self.claim_wait_s = claim_wait_s
        self.grace_s = grace_s
        self.lease_s = lease_s
        self.llm_factory = llm_factory
        self.env = env  # an EnvSource (rollfleet.pool): leased around every rollout as ctx.env
        self.on_event = on_event or (lambda *a, **k: None)
        self.metadata = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "concurrency": concurrency,
            **(metadata or {}),
        }
        self.stats = RunnerStats()
        self._live: dict[str, _Live] = {}
        self._loops = TaskSet(log, self.worker_id)  # heartbeats, step flushes, the stop waiter
        self._work = TaskSet(log, self.worker_id)  # rollouts, their first heartbeats, their ends
        self._wake = asyncio.Event()  # the claim loop looks again: slot freed, stop(), loop ended
        self._stopping = asyncio.Event()
        self._aborted = asyncio.Event()  # the second stop(): release now
        self._aborting = False
        self._record_s = RECORD_S
        self._claim_backoff = Backoff()  # an overloaded server is not asked again in step
        self._resources: tuple[float, Resources | None] = (0.0, None)
        # a completion claims its slot's next rollout in the same request (the runner's rhythm)
        refill = Refill(lambda n: 0 if self._stopping.is_set() else n, self._start_all)
        self._recorder = AttemptRecorder(store, self.worker_id, self.stats, self.on_event, refill)
        self._starts: NaturalBatcher[str, HeartbeatReply | None] = NaturalBatcher(
            self._heartbeat_aligned
        )

    # --- control --------------------------------------------------------------------------------

    def stop(self, *, drain: bool = True, record_s: float = RECORD_S) -> None:
        """Claim nothing more. ``drain``: running rollouts get grace_s to finish, then are
        released; without it (or when already stopping) they are released now. ``record_s``: how
        long the shutdown waits for their ends to be recorded (the shortest any stop gave)."""
        self._record_s = min(self._record_s, record_s)
        release = self._stopping.is_set() or not drain
        self._stopping.set()
        if release:
            self._aborting = True
            self._aborted.set()
            self._release_all()
        self._wake.set()

    @property
    def active(self) -> int:
        """How many rollouts this runner is running now."""
        return len(self._live)

    # --- main loop ------------------------------------------------------------------------------

    async def run(self) -> RunnerStats:
        """Run until stop(); returns what was done."""
        await until_reached(  # a runner started while the server restarts waits for it
            lambda: self.store.register_worker(self.worker_id, self.metadata, lease_s=self.lease_s),
            self.lease_s,
            "registering",
            self.worker_id,
        )
        self.on_event("worker_started", worker_id=self.worker_id)
        side = [
            self._loops.spawn(self._heartbeat_loop(), "rollfleet-heartbeat"),
            self._loops.spawn(self._flush_loop(), "rollfleet-steps"),
        ]
        for task in side:
            task.add_done_callback(lambda _: self._wake.set())  # a dead side loop stops the runner
        try:
            await self._claim_loop(side)
            await self._drain()
        finally:
            await self._end_work()
            await self._loops.cancel()
            with contextlib.suppress(RollfleetError):
                await self.store.update_worker(self.worker_id, WorkerStatus.OFFLINE)
            self.on_event("worker_stopped", worker_id=self.worker_id)
        return self.stats

    async def _claim_loop(self, side: list[asyncio.Task[None]]) -> None:
        stop_wait = self._loops.spawn(self._stopping.wait(), "rollfleet-stop-wait")
        while not self._stopping.is_set():
            self._wake.clear()  # before looking, so that a change from now on wakes the wait below
            self._check_side_tasks(side)
            free = self.concurrency - len(self._live)
            if free <= 0:
                await self._wake.wait()  # a slot freed, stop(), or a side loop ended
                continue
            rollouts = await self._claim(free, stop_wait)
            if rollouts:
                await self._start_all(rollouts)

    async def _claim(self, free: int, stop_wait: asyncio.Task[Any]) -> list[Rollout]:
        """Long-poll for up to ``free`` rollouts; stop() lets it end, a second stop() cuts it."""
        claim = asyncio.create_task(
            self.store.claim(self.worker_id, self.claim_wait_s, free), name="rollfleet-claim"
        )
        try:
            await asyncio.wait([claim, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            if not claim.done():
                aborted = asyncio.ensure_future(self._aborted.wait())
                await asyncio.wait([claim, aborted], return_when=asyncio.FIRST_COMPLETED)
                aborted.cancel()
                if self._aborting:  # released: what the claim may still take goes back by lease
                    claim.cancel()
                await asyncio.wait([claim])
        finally:
            claim.cancel()  # only if run() itself was cancelled while the claim was in flight
        return await self._claimed(claim, stop_wait)

    async def _claimed(
        self, claim: asyncio.Task[list[Rollout]], stop_wait: asyncio.Task[Any]
    ) -> list[Rollout]:
        """The claim's rollouts; after a failure, none, once a backoff (0.5 s doubling to 10 s,
        full jitter, reset by a claim that succeeds) has passed or stop() came."""
        if claim.cancelled():
            return []
        exc = claim.exception()
        if exc is not None:
            pause = self._claim_backoff.delay()
            log.warning("%s: claim failed (%s); retrying in %.1f s", self.worker_id, exc, pause)
            await asyncio.wait([stop_wait], timeout=pause)
            return []
        self._claim_backoff.reset()
        return claim.result()

    def _check_side_tasks(self, side: list[asyncio.Task[None]]) -> None:
        for task in side:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"runner side task {task.get_name()} died") from task.exception()

    async def _start_all(self, rollouts: list[Rollout]) -> None:
        resources = await self._latest_resources()
        for rollout in rollouts:
            self.stats.claimed += 1
            ctx = AttemptContext(rollout, resources)
            ctx.bind(
                functools.partial(self._recorder.record_steps, rollout, ctx.attempt_id),
                functools.partial(self._recorder.earlier_steps, rollout, ctx.attempt_id),
            )
            live = _Live(rollout, ctx)
            assert rollout.attempt is not None
            self._live[rollout.attempt.attempt_id] = live
            if self._stopping.is_set():
                live.release = True
                self._finish_later(live, None)
                continue
            live.task = self._work.spawn(self._execute(live), f"rollout-{rollout.rollout_id}")
            self.on_event(
                "rollout_started",
                worker_id=self.worker_id,
                rollout_id=rollout.rollout_id,
                input=input_preview(rollout.input),
            )

    async def _latest_resources(self) -> Resources | None:
        fetched_at, cached = self._resources
        if time.monotonic() - fetched_at > 1.0:
            with contextlib.suppress(RollfleetError):
                cached = await self.store.get_latest_resources()
            self._resources = (time.monotonic(), cached)
        return cached

    # --- one rollout ----------------------------------------------------------------------------

    async def _execute(self, live: _Live) -> None:
        rollout, ctx = live.rollout, live.ctx
        outcome: Outcome = None
        self._work.spawn(self._first_heartbeat(live), f"rollout-{rollout.rollout_id}-start")
        try:
            async with asyncio.timeout(rollout.config.timeout_s or self.agent_timeout_s):
                try:
                    if (
                        self.llm_factory is not None
                    ):  # its failure is the attempt's, not the runner's
                        ctx.llm = self.llm_factory(rollout)
                    value = await self._call_agent(rollout, ctx)
                    outcome = (AttemptStatus.SUCCEEDED, to_result(value), None)
                except Exception as exc:
                    outcome = (AttemptStatus.FAILED, None, describe(exc))
        except TimeoutError:
            limit = f"timeout_s={rollout.config.timeout_s} exceeded"
            outcome = (AttemptStatus.TIMEOUT, None, limit)
        except asyncio.CancelledError:
            outcome = None  # stopped by the store, or released by this runner's shutdown
        self._finish_later(live, outcome)

    async def _heartbeat_aligned(self, attempt_ids: list[str]) -> list[HeartbeatReply | None]:
        replies = {
            r.attempt_id: r for r in await self.store.heartbeat_many(attempt_ids, self.worker_id)
        }
        return [replies.get(a) for a in attempt_ids]

    async def _first_heartbeat(self, live: _Live) -> None:
        """PREPARING → RUNNING, batched; an attempt the store no longer knows as live is stopped."""
        try:
            reply = await self._starts.submit(live.ctx.attempt_id)
        except Exception as exc:  # logged, as any failed heartbeat is; the heartbeat loop goes on
            log.warning(
                "%s: first heartbeat for %s failed: %s",
                self.worker_id,
                live.rollout.rollout_id,
                exc,
            )
            return
        if reply is None or not reply.keep_going:
            log.info(
                "%s: %s is no longer ours; stopping it", self.worker_id, live.rollout.rollout_id
            )
            self._cancel(live, by_store=True)

    async def _call_agent(self, rollout: Rollout, ctx: AttemptContext) -> Any:
        """Run the agent, inside a lease on an environment when the runner has an env source."""
        if self.env is None:
            return await self.agent(rollout.input, ctx)
        async with self.env.lease(
            attempt_id=ctx.attempt_id, timeout=rollout.config.timeout_s
        ) as instance:
            ctx.env = instance
            return await self.agent(rollout.input, ctx)

    def _finish_later(self, live: _Live, outcome: Outcome) -> None:
        """Record an attempt's end in a task of its own: cancelling the agent cannot stop it."""
        self._work.spawn(self._finish(live, outcome), f"rollout-{live.rollout.rollout_id}-finish")

    async def _finish(self, live: _Live, outcome: Outcome) -> None:
        try:
            await self._recorder.flush(live.rollout, live.ctx)
            await self._recorder.record_end(  # the flags as the flush left them (stop() sets them)
                live.rollout,
                live.ctx.attempt_id,
                outcome,
                release=live.release,
                stopped_by_store=live.stopped_by_store,
            )
        finally:
            self._live.pop(live.ctx.attempt_id, None)
            self._wake.set()
            if not self._live and not self._stopping.is_set():
                with contextlib.suppress(RollfleetError):
                    await self.store.update_worker(self.worker_id, WorkerStatus.IDLE)

    def _cancel(self, live: _Live, *, release: bool = False, by_store: bool = False) -> None:
        live.release = live.release or release
        live.stopped_by_store = live.stopped_by_store or by_store
        if by_store:
            live.ctx.mark_cancelled()
        if live.task is not None and not live.task.done():
            live.task.cancel()

    # --- side tasks -----------------------------------------------------------------------------

    def _heartbeat_interval(self) -> float:
        leases = [lv.rollout.config.heartbeat_s for lv in self._live.values()] or [self.lease_s]
        return max(0.05, min(10.0, min(leases) / 3))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval())
            ids = list(self._live)
            try:
                replies = await self.store.heartbeat_many(ids, self.worker_id)
            except RollfleetError as exc:
                log.warning("%s: heartbeat failed: %s", self.worker_id, exc)
                continue
            for reply in replies:
                live = self._live.get(reply.attempt_id)
                if live is not None and not reply.keep_going and not live.release:
                    log.info(
                        "%s: store stopped %s (%s)",
                        self.worker_id,
                        live.rollout.rollout_id,
                        reply.status.value,
                    )
                    self._cancel(live, by_store=True)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for live in list(self._live.values()):
                await self._recorder.flush(live.rollout, live.ctx)

    async def _drain(self) -> None:
        """Give the running rollouts ``grace_s`` to end (none after a second stop())."""
        running = [lv.task for lv in self._live.values() if lv.task is not None]
        if running and not self._aborting:
            await asyncio.wait(running, timeout=self.grace_s)

    async def _end_work(self) -> None:
        """Release what still runs and wait for every end to be recorded; then cut off the rest.

        After a drain this releases the rollouts that outlived the grace period; after a crash
        (a side loop died) or a cancelled run() it releases them all.
        """
        self._release_all()
        if await self._work.join(self._record_s):
            return
        log.warning(
            "%s: %d tasks did not end within %ss of shutdown; cancelling them",
            self.worker_id,
            len(self._work),
            self._record_s,
        )
        await self._work.cancel(CUT_OFF_S)

    def _release_all(self) -> None:
        for live in list(self._live.values()):
            self._cancel(live, release=True)
