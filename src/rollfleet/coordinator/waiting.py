"""Finalize's wait: every rollout of a batch, or ``min_wait_num`` tasks plus a grace period, or
a timeout; and, whatever the grace, the work due now under ``max_staleness``.

Before ``min_wait_num`` is reached it looks at the count in short slices; past it, one long-poll
to the stop. It runs the store's reaper meanwhile, so a rollout whose runner died at dispatch is
requeued instead of stalling the batch, and it stops with Conflict when the batch is aborted.
"""

from __future__ import annotations

import time

from rollfleet.coordinator.state import (
    BatchLifecycleState,
    BatchState,
    StragglerPolicy,
    check_batch_transition,
)
from rollfleet.model import RolloutStatus
from rollfleet.store.base import Store

MAX_WAIT_SLICE_S = 60.0  # one long-poll at most this long (the HTTP store caps a wait at 300 s)
S = BatchLifecycleState


async def wait_for_batch(
    store: Store,
    batch: BatchState,
    timeout: float | None,
    grace: float,
    whole: bool = False,
    must: list[str] | None = None,
    *,
    poll_interval_s: float = 0.2,
    reap_interval_s: float | None = 1.0,
) -> None:
    """Wait for every rollout, or min_wait_num tasks plus ``grace`` seconds, or the timeout;
    ``whole``: every rollout of the batch; ``must``: these other rollouts too."""
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    wait_all = whole or batch.policy is StragglerPolicy.WAIT
    target = batch.expected_task_count if wait_all else batch.wait_target
    grace_end: float | None = None
    last_reap = start
    others: dict[str, RolloutStatus] = {r: RolloutStatus.QUEUING for r in must or []}
    while True:
        check_batch_transition(batch, S.FINALIZED)  # abort_batch stops a finalize that waits
        owed = [r for r, status in others.items() if not status.terminal]
        pending = [r for r in batch.rollout_ids if not batch.statuses[r].terminal]
        clock = time.monotonic()
        if not (pending or owed) or (deadline is not None and clock >= deadline):
            return
        if grace_end is None and batch.completed_task_count >= target:
            grace_end = clock + grace
        past = grace_end is not None and clock >= grace_end
        if past and not owed:
            return
        watch = owed if past else pending + owed  # past the grace: only the work due now
        stops = [t - clock for t in (deadline, None if past else grace_end) if t is not None]
        # past min_wait_num: one long-poll to the stop; before: short slices to see the count
        if grace_end is None:
            wait = min([poll_interval_s, *stops])
        else:
            wait = min(stops, default=MAX_WAIT_SLICE_S)
        if reap_interval_s is not None and clock - last_reap >= reap_interval_s:
            await store.reap()  # a runner dead at dispatch: its lease lapses, it is requeued
            last_reap = clock
        slice_s = min(MAX_WAIT_SLICE_S, max(0.0, wait))
        found = await store.wait_for_rollouts(watch, timeout=slice_s)
        for r in found:
            (others if r.rollout_id in others else batch.statuses)[r.rollout_id] = r.status
