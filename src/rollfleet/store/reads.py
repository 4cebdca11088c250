"""Store reads: pages of rollouts, attempts, steps and workers; resources; statistics; state keys.

Like :mod:`rollfleet.store.ops`, each function runs named queries inside one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollfleet.errors import InvalidInput, NotFound
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
    WorkerStatus,
)
from rollfleet.store.base import MAX_STEP_ROLLOUTS
from rollfleet.store.blobs import Blob
from rollfleet.store.records import _ids, attempt_from_row, dumps, loads, rollout_from_row
from rollfleet.store.tx import Row, Tx

MAX_PAGE = 1000


def query_workers(tx: Tx, worker_id: str | None, cursor: str | None, limit: int) -> Page[Worker]:
    """Return workers by id, with the attempts each one holds now."""
    rows = tx.all(
        "select_workers", worker_id=worker_id, cursor=cursor or "", limit=min(limit, MAX_PAGE)
    )
    live: dict[str, list[str]] = {}
    for att in tx.all("live_attempts_by_worker", ids=_ids([r["worker_id"] for r in rows])):
        live.setdefault(att["worker_id"], []).append(att["attempt_id"])
    items = [
        Worker(
            worker_id=r["worker_id"],
            status=WorkerStatus(r["status"]),
            current_attempts=live.get(r["worker_id"], []),
            registered_at=r["registered_at"],
            last_heartbeat_at=r["last_heartbeat_at"],
            rollouts_succeeded=r["rollouts_succeeded"],
            rollouts_failed=r["rollouts_failed"],
            metadata=loads(r["metadata"]),
        )
        for r in rows
    ]
    if worker_id is not None and not items:
        raise NotFound(f"worker {worker_id} not found")
    more = len(rows) == min(limit, MAX_PAGE)
    return Page(items=items, next_cursor=rows[-1]["worker_id"] if more and rows else None)


def _int_cursor(cursor: str | None, default: int) -> int:
    if cursor is None or cursor == "":
        return default
    try:
        value = int(cursor)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:  # the store's cursors are row numbers: a 64-bit column's range
        raise InvalidInput(f"cursor {cursor[:40]!r} is not a cursor this store returned")
    return value


def query_rollouts(
    tx: Tx,
    *,
    statuses: Sequence[RolloutStatus] | None,
    mode: str | None,
    batch_id: str | None,
    group_id: str | None,
    worker_id: str | None,
    search: str | None,
    cursor: str | None,
    limit: int,
    order: str,
    updated_after: float | None = None,
) -> Page[Rollout]:
    """Return a page of rollouts matching every given filter, oldest or newest first."""
    if order not in ("asc", "desc"):
        raise InvalidInput("order must be 'asc' or 'desc'")
    limit = max(1, min(limit, MAX_PAGE))
    rows = tx.all(
        f"query_rollouts_{order}",
        cursor=_int_cursor(cursor, -1 if order == "asc" else 2**62),
        statuses=None if not statuses else dumps([s.value for s in statuses]),
        mode=mode,
        batch_id=batch_id,
        group_id=group_id,
        worker_id=worker_id,
        search=search or None,
        limit=limit,
        updated_after=updated_after,
    )
    next_cursor = str(rows[-1]["seq"]) if len(rows) == limit else None
    return Page(items=[rollout_from_row(r) for r in rows], next_cursor=next_cursor)


def query_attempts(
    tx: Tx,
    rollout_id: str | None,
    worker_id: str | None,
    statuses: Sequence[AttemptStatus] | None,
    cursor: str | None,
    limit: int,
) -> Page[Attempt]:
    """Return a page of attempts, oldest first."""
    limit = max(1, min(limit, MAX_PAGE))
    rows = tx.all(
        "select_attempts",
        rollout_id=rollout_id,
        worker_id=worker_id,
        cursor=_int_cursor(cursor, -1),
        statuses=None if not statuses else dumps([s.value for s in statuses]),
        limit=limit,
    )
    next_cursor = None
    if len(rows) == limit:
        pos = tx.one("attempt_cursor_column", attempt_id=rows[-1]["attempt_id"])
        next_cursor = str(pos["pos"]) if pos else None
    return Page(items=[attempt_from_row(r) for r in rows], next_cursor=next_cursor)


def query_steps(
    tx: Tx,
    rollout_id: str,
    attempt_id: str | None,
    cursor: str | None,
    limit: int,
) -> Page[Step]:
    """Return a page of a rollout's steps in order."""
    limit = max(1, min(limit, MAX_PAGE))
    rows = tx.all(
        "select_steps",
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        cursor=_int_cursor(cursor, 0),
        limit=limit,
    )
    items = [_step(r) for r in rows]
    return Page(items=items, next_cursor=str(items[-1].sequence) if len(items) == limit else None)


def query_steps_many(
    tx: Tx,
    rollout_ids: Sequence[str],
    cursor: str | None,
    limit: int,
) -> Page[Step]:
    """Return a page of the steps of many rollouts, by rollout id then sequence.

    The cursor is ``<sequence>:<rollout_id>`` of the last step returned (ids may hold colons).
    """
    if len(rollout_ids) > MAX_STEP_ROLLOUTS:
        raise InvalidInput(
            f"query_steps_many: at most {MAX_STEP_ROLLOUTS} rollout ids a call, "
            f"got {len(rollout_ids)}"
        )
    if not rollout_ids:
        return Page(items=[])
    after_sequence, after_id = 0, ""
    if cursor:
        head, sep, after_id = cursor.partition(":")
        if not sep:
            raise InvalidInput(f"cursor {cursor!r} is not a cursor this store returned")
        after_sequence = _int_cursor(head, 0)
    limit = max(1, min(limit, MAX_PAGE))
    rows = tx.all(
        "select_steps_many",
        ids=_ids(rollout_ids),
        after_id=after_id,
        after_sequence=after_sequence,
        limit=limit,
    )
    items = [_step(r) for r in rows]
    if len(items) < limit:
        return Page(items=items)
    return Page(items=items, next_cursor=f"{items[-1].sequence}:{items[-1].rollout_id}")


def _step(r: Row) -> Step:
    return Step(
        rollout_id=r["rollout_id"],
        attempt_id=r["attempt_id"],
        sequence=r["sequence"],
        kind=r["kind"],
        payload=loads(r["payload"]),
        timestamp=r["timestamp"],
    )


def get_blob(tx: Tx, sha256: str) -> Blob:
    """One stored image by its sha256; NotFound if there is none."""
    row = tx.one("select_blob", sha256=sha256)
    if row is None:
        raise NotFound(f"blob {sha256} not found")
    return Blob(row["sha256"], row["media_type"], bytes(row["data"]))


def get_resources(tx: Tx, resources_id: str | None) -> Resources | None:
    """Return the given resources, or the latest when no id is given."""
    row = tx.one("select_resources", resources_id=resources_id)
    if row is None:
        return None
    return Resources(
        resources_id=row["resources_id"],
        version=row["version"],
        values=loads(row["vals"]),
        created_at=row["created_at"],
    )


def statistics(tx: Tx) -> Statistics:
    """Counts by status, queue depth and totals."""
    rollouts = {s.value: 0 for s in RolloutStatus}
    rollouts.update({r["status"]: int(r["n"]) for r in tx.all("count_rollouts_by_status")})
    workers = {s.value: 0 for s in WorkerStatus}
    workers.update({r["status"]: int(r["n"]) for r in tx.all("count_workers_by_status")})
    totals = tx.one("rollout_totals") or {}
    mean = totals.get("reward_mean")
    suspects = tx.all("suspect_rollouts") if totals.get("suspects") else []
    return Statistics(
        rollouts=rollouts,
        workers=workers,
        queue_depth=rollouts["queuing"],
        total_rollouts=sum(rollouts.values()),
        steps=int(totals.get("steps") or 0),
        reward_mean=None if mean is None else float(mean),
        suspects=[r["rollout_id"] for r in suspects],
    )


def kv_get(tx: Tx, key: str) -> Any:
    """Return the JSON value under a key, or None."""
    row = tx.one("kv_get", key=key)
    return None if row is None else loads(row["value"])


def kv_scan(tx: Tx, prefix: str) -> dict[str, Any]:
    """Return every key/value whose key starts with ``prefix``."""
    return {r["key"]: loads(r["value"]) for r in tx.all("kv_scan", prefix=prefix)}
