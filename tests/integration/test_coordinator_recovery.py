"""Crash recovery on a real SQLite file: a coordinator restarted mid-batch, a runner dead at dispatch."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollfleet.client import connect
from rollfleet.coordinator import BatchLifecycleState, RolloutCoordinator
from rollfleet.model import AttemptStatus, RolloutConfig, RolloutResult, RolloutStatus
from rollfleet.store import open_sql_store
from rollfleet.store.base import Store
from rollfleet.testing import FakeClock


async def claim_all(store: Store, worker: str = "w") -> dict[str, str]:
    """Claim everything queued; rollout id → attempt id."""
    return {
        r.rollout_id: r.attempt.attempt_id
        for r in await store.claim(worker, max_n=500)
        if r.attempt
    }


async def finish(store: Store, attempts: dict[str, str], rewards: dict[str, float]) -> None:
    for rid, reward in rewards.items():
        await store.complete(attempts[rid], AttemptStatus.SUCCEEDED, RolloutResult(reward=reward))


async def test_coordinator_killed_mid_finalize_resumes_with_no_loss(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rf.db"
    store_a = connect(url)
    coord_a = RolloutCoordinator(store_a, poll_interval_s=0.05)
    await coord_a.submit_batch("s1", ["a", "b", "c", "d"])
    attempts = await claim_all(store_a)
    await finish(store_a, attempts, {"s1:0:0": 1.0, "s1:1:0": 0.0})
    finalize = asyncio.create_task(coord_a.finalize_train_batch("s1"))
    async with asyncio.timeout(10):
        while (await store_a.get_state("batch/s1"))["state"] != "finalizing":
            await asyncio.sleep(0)
    finalize.cancel()  # the coordinator process dies here
    await store_a.close()

    store_b = connect(url)
    try:
        coord_b = RolloutCoordinator(store_b, poll_interval_s=0.05)
        await coord_b.prepare()
        assert (await coord_b.get_batch("s1")).state is BatchLifecycleState.FINALIZING
        await finish(store_b, attempts, {"s1:2:0": 1.0, "s1:3:0": 1.0})
        result = await coord_b.finalize_train_batch("s1")
        assert result.finished_task_count == 4 and result.rollout_count == 4
        assert result.metrics["reward/mean"] == 0.75
    finally:
        await store_b.close()


async def test_carried_stragglers_survive_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rf.db"
    store_a = connect(url)
    coord_a = RolloutCoordinator(store_a, poll_interval_s=0.05)
    await coord_a.submit_batch("s1", ["a", "b"], min_wait_num=1)
    attempts = await claim_all(store_a)
    await finish(store_a, attempts, {"s1:0:0": 1.0})
    assert (await coord_a.finalize_train_batch("s1")).carried_out_task_count == 1
    await store_a.close()

    store_b = connect(url)
    try:
        coord_b = RolloutCoordinator(store_b, poll_interval_s=0.05)
        await coord_b.submit_batch("s2", ["c"])
        attempts.update(await claim_all(store_b))
        await finish(store_b, attempts, {"s1:1:0": 0.5, "s2:0:0": 1.0})
        result = await coord_b.finalize_train_batch("s2")
        assert result.carried_in_task_count == 1
        assert (await coord_b.get_batch_state("s2")).included == {"s2:0:0": 0, "s1:1:0": 1}
    finally:
        await store_b.close()


async def test_resubmitting_after_a_crash_before_the_batch_was_saved_changes_nothing(
    tmp_path: Path,
) -> None:
    store = connect(f"sqlite:///{tmp_path}/rf.db")
    try:
        await RolloutCoordinator(store).submit_batch("s1", ["a", "b"], repeat_times=2)
        await store.put_state("batch/s1", None)  # as if the process died between enqueue and save
        again = RolloutCoordinator(store)
        batch = await again.submit_batch("s1", ["a", "b"], repeat_times=2)
        assert batch.state is BatchLifecycleState.RUNNING
        assert len((await store.query_rollouts(batch_id="s1")).items) == 4
    finally:
        await store.close()


async def _live_worker(store: Store, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for r in await store.claim("live", wait_s=0.2):
            assert r.attempt is not None
            await store.complete(
                r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
            )


async def test_runner_killed_at_dispatch_does_not_stall_the_batch(tmp_path: Path) -> None:
    clock = FakeClock()
    store = open_sql_store(f"sqlite:///{tmp_path}/rf.db", clock=clock)
    try:
        coord = RolloutCoordinator(store, poll_interval_s=0.05, reap_interval_s=0.0)
        await coord.submit_batch(
            "s1", ["a", "b", "c"], config=RolloutConfig(heartbeat_s=5.0, retry_delay_s=0)
        )
        (dead,) = await store.claim("dead", max_n=1)  # this runner dies right after the claim
        clock.advance(10.0)  # its lease lapses: no heartbeat came
        stop = asyncio.Event()
        worker = asyncio.create_task(_live_worker(store, stop))
        result = await asyncio.wait_for(coord.finalize_train_batch("s1"), 30)
        stop.set()
        await worker
        assert result.finished_task_count == 3 and result.rollouts_by_status["succeeded"] == 3
        retried = await store.get_rollout(dead.rollout_id)
        assert retried.status is RolloutStatus.SUCCEEDED and retried.num_attempts == 2
    finally:
        await store.close()
