"""The ``Store`` protocol: the spine every backend (embedded SQLite, PostgreSQL, HTTP) satisfies.

Code above the store never knows which one it has; one contract suite tests them all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from rollfleet.model import (
    Attempt,
    AttemptStatus,
    Completion,
    CompletionOutcome,
    Handover,
    HeartbeatReply,
    Page,
    ReapReport,
    Resources,
    Rollout,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    Statistics,
    Step,
    StepIn,
    Worker,
    WorkerStatus,
)
from rollfleet.store.blobs import Blob

T = TypeVar("T")
MAX_STEP_ROLLOUTS = 1000  # rollout ids one query_steps_many call may name
PageReader = Callable[[str | None], Awaitable[Page[T]]]


async def iter_pages(read: PageReader[T]) -> AsyncIterator[list[T]]:
    """Every page of a query in order, as lists of items: ``read(cursor)`` fetches one page."""
    cursor: str | None = None
    while True:
        page = await read(cursor)
        yield page.items
        cursor = page.next_cursor
        if cursor is None:
            return


async def read_all(read: PageReader[T]) -> list[T]:
    """Every item of a query, walking its pages (see :func:`iter_pages`)."""
    return [item async for items in iter_pages(read) for item in items]


@runtime_checkable
class Store(Protocol):
    """Durable rollout queue and records; async, the same on every backend."""

    async def enqueue_rollout(self, input: Any, mode: str | None = None, **fields: Any) -> Rollout:
        """Queue one rollout (QUEUING); a caller-supplied ``rollout_id`` makes this idempotent."""
        ...

    async def enqueue_many(self, specs: Sequence[RolloutSpec]) -> list[Rollout]:
        """Queue many rollouts in one transaction: all or nothing."""
        ...

    async def start_rollout(
        self, input: Any, mode: str | None = None, worker_id: str | None = None, **fields: Any
    ) -> Rollout:
        """Create a rollout already PREPARING and leased to the caller."""
        ...

    async def claim(
        self,
        worker_id: str,
        wait_s: float = 0.0,
        max_n: int = 1,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[Rollout]:
        """Lease up to ``max_n`` queued rollouts; waits up to ``wait_s`` for one to arrive.

        ``abandoned`` (in-process callers) says when the caller has gone, so nothing is leased to
        it;
        over HTTP the server watches the client's connection instead.
        """
        ...

    async def claim_documents(
        self,
        worker_id: str,
        wait_s: float = 0.0,
        max_n: int = 1,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[dict[str, Any]]:
        """``claim``, answered as plain JSON values (the wire form of Rollout, not yet validated
        records)."""
        ...

    async def heartbeat(self, attempt_id: str) -> HeartbeatReply:
        """Extend an attempt's lease; the reply says whether to keep going (cancelled, lost…)."""
        ...

    async def heartbeat_many(
        self, attempt_ids: Sequence[str], worker_id: str | None = None
    ) -> list[HeartbeatReply]:
        """Extend several leases and the worker's own heartbeat in one call."""
        ...

    async def add_steps(self, attempt_id: str, steps: Sequence[StepIn]) -> int:
        """Append trajectory steps; refused (Conflict) unless the attempt still owns the rollout."""
        ...

    async def complete(
        self,
        attempt_id: str,
        status: AttemptStatus,
        result: RolloutResult | None = None,
        error: str | None = None,
    ) -> Rollout:
        """End an attempt: SUCCEEDED, FAILED, TIMEOUT or CANCELLED; fenced by attempt id."""
        ...

    async def complete_many(self, items: Sequence[Completion]) -> list[CompletionOutcome]:
        """End many attempts in one call; each is fenced on its own and answered on its own."""
        ...

    async def complete_and_claim(
        self, items: Sequence[Completion], worker_id: str, max_n: int = 1
    ) -> Handover:
        """``complete_many``, then, only if every completion stood, lease up to ``max_n`` rollouts
        to ``worker_id`` (``claim`` without a wait), as one durable transaction: the runner's
        rhythm in one call. A refused (fenced) completion claims nothing and changes nothing."""
        ...

    async def complete_and_claim_documents(
        self, items: Sequence[Completion], worker_id: str, max_n: int = 1
    ) -> dict[str, Any]:
        """``complete_and_claim`` as plain JSON values: ``{"outcomes": […], "claimed": […]}``."""
        ...

    async def release(self, attempt_id: str, reason: str = "released") -> Rollout:
        """Give a rollout back to the queue without charging its retry budget (graceful
        shutdown)."""
        ...

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout that has not finished."""
        ...

    async def requeue(
        self,
        statuses: Sequence[RolloutStatus] = (RolloutStatus.PREPARING,),
        rollout_ids: Sequence[str] | None = None,
        older_than_s: float = 0.0,
    ) -> list[str]:
        """Operator reset: put stuck PREPARING/RUNNING rollouts back in the queue."""
        ...

    async def get_rollout(self, rollout_id: str) -> Rollout:
        """Return one rollout or raise NotFound; only what is on disk (see docs/store.md)."""
        ...

    async def query_rollouts(
        self,
        *,
        status: RolloutStatus | Sequence[RolloutStatus] | None = None,
        mode: str | None = None,
        batch_id: str | None = None,
        group_id: str | None = None,
        worker_id: str | None = None,
        search: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        order: str = "asc",
    ) -> Page[Rollout]:
        """Return a page of rollouts matching the filters."""
        ...

    async def query_attempts(
        self,
        rollout_id: str | None = None,
        worker_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> Page[Attempt]:
        """Return a page of attempts."""
        ...

    async def register_worker(
        self, worker_id: str, metadata: dict[str, Any] | None = None, lease_s: float = 30.0
    ) -> Worker:
        """Create or revive a worker as IDLE."""
        ...

    async def update_worker(self, worker_id: str, status: WorkerStatus | None = None) -> Worker:
        """Record a worker's heartbeat and, if given, its status."""
        ...

    async def query_workers(self, cursor: str | None = None, limit: int = 100) -> Page[Worker]:
        """Return a page of workers."""
        ...

    async def query_steps(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        cursor: str | None = None,
        limit: int = 500,
    ) -> Page[Step]:
        """Return a page of a rollout's steps in order."""
        ...

    async def query_steps_many(
        self, rollout_ids: Sequence[str], cursor: str | None = None, limit: int = 500
    ) -> Page[Step]:
        """Return a page of the steps of up to 1,000 rollouts, by rollout id then sequence."""
        ...

    async def add_resources(
        self, values: dict[str, Any], resources_id: str | None = None
    ) -> Resources:
        """Store a new version of the resources agents use."""
        ...

    async def get_blob(self, sha256: str) -> Blob:
        """One image of a trajectory by its sha256 (``rollfleet-blob:<sha256>`` in a step)."""
        ...

    async def get_latest_resources(self) -> Resources | None:
        """Return the newest resources, or None."""
        ...

    async def statistics(self) -> Statistics:
        """Counts by status, queue depth and totals."""
        ...

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> list[Rollout]:
        """Wait until every given rollout is terminal or the timeout passes; return them as they
        are, once on disk: the read to feed training from (see docs/store.md)."""
        ...

    async def reap(self) -> ReapReport:
        """Expire lapsed leases and deadlines now."""
        ...

    async def put_state(self, key: str, value: Any) -> None:
        """Store a JSON value under a key (component state such as batches)."""
        ...

    async def get_state(self, key: str) -> Any:
        """Return the JSON value under a key, or None."""
        ...

    async def scan_state(self, prefix: str) -> dict[str, Any]:
        """Return every stored key/value under a prefix."""
        ...

    def start_reaper(self, interval_s: float = 1.0) -> None:
        """Reap in the background every ``interval_s`` seconds until closed; needs a running loop.

        A store that a remote server reaps for (HTTP) does nothing here.
        """
        ...

    async def close(self) -> None:
        """Release connections and background tasks (the reaper included)."""
        ...
