"""The coordinator on every Store backend (SQLite, PostgreSQL, HTTP to each): carry-over, restart, reaping."""

from __future__ import annotations

import asyncio

from conftest import StoreCase

from rollfleet.coordinator import RolloutCoordinator
from rollfleet.model import AttemptStatus, RolloutConfig, RolloutResult


async def test_carry_over_survives_a_new_coordinator(case: StoreCase) -> None:
    store = case.store
    first = RolloutCoordinator(store, poll_interval_s=0.05, collect_tokens=False)
    await first.submit_batch("s1", ["a", "b", "c"], min_wait_num=2)
    attempts = {r.rollout_id: r.attempt.attempt_id for r in await store.claim("w", max_n=10)}
    for rid in ("s1:0:0", "s1:1:0"):
        await store.complete(attempts[rid], AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0))
    assert (await first.finalize_train_batch("s1")).carried_out_task_count == 1

    second = RolloutCoordinator(store, poll_interval_s=0.05, collect_tokens=False)
    await second.submit_batch("s2", ["d"])
    attempts.update({r.rollout_id: r.attempt.attempt_id for r in await store.claim("w", max_n=10)})
    for rid in ("s1:2:0", "s2:0:0"):
        await store.complete(attempts[rid], AttemptStatus.SUCCEEDED, RolloutResult(reward=0.0))
    result = await second.finalize_train_batch("s2")
    assert result.carried_in_task_count == 1 and result.metrics["staleness/max"] == 1.0
    assert await second.finalize_train_batch("s1") == await first.finalize_train_batch("s1")


async def test_dead_dispatch_is_reaped_while_finalize_waits(case: StoreCase) -> None:
    store, clock = case.store, case.clock
    coord = RolloutCoordinator(
        store, poll_interval_s=0.05, reap_interval_s=0.0, collect_tokens=False
    )
    await coord.submit_batch("s1", ["a"], config=RolloutConfig(heartbeat_s=5.0, max_lost=1))
    await store.claim("dead")
    clock.advance(10.0)  # the lease lapses; nobody claims again, so only finalize's reaping notices
    result = await asyncio.wait_for(coord.finalize_train_batch("s1"), 30)
    assert result.rollouts_by_status["failed"] == 1 and result.finished_task_count == 1
