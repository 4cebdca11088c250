"""The read side of :class:`~rollfleet.store.sql_store.SqlStore`: one rollout, pages of rollouts,
attempts, workers and steps, images, resources, statistics and component state, each a read of
the backend (the SQL is in :mod:`rollfleet.store.reads` and :mod:`rollfleet.store.records`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollfleet.errors import InvalidInput
from rollfleet.model import (
    Attempt,
    AttemptStatus,
    Page,
    Resources,
    Rollout,
    RolloutStatus,
    Statistics,
    Step,
    Worker,
)
from rollfleet.store import reads, records
from rollfleet.store.blobs import Blob

if TYPE_CHECKING:
    from rollfleet.store.sql_store import Backend


def statuses_of(status: Any) -> list[RolloutStatus] | None:
    """A status filter as a list of statuses (None: any); InvalidInput naming a bad one."""
    if status is None:
        return None
    if isinstance(status, (str, RolloutStatus)):
        status = [status]
    try:
        return [RolloutStatus(s) for s in status]
    except ValueError as exc:
        raise InvalidInput(f"status: {exc}") from None


class SqlReads:
    """Every read of the Store protocol over ``self.backend``."""

    backend: Backend

    async def get_rollout(self, rollout_id: str) -> Rollout:
        """Return one rollout or raise NotFound; durable: what it returns survives a power cut."""
        rollout = await self.backend.read(records.get_rollout, rollout_id)
        await self.backend.durable()
        return rollout

    async def query_rollouts(
        self,
        *,
        status: Any = None,
        mode: str | None = None,
        batch_id: str | None = None,
        group_id: str | None = None,
        worker_id: str | None = None,
        search: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        order: str = "asc",
        updated_after: float | None = None,
    ) -> Page[Rollout]:
        """Return a page of rollouts matching the filters (``updated_after``: changed since
        then)."""
        return await self.backend.read(
            lambda tx: reads.query_rollouts(
                tx,
                statuses=statuses_of(status),
                mode=mode,
                batch_id=batch_id,
                group_id=group_id,
                worker_id=worker_id,
                search=search,
                cursor=cursor,
                limit=limit,
                order=order,
                updated_after=updated_after,
            )
        )

    async def query_attempts(
        self,
        rollout_id: str | None = None,
        worker_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> Page[Attempt]:
        """Return a page of attempts."""
        statuses = None if status is None else [AttemptStatus(s) for s in status]
        return await self.backend.read(
            reads.query_attempts, rollout_id, worker_id, statuses, cursor, limit
        )

    async def query_workers(self, cursor: str | None = None, limit: int = 100) -> Page[Worker]:
        """Return a page of workers."""
        return await self.backend.read(reads.query_workers, None, cursor, limit)

    async def query_steps(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        cursor: str | None = None,
        limit: int = 500,
    ) -> Page[Step]:
        """Return a page of a rollout's steps in order."""
        return await self.backend.read(reads.query_steps, rollout_id, attempt_id, cursor, limit)

    async def query_steps_many(
        self, rollout_ids: Sequence[str], cursor: str | None = None, limit: int = 500
    ) -> Page[Step]:
        """Return a page of the steps of up to 1,000 rollouts, by rollout id then sequence."""
        return await self.backend.read(reads.query_steps_many, list(rollout_ids), cursor, limit)

    async def get_blob(self, sha256: str) -> Blob:
        """One image of a trajectory by its sha256 (``rollfleet-blob:<sha256>`` in a step)."""
        return await self.backend.read(reads.get_blob, sha256)

    async def get_latest_resources(self) -> Resources | None:
        """Return the newest resources, or None."""
        return await self.backend.read(reads.get_resources, None)

    async def statistics(self) -> Statistics:
        """Counts by status, queue depth and totals."""
        return await self.backend.read(reads.statistics)

    async def get_state(self, key: str) -> Any:
        """Return the JSON value under a key, or None."""
        return await self.backend.read(reads.kv_get, key)

    async def scan_state(self, prefix: str) -> dict[str, Any]:
        """Return every stored key/value under a prefix."""
        return await self.backend.read(reads.kv_scan, prefix)
