"""``SqlStore``: the Store protocol over a SQL backend (embedded SQLite or PostgreSQL).

It adds what SQL alone does not give: long-polls woken the moment work is queued or finished,
and a reaper that expires leases in the background (claims also reap on the way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from rollfleet.errors import InvalidInput, NotFound
from rollfleet.model import (
    AttemptStatus,
    Completion,
    CompletionOutcome,
    Handover,
    HeartbeatReply,
    ReapReport,
    Resources,
    Rollout,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    StepIn,
    Worker,
    WorkerStatus,
)
from rollfleet.model import (
    now as wall_now,
)
from rollfleet.store import ops, records, side_writes
from rollfleet.store.sql_reads import SqlReads, statuses_of

log = logging.getLogger("rollfleet.store")
T = TypeVar("T")
BULK = 1000  # a write of more items than this runs off the event loop (see SqliteBackend)
# only matters when another process writes the same database without notifying
FALLBACK_POLL_S = 1.0
# a claim expires lapsed leases first at most this often (store clock); the reaper runs besides.
# Two index range scans a claim were ~8% of a handover's SQL time (issue 34)
CLAIM_REAP_S = 0.1


class Backend(Protocol):
    """What SqlStore needs from a backend."""

    dialect: str

    async def write(
        self,
        fn: Callable[..., T],
        *args: Any,
        durable: bool = True,
        bulk: bool = False,
        committed: Callable[[], None] | None = None,
    ) -> T:
        """Run an operation in a write transaction (``durable``: on disk before it returns;
        ``bulk``: a
        long one, kept off the event loop; ``committed``: called once it is visible to other
        writers)."""
        ...

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an operation in a read transaction (it may see writes not yet on disk)."""
        ...

    async def durable(self) -> None:
        """Return once every write a read made before this call could see is on disk."""
        ...

    async def close(self) -> None:
        """Close connections."""
        ...


class Signal:
    """A broadcast wake-up: every waiter at the time of ``notify`` returns."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Wake everyone waiting now."""
        self._event.set()
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        """The event the next notify sets; take it before checking, then wait on it."""
        return self._event


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


class SqlStore(SqlReads):
    """The Store protocol over a SQL backend."""

    def __init__(self, backend: Backend, *, clock: Callable[[], float] = wall_now) -> None:
        self.backend = backend
        self._clock = clock
        self._queued = Signal()
        self._finished = Signal()
        self._changed = Signal()
        self._reaper: asyncio.Task[None] | None = None
        self._listening = False
        self._reaped_at = float("-inf")  # the store clock at the last claim that reaped

    def _ensure_listening(self) -> None:
        """Start cross-process wake-ups once a loop runs (PostgreSQL LISTEN)."""
        if not self._listening and hasattr(self.backend, "listen"):
            self._listening = True
            self.backend.listen(self)

    def _reap_due(self, now: float) -> bool:
        """Whether a claim at ``now`` reaps first: every CLAIM_REAP_S, or if the clock went back."""
        if self._reaped_at <= now < self._reaped_at + CLAIM_REAP_S:
            return False
        self._reaped_at = now
        return True

    def wake(self, queued: bool = True, finished: bool = True) -> None:
        """Wake long-polls (called by backends that hear of writes from other processes)."""
        if queued:
            self._queued.notify()
        if finished:
            self._finished.notify()
        self._changed.notify()

    async def wait_for_change(self, timeout: float) -> bool:
        """Wait until any write lands (for live views); False when the timeout passed first."""
        self._ensure_listening()  # a replica's dashboard wakes for other replicas' writes too
        event = self._changed.current()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
            return True
        return False

    async def _write(
        self,
        fn: Callable[..., T],
        *args: Any,
        durable: bool = True,
        bulk: bool = False,
        committed: Callable[[], None] | None = None,
    ) -> T:
        result = await self.backend.write(
            fn, *args, durable=durable, bulk=bulk, committed=committed
        )
        self._changed.notify()
        return result

    # --- writes ---------------------------------------------------------------------------------

    async def enqueue_rollout(self, input: Any, mode: str | None = None, **fields: Any) -> Rollout:
        """Queue one rollout (QUEUING); a caller-supplied ``rollout_id`` makes this idempotent."""
        return (await self.enqueue_many([RolloutSpec(input=input, mode=mode, **fields)]))[0]

    async def enqueue_many(self, specs: Sequence[RolloutSpec]) -> list[Rollout]:
        """Queue many rollouts in one transaction: all or nothing."""
        if not specs:
            return []
        # idle claims wake at the commit: new work is visible to them before it is durable
        return await self._write(
            ops.enqueue_many,
            list(specs),
            self._clock(),
            bulk=len(specs) > BULK,
            committed=self._queued.notify,
        )

    async def start_rollout(
        self, input: Any, mode: str | None = None, worker_id: str | None = None, **fields: Any
    ) -> Rollout:
        """Create a rollout already PREPARING and leased to the caller."""
        spec = RolloutSpec(input=input, mode=mode, **fields)
        return await self._write(ops.start_rollout, spec, worker_id, self._clock())

    async def claim(
        self,
        worker_id: str,
        wait_s: float = 0.0,
        max_n: int = 1,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[Rollout]:
        """Lease up to ``max_n`` queued rollouts; waits up to ``wait_s`` for one to arrive.

        ``abandoned`` is asked after every wait: when the caller has gone (an HTTP client that
        disconnected), nothing is leased to it.
        """
        return [
            Rollout.model_validate(doc)
            for doc in await self.claim_documents(worker_id, wait_s, max_n, abandoned)
        ]

    async def claim_documents(
        self,
        worker_id: str,
        wait_s: float = 0.0,
        max_n: int = 1,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[dict[str, Any]]:
        """``claim``, answered as plain JSON values: what the HTTP server sends on without building
        records."""
        if max_n < 1:
            raise InvalidInput("claim: max_n must be at least 1")
        deadline = time.monotonic() + max(0.0, wait_s)
        self._ensure_listening()
        waited = False
        while True:
            if waited and abandoned is not None and await abandoned():
                return []
            waited = True
            event = self._queued.current()
            now = self._clock()
            got, next_at = await self.backend.write(
                ops.claim_or_next, worker_id, max_n, now, self._reap_due(now), durable=False
            )
            if got:
                self._changed.notify()
            remaining = deadline - time.monotonic()
            if got or remaining <= 0:
                return got
            held_back = FALLBACK_POLL_S if next_at is None else max(0.0, next_at - now) + 0.001
            await _wait(event, min(remaining, FALLBACK_POLL_S, held_back))

    async def heartbeat(self, attempt_id: str) -> HeartbeatReply:
        """Extend an attempt's lease; the reply says whether to keep going."""
        replies = await self.heartbeat_many([attempt_id])
        if not replies:
            raise NotFound(f"attempt {attempt_id} not found")
        return replies[0]

    async def heartbeat_many(
        self, attempt_ids: Sequence[str], worker_id: str | None = None
    ) -> list[HeartbeatReply]:
        """Extend several leases and the worker's own heartbeat in one call."""
        return await self._write(
            ops.heartbeat, list(attempt_ids), worker_id, self._clock(), durable=False
        )

    async def add_steps(self, attempt_id: str, steps: Sequence[StepIn]) -> int:
        """Append trajectory steps; refused unless the attempt still owns the rollout."""
        return await self._write(
            ops.add_steps, attempt_id, list(steps), self._clock(), bulk=len(steps) > BULK
        )

    async def complete(
        self,
        attempt_id: str,
        status: AttemptStatus,
        result: RolloutResult | None = None,
        error: str | None = None,
    ) -> Rollout:
        """End an attempt with its outcome; fenced by attempt id."""
        rollout = await self._write(
            ops.complete, attempt_id, AttemptStatus(status), result, error, self._clock()
        )
        self.wake(queued=rollout.status is RolloutStatus.QUEUING, finished=rollout.terminal)
        return rollout

    async def complete_many(self, items: Sequence[Completion]) -> list[CompletionOutcome]:
        """End many attempts in one transaction; each is fenced and answered on its own."""
        if not items:
            return []
        outcomes = await self._write(ops.complete_many, list(items), self._clock())
        statuses = {o.rollout_status for o in outcomes}
        self.wake(
            queued=RolloutStatus.QUEUING in statuses,
            finished=any(s is not None and s.terminal for s in statuses),
        )
        return outcomes

    async def complete_and_claim(
        self, items: Sequence[Completion], worker_id: str, max_n: int = 1
    ) -> Handover:
        """End attempts, then lease up to ``max_n`` rollouts to ``worker_id`` in the same durable
        transaction; a refused completion claims nothing."""
        outcomes, docs = await self._complete_and_claim(items, worker_id, max_n)
        return Handover(outcomes=outcomes, claimed=[Rollout.model_validate(d) for d in docs])

    async def complete_and_claim_documents(
        self, items: Sequence[Completion], worker_id: str, max_n: int = 1
    ) -> dict[str, Any]:
        """``complete_and_claim`` as plain JSON values (what the HTTP server sends on)."""
        outcomes, docs = await self._complete_and_claim(items, worker_id, max_n)
        return {"outcomes": [o.model_dump(mode="json") for o in outcomes], "claimed": docs}

    async def _complete_and_claim(
        self, items: Sequence[Completion], worker_id: str, max_n: int
    ) -> tuple[list[CompletionOutcome], list[dict[str, Any]]]:
        if not 0 <= max_n <= 1000:
            raise InvalidInput("complete_and_claim: max_n must be 0 to 1000")
        if not items:
            raise InvalidInput("complete_and_claim: items must hold at least one completion")
        self._ensure_listening()
        now = self._clock()
        outcomes, docs = await self._write(
            ops.complete_and_claim, list(items), worker_id, max_n, now, self._reap_due(now)
        )
        statuses = {o.rollout_status for o in outcomes}
        self.wake(
            queued=RolloutStatus.QUEUING in statuses,
            finished=any(s is not None and s.terminal for s in statuses),
        )
        return outcomes, docs

    async def release(self, attempt_id: str, reason: str = "released") -> Rollout:
        """Give a rollout back to the queue without charging its retry budget."""
        rollout = await self._write(ops.release, attempt_id, reason, self._clock())
        self._queued.notify()
        return rollout

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout that has not finished."""
        rollout = await self._write(ops.cancel, rollout_id, self._clock())
        self._finished.notify()
        return rollout

    async def requeue(
        self,
        statuses: Sequence[RolloutStatus] = (RolloutStatus.PREPARING,),
        rollout_ids: Sequence[str] | None = None,
        older_than_s: float = 0.0,
    ) -> list[str]:
        """Operator reset: put stuck PREPARING/RUNNING rollouts back in the queue."""
        ids = await self._write(
            ops.requeue,
            statuses_of(statuses) or [],
            rollout_ids,
            older_than_s,
            self._clock(),
            bulk=True,
        )
        if ids:
            log.info("requeued %d rollouts by operator request", len(ids))
            self._queued.notify()
        return ids

    async def reap(self) -> ReapReport:
        """Expire lapsed leases and deadlines now."""
        report = await self._write(ops.reap, self._clock(), durable=False)
        if report.requeued:
            self._queued.notify()
        if report.failed:
            self._finished.notify()
        for kind in ("lost", "timed_out", "requeued", "failed", "workers_offline"):
            ids = getattr(report, kind)
            if ids:
                log.info("reaper: %s %d (%s)", kind, len(ids), ", ".join(ids[:5]))
        return report

    # --- reads ----------------------------------------------------------------------------------

    async def register_worker(
        self, worker_id: str, metadata: dict[str, Any] | None = None, lease_s: float = 30.0
    ) -> Worker:
        """Create or revive a worker as IDLE."""
        worker = await self._write(
            side_writes.register_worker, worker_id, metadata or {}, lease_s, self._clock()
        )
        log.info("worker %s registered", worker_id)
        return worker

    async def update_worker(self, worker_id: str, status: WorkerStatus | None = None) -> Worker:
        """Record a worker's heartbeat and, if given, its status."""
        status = None if status is None else WorkerStatus(status)
        return await self._write(
            side_writes.update_worker, worker_id, status, self._clock(), durable=False
        )

    async def add_resources(
        self, values: dict[str, Any], resources_id: str | None = None
    ) -> Resources:
        """Store a new version of the resources agents use."""
        return await self._write(side_writes.add_resources, values, resources_id, self._clock())

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> list[Rollout]:
        """Wait until every given rollout is terminal or the timeout passes; return them as they
        are. Durable: what it returns survives a power cut (it waits for the sync if need be)."""
        deadline = time.monotonic() + max(0.0, timeout)
        self._ensure_listening()
        ids = list(rollout_ids)
        while True:
            event = self._finished.current()
            rollouts = await self.backend.read(records.get_rollouts, ids)
            remaining = deadline - time.monotonic()
            if all(r.terminal for r in rollouts) or remaining <= 0:
                await self.backend.durable()
                return rollouts
            await _wait(event, min(remaining, FALLBACK_POLL_S))

    async def put_state(self, key: str, value: Any) -> None:
        """Store a JSON value under a key (component state such as batches)."""
        await self._write(side_writes.kv_put, key, value, self._clock())

    # --- lifecycle ------------------------------------------------------------------------------

    def start_reaper(self, interval_s: float = 1.0) -> None:
        """Run the reaper in the background every ``interval_s`` seconds."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(
                self._reap_forever(interval_s), name="rollfleet-reaper"
            )

    async def _reap_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.reap()
            except Exception:  # the reaper must outlive a passing backend error
                log.exception("reaper pass failed")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        """Stop the reaper and close the backend."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await self.backend.close()
