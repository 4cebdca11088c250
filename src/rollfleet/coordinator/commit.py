"""A finalize's commit, once its wait is over and the straggler policy applied: the check that no
work due under ``max_staleness`` still runs, then the finished groups (and the carried groups now
done) aggregated and the batch persisted ``finalized``, with the new carry pool, in one write.

Nothing finished is dropped: the batch's rollouts are read again here, so every one that ended
while finalize waited, or while it cancelled stragglers, counts.
"""

from __future__ import annotations

import logging

from rollfleet.coordinator.aggregate import batch_result, fetch_rollouts
from rollfleet.coordinator.staleness import consumed
from rollfleet.coordinator.state import (
    BatchLifecycleState,
    BatchState,
    Carried,
    FinalizeResult,
    move_batch,
    save_batch,
)
from rollfleet.coordinator.stragglers import carry, split_pool
from rollfleet.errors import Conflict
from rollfleet.model import now
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.coordinator")


async def check_due(store: Store, batch: BatchState, own: list[str], must: list[str]) -> None:
    """Conflict (the batch stays finalizing) when work due now is still running: the ``own``
    straggler groups of ``batch``, or the carried rollouts it ``must`` consume. Carrying it over
    would make it staler than its max_staleness, and dropping it would lose it."""
    groups = batch.groups()
    left = [r for g in own for r in groups[g]]
    found = await fetch_rollouts(store, must)
    left += [r.rollout_id for r in found if not r.terminal]
    if left:
        raise Conflict(
            f"batch {batch.batch_id}: {len(left)} rollouts (first {left[0]}) must be consumed"
            " by this finalize to stay within max_staleness and are still running: finalize"
            " again later, with a longer timeout"
        )


async def commit(
    store: Store,
    batch: BatchState,
    stragglers: list[str],
    pool: list[Carried],
    index: int | None,
    *,
    collect_tokens: bool,
) -> FinalizeResult:
    """Take the finished groups (and the groups of the carry ``pool`` now done), aggregate,
    persist FINALIZED. A train batch (``index``: its finalize's) records the new carry pool: what
    of ``pool`` still runs, then its ``stragglers``."""
    at = index or 0
    ready, still = await split_pool(store, pool)
    included = consumed(batch, stragglers, ready, at)
    rollouts = await fetch_rollouts(store, list(included))
    carried = carry(batch, stragglers, at)
    result = await batch_result(
        store,
        batch,
        rollouts,
        included,
        carried_in=len(ready),
        carried_out=len(carried),
        collect_tokens=collect_tokens,
    )
    move_batch(batch, BatchLifecycleState.FINALIZED)  # refused if abort_batch ran while we read
    mine = {r.rollout_id: r.status for r in rollouts if r.rollout_id in batch.statuses}
    batch.statuses.update(mine)
    batch.included, batch.final_result, batch.finished_at = included, result, now()
    batch.carried_out = stragglers
    if index is not None:
        batch.finalize_index, batch.carry_pool = index, [*still, *carried]
    await save_batch(store, batch)  # the one write that commits the result and the new carry pool
    log.info(
        "batch %s finalized: %d/%d tasks, %d carried in, %d carried out",
        batch.batch_id,
        result.finished_task_count,
        batch.expected_task_count,
        len(ready),
        len(carried),
    )
    return result
