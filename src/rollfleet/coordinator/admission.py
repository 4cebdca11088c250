"""Admission: a submitted batch's rollouts enqueued now, or held back (state ``pending``, nothing
enqueued) while ``max_staleness`` allows no more, then enqueued, oldest first, once a finalize, an
abort or a weights push makes room; and the policy version the engines serve, as the trainer
reported it, kept in the store. The rules are :mod:`.staleness`'s.

The coordinator passes its state in (its batches, ``trained``: how many train finalizes it has
made, ``version``: the policy version served) and holds its admission lock around each call that
admits.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from rollfleet.coordinator.staleness import admissible, held_back, in_flight
from rollfleet.coordinator.state import BatchLifecycleState, BatchState, move_batch, save_batch
from rollfleet.errors import Conflict, InvalidInput
from rollfleet.model import RolloutSpec, RolloutStatus
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.coordinator")
POLICY_KEY = "coordinator/policy_version"  # the version the engines serve, as the trainer said


async def load_policy_version(store: Store) -> int | None:
    """The policy version the trainer last reported (None: it has reported none)."""
    served = await store.get_state(POLICY_KEY)
    return None if not served else int(served["version"])


async def record_policy_version(store: Store, version: int, served: int | None) -> None:
    """Persist that the engines serve ``version`` now; InvalidInput for what is no version,
    Conflict for one older than ``served`` (the one recorded before)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidInput(f"policy version must be a non-negative integer, got {version!r}")
    if served is not None and version < served:
        raise Conflict(f"policy version {version} is older than {served}, served now")
    await store.put_state(POLICY_KEY, {"version": version})


def fits(batch: BatchState, batches: Collection[BatchState], *, trained: int, version: int) -> bool:
    """True when ``batch``'s bound allows it to start now, behind the train batches in flight."""
    ahead = len(in_flight(batches))
    return admissible(batch.max_staleness, trained, version, ahead)


async def admit(store: Store, batch: BatchState, specs: list[RolloutSpec], version: int) -> None:
    """Enqueue a batch's rollouts (again after a crash: ids are deterministic) and run it."""
    await store.enqueue_many(specs)
    batch.statuses = {rid: RolloutStatus.QUEUING for rid in batch.rollout_ids}
    if batch.batch_type == "train":
        batch.admitted_at = version
    batch.held = []
    move_batch(batch, BatchLifecycleState.RUNNING)
    await save_batch(store, batch)


async def admit_or_hold(
    store: Store,
    batch: BatchState,
    specs: list[RolloutSpec],
    batches: Collection[BatchState],
    *,
    trained: int,
    version: int,
) -> None:
    """Admit a new batch; a bounded one is held instead (its ``specs`` kept in its record) behind
    the batches held already, or while it does not fit."""
    queued = held_back(batches)
    if batch.max_staleness is not None and (
        queued or not fits(batch, batches, trained=trained, version=version)
    ):
        batch.held = specs
        await save_batch(store, batch)
    else:
        await admit(store, batch, specs, version)


async def admit_held(
    store: Store, batches: Collection[BatchState], *, trained: int, version: int
) -> list[str]:
    """Enqueue held batches, oldest first, while max_staleness allows; their ids."""
    admitted: list[str] = []
    for batch in held_back(batches):
        if not fits(batch, batches, trained=trained, version=version):
            break
        await admit(store, batch, batch.held, version)
        admitted.append(batch.batch_id)
        log.info("batch %s admitted at policy version %d", batch.batch_id, version)
    return admitted
