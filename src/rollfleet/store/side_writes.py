"""The store's writes beside the rollout lifecycle: worker rows, versions of the resources agents
use, and component state (key/value JSON, e.g. the coordinator's batches). Each is one function of
a transaction, as in :mod:`rollfleet.store.ops`."""

from __future__ import annotations

from typing import Any

from rollfleet.errors import NotFound
from rollfleet.model import AttemptStatus, Resources, Worker, WorkerStatus, new_id
from rollfleet.store.ends import expire
from rollfleet.store.reads import get_resources, query_workers
from rollfleet.store.records import dumps
from rollfleet.store.tx import Tx


def register_worker(
    tx: Tx, worker_id: str, metadata: dict[str, Any], lease_s: float, now: float
) -> Worker:
    """Create or revive a worker row as IDLE.

    One process holds a worker id at a time, so attempts still live under this id belonged to a
    process that died (a runner restarted after SIGKILL, preemption, the OOM killer): they are
    LOST now, and their rollouts requeued, rather than when their leases lapse.
    """
    live = tx.all("live_attempts_of_worker", worker_id=worker_id)
    reason = f"lost with runner {worker_id}: it restarted"
    expire(tx, {r["attempt_id"]: (AttemptStatus.LOST, reason) for r in live}, now)
    tx.run("upsert_worker", worker_id=worker_id, metadata=dumps(metadata), lease_s=lease_s, now=now)
    return query_workers(tx, worker_id, None, 1).items[0]


def update_worker(tx: Tx, worker_id: str, status: WorkerStatus | None, now: float) -> Worker:
    """Record a worker's heartbeat and, if given, its new status."""
    if not tx.run(
        "touch_worker",
        worker_id=worker_id,
        status=None if status is None else status.value,
        now=now,
        succeeded=0,
        failed=0,
    ):
        raise NotFound(f"worker {worker_id} not found")
    return query_workers(tx, worker_id, None, 1).items[0]


def add_resources(
    tx: Tx, values: dict[str, Any], resources_id: str | None, now: float
) -> Resources:
    """Store a new version of the named resources."""
    rid = resources_id or new_id("res")
    tx.run("insert_resources", resources_id=rid, vals=dumps(values), now=now)
    found = get_resources(tx, rid)
    assert found is not None
    return found


def kv_put(tx: Tx, key: str, value: Any, now: float) -> None:
    """Store a JSON value under a key (used by the coordinator to persist batches)."""
    tx.run("kv_put", key=key, value=dumps(value), now=now)
