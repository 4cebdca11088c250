"""``Runner``: one process's loop that claims rollouts and runs many of them at once.

It long-polls for work (no fixed interval), runs up to ``concurrency`` agents as asyncio tasks,
heartbeats every live attempt (stopping an agent the moment the store says its rollout was
cancelled or its lease lost), sends steps in batches, and completes with the result, shielded
from cancellation. ``stop()`` once drains: no new claims, running rollouts get ``grace_s`` to
finish, the rest go back to the queue. ``stop()`` twice releases everything at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollfleet.errors import Conflict, NotFound, RollfleetError
from rollfleet.model import (
    AttemptStatus,
    Completion,
    CompletionOutcome,
    HeartbeatReply,
    Resources,
    Rollout,
    RolloutResult,
    WorkerStatus,
)
from rollfleet.runner.agent import AgentFn, agent_defaults, load_agent, to_result
from rollfleet.runner.batching import NaturalBatcher
from rollfleet.runner.context import RolloutContext
from rollfleet.store.base import Store
from rollfleet.web.errors import error_named

log = logging.getLogger("rollfleet.runner")
EventFn = Callable[..., None]
Hook = Callable[[Rollout], Any]


@dataclass
class RunnerStats:
    """What one runner did."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    stopped_by_store: int = 0
    released: int = 0
    fenced: int = 0


@dataclass
class _Live:
    rollout: Rollout
    ctx: RolloutContext
    task: asyncio.Task[None] | None = None
    release: bool = False
    stopped_by_store: bool = False


def default_worker_id() -> str:
    """A worker id unique on this machine: ``<host>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Runner:
    """Claims rollouts from a store and runs an agent on each, up to ``concurrency`` at once."""

    def __init__(
        self, store: Store, agent: AgentFn | str, *, worker_id: str | None = None, concurrency: int = 1,
        claim_wait_s: float = 2.0, grace_s: float = 30.0, lease_s: float = 15.0,
        llm_factory: Hook | None = None, env: Any = None,
        on_event: EventFn | None = None, metadata: dict[str, Any] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.store = store
        self.agent = load_agent(agent)
        self.agent_timeout_s = agent_defaults(self.agent).get("timeout_s")  # @agent(timeout_s=…) fills in
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency
        self.claim_wait_s = claim_wait_s
        self.grace_s = grace_s
        self.lease_s = lease_s
        self.llm_factory = llm_factory
        self.env = env  # an EnvSource (rollfleet.pool): leased around every rollout as ctx.env
        self.on_event = on_event or (lambda *a, **k: None)
        self.metadata = {"host": socket.gethostname(), "pid": os.getpid(), "concurrency": concurrency,
                         **(metadata or {})}
        self.stats = RunnerStats()
        self._live: dict[str, _Live] = {}
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._aborting = False
        self._resources: tuple[float, Resources | None] = (0.0, None)
        self._completions: NaturalBatcher[Completion, CompletionOutcome] = NaturalBatcher(store.complete_many)
        self._starts: NaturalBatcher[str, HeartbeatReply | None] = NaturalBatcher(self._heartbeat_aligned)

    # --- control --------------------------------------------------------------------------------

    def stop(self) -> None:
        """First call: drain (finish within grace_s, then release). Second call: release now."""
        if self._stopping.is_set():
            self._aborting = True
            for live in self._live.values():
                self._cancel(live, release=True)
        self._stopping.set()

    @property
    def active(self) -> int:
        """How many rollouts this runner is running now."""
        return len(self._live)

    # --- main loop ------------------------------------------------------------------------------

    async def run(self) -> RunnerStats:
        """Run until stop(); returns what was done."""
        await self.store.register_worker(self.worker_id, self.metadata, lease_s=self.lease_s)
        self.on_event("worker_started", worker_id=self.worker_id)
        side = [asyncio.create_task(self._heartbeat_loop(), name="rollfleet-heartbeat"),
                asyncio.create_task(self._flush_loop(), name="rollfleet-steps")]
        try:
            await self._claim_loop(side)
            await self._drain()
        finally:
            for task in side:
                task.cancel()
            for task in side:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(RollfleetError):
                await self.store.update_worker(self.worker_id, WorkerStatus.OFFLINE)
            self.on_event("worker_stopped", worker_id=self.worker_id)
        return self.stats

    async def _claim_loop(self, side: list[asyncio.Task[None]]) -> None:
        stop_wait = asyncio.create_task(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                self._check_side_tasks(side)
                free = self.concurrency - len(self._live)
                if free <= 0:
                    self._slot_freed.clear()
                    await asyncio.wait([stop_wait, asyncio.create_task(self._slot_freed.wait())],
                                       return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
                    continue
                claim = asyncio.create_task(self.store.claim(self.worker_id, self.claim_wait_s, free))
                await asyncio.wait([claim, stop_wait], return_when=asyncio.FIRST_COMPLETED)
                if not claim.done():
                    if self._aborting:
                        claim.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([claim])
                rollouts = await self._claimed(claim)
                if rollouts:
                    await self._start_all(rollouts)
        finally:
            stop_wait.cancel()

    async def _claimed(self, claim: asyncio.Task[list[Rollout]]) -> list[Rollout]:
        if claim.cancelled():
            return []
        exc = claim.exception()
        if exc is not None:
            log.warning("%s: claim failed (%s); retrying", self.worker_id, exc)
            await asyncio.sleep(0.5)
            return []
        return claim.result()

    def _check_side_tasks(self, side: list[asyncio.Task[None]]) -> None:
        for task in side:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"runner side task {task.get_name()} died") from task.exception()

    async def _start_all(self, rollouts: list[Rollout]) -> None:
        resources = await self._latest_resources()
        for rollout in rollouts:
            self.stats.claimed += 1
            ctx = RolloutContext(rollout, resources)
            live = _Live(rollout, ctx)
            assert rollout.attempt is not None
            self._live[rollout.attempt.attempt_id] = live
            if self._stopping.is_set():
                live.release = True
                self._finish_later(live, None)
                continue
            live.task = asyncio.create_task(self._execute(live), name=f"rollout-{rollout.rollout_id}")
            self.on_event("rollout_started", worker_id=self.worker_id, rollout_id=rollout.rollout_id,
                          input=rollout.input)

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
        outcome: tuple[AttemptStatus, RolloutResult | None, str | None] | None = None
        started = asyncio.ensure_future(self._starts.submit(ctx.attempt_id))  # PREPARING → RUNNING, batched
        started.add_done_callback(lambda fut: self._on_started(live, fut))
        try:
            if self.llm_factory is not None:
                ctx.llm = self.llm_factory(rollout)
            async with asyncio.timeout(rollout.config.timeout_s or self.agent_timeout_s):
                try:
                    value = await self._call_agent(rollout, ctx)
                    outcome = (AttemptStatus.SUCCEEDED, to_result(value), None)
                except Exception as exc:
                    outcome = (AttemptStatus.FAILED, None, _describe(exc))
        except TimeoutError:
            outcome = (AttemptStatus.TIMEOUT, None, f"timeout_s={rollout.config.timeout_s} exceeded")
        except asyncio.CancelledError:
            outcome = None  # stopped by the store, or released by this runner's shutdown
        self._finish_later(live, outcome)

    async def _heartbeat_aligned(self, attempt_ids: list[str]) -> list[HeartbeatReply | None]:
        replies = {r.attempt_id: r for r in await self.store.heartbeat_many(attempt_ids, self.worker_id)}
        return [replies.get(a) for a in attempt_ids]

    def _on_started(self, live: _Live, fut: asyncio.Future[HeartbeatReply | None]) -> None:
        """The first heartbeat's answer: an attempt the store no longer knows as live is stopped."""
        if fut.cancelled():
            return
        if fut.exception() is not None:
            log.warning("%s: first heartbeat for %s failed: %s", self.worker_id, live.rollout.rollout_id,
                        fut.exception())
            return
        reply = fut.result()
        if reply is None or not reply.keep_going:
            log.info("%s: %s is no longer ours; stopping it", self.worker_id, live.rollout.rollout_id)
            self._cancel(live, by_store=True)

    async def _call_agent(self, rollout: Rollout, ctx: RolloutContext) -> Any:
        """Run the agent, inside a lease on an environment when the runner has an env source."""
        if self.env is None:
            return await self.agent(rollout.input, ctx)
        async with self.env.lease(attempt_id=ctx.attempt_id, timeout=rollout.config.timeout_s) as instance:
            ctx.env = instance
            return await self.agent(rollout.input, ctx)

    def _finish_later(self, live: _Live, outcome: tuple[AttemptStatus, RolloutResult | None, str | None] | None) -> None:
        """Persist the end of an attempt in a task of its own: cancelling the agent cannot interrupt it."""
        task = asyncio.create_task(self._finish(live, outcome))
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())

    async def _finish(self, live: _Live, outcome: tuple[AttemptStatus, RolloutResult | None, str | None] | None) -> None:
        attempt_id = live.ctx.attempt_id
        try:
            await self._flush(live)
            if live.stopped_by_store:
                self.stats.stopped_by_store += 1
            elif live.release or outcome is None:
                await self.store.release(attempt_id, "runner shutting down")
                self.stats.released += 1
            else:
                status, result, error = outcome
                answer = await self._completions.submit(Completion(attempt_id=attempt_id, status=status,
                                                                   result=result, error=error))
                if answer.rollout_status is None:
                    raise error_named(answer.error_type, answer.error or "refused")
                self._count(status)
                self.on_event("rollout_finished", worker_id=self.worker_id, rollout_id=live.rollout.rollout_id,
                              status=status.value, rollout_status=answer.rollout_status.value,
                              reward=None if result is None else result.reward, error=error)
        except (Conflict, NotFound) as exc:
            self.stats.fenced += 1
            log.info("%s: result for %s refused: %s", self.worker_id, live.rollout.rollout_id, exc)
        except RollfleetError as exc:
            log.warning("%s: could not record the end of %s: %s (its lease will expire and it is retried)",
                        self.worker_id, live.rollout.rollout_id, exc)
        finally:
            self._live.pop(attempt_id, None)
            self._slot_freed.set()
            if not self._live and not self._stopping.is_set():
                with contextlib.suppress(RollfleetError):
                    await self.store.update_worker(self.worker_id, WorkerStatus.IDLE)

    def _count(self, status: AttemptStatus) -> None:
        if status is AttemptStatus.SUCCEEDED:
            self.stats.succeeded += 1
        elif status is AttemptStatus.TIMEOUT:
            self.stats.timed_out += 1
        else:
            self.stats.failed += 1

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
                    log.info("%s: store stopped %s (%s)", self.worker_id, live.rollout.rollout_id, reply.status.value)
                    self._cancel(live, by_store=True)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for live in list(self._live.values()):
                await self._flush(live)

    async def _flush(self, live: _Live) -> None:
        steps = live.ctx.take_steps()
        if not steps:
            return
        try:
            await self.store.add_steps(live.ctx.attempt_id, steps)
        except (Conflict, NotFound):
            pass  # the attempt no longer owns the rollout: its steps are refused, as they must be
        except RollfleetError as exc:
            log.warning("%s: steps for %s not saved: %s", self.worker_id, live.rollout.rollout_id, exc)

    async def _drain(self) -> None:
        pending = [lv.task for lv in self._live.values() if lv.task is not None]
        if pending and not self._aborting:
            await asyncio.wait(pending, timeout=self.grace_s)
        for live in list(self._live.values()):
            self._cancel(live, release=True)
        deadline = time.monotonic() + 30.0
        while self._live and time.monotonic() < deadline:
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), 1.0)


def _describe(exc: BaseException) -> str:
    tail = "".join(traceback.format_exception(exc)[-3:]).strip()
    return f"{type(exc).__name__}: {exc}\n{tail}"[:4000]
