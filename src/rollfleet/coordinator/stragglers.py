"""Rollouts a batch no longer waits for: the straggler policy applied once finalize stops waiting
(carry their groups over to a later train finalize, or cancel them), the carried groups now
finished, and cancelling rollouts (by finalize and by abort)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from rollfleet.coordinator.aggregate import fetch_rollouts
from rollfleet.coordinator.state import BatchState, Carried, StragglerPolicy
from rollfleet.errors import Conflict
from rollfleet.model import ACTIVE_ROLLOUT, Rollout, RolloutStatus
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.coordinator")
AbortHook = Callable[[str], Awaitable[None]]


async def settle_stragglers(
    store: Store, batch: BatchState, abort_hook: AbortHook | None
) -> list[str]:
    """The groups of ``batch`` still running once finalize stops waiting, which it carries over;
    under ``cancel``, and for an eval batch, none: their rollouts are cancelled instead."""
    groups = batch.groups()
    stragglers = [g for g, ids in groups.items() if not batch.task_done(ids)]
    if stragglers and (batch.policy is StragglerPolicy.CANCEL or batch.batch_type == "eval"):
        await cancel_in_batch(store, batch, [r for g in stragglers for r in groups[g]], abort_hook)
        return []
    return stragglers


def carry(batch: BatchState, stragglers: list[str], index: int) -> list[Carried]:
    """The records of the ``stragglers`` groups that train finalize ``index`` carries over."""
    groups = batch.groups()
    return [
        Carried(
            group_id=g,
            rollout_ids=groups[g],
            origin_batch_id=batch.batch_id,
            origin_index=index,
            admitted_at=batch.admitted_at,
            max_staleness=batch.max_staleness,
        )
        for g in stragglers
    ]


async def cancel_in_batch(
    store: Store, batch: BatchState, rollout_ids: list[str], abort_hook: AbortHook | None
) -> None:
    """Cancel these rollouts of ``batch`` (:func:`cancel_rollouts`); note their statuses after."""
    found = await cancel_rollouts(store, rollout_ids, abort_hook)
    batch.statuses.update({r.rollout_id: r.status for r in found})


async def cancel_rollouts(
    store: Store, rollout_ids: list[str], abort_hook: AbortHook | None
) -> list[Rollout]:
    """Cancel the non-terminal rollouts (running ones through the abort hook too); return all of
    them as they are afterwards (one that finished meanwhile keeps its result)."""
    live = [r for r in await fetch_rollouts(store, rollout_ids) if not r.terminal]
    await asyncio.gather(*(_cancel_one(store, r, abort_hook) for r in live))
    return await fetch_rollouts(store, rollout_ids)


async def _cancel_one(store: Store, rollout: Rollout, abort_hook: AbortHook | None) -> None:
    with contextlib.suppress(Conflict):  # it finished meanwhile: the caller keeps its result
        await store.cancel(rollout.rollout_id)
    if rollout.status in ACTIVE_ROLLOUT and abort_hook is not None:
        try:
            await abort_hook(rollout.rollout_id)
        except Exception as exc:  # cancelled in the store: the runner stops at its heartbeat
            log.warning("abort hook failed for %s: %s", rollout.rollout_id, exc)


async def split_pool(store: Store, pool: list[Carried]) -> tuple[list[Carried], list[Carried]]:
    """Carried groups now wholly terminal, and those still running."""
    if not pool:
        return [], []
    found = await fetch_rollouts(store, [r for c in pool for r in c.rollout_ids])
    status = {r.rollout_id: r.status for r in found}

    def done(c: Carried) -> bool:
        return all(status.get(r, RolloutStatus.CANCELLED).terminal for r in c.rollout_ids)

    return [c for c in pool if done(c)], [c for c in pool if not done(c)]
