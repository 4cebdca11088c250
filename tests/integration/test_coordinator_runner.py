"""End to end with the real Runner: dead dispatch, carried stragglers and cancelled stragglers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollfleet.client import connect
from rollfleet.coordinator import RolloutCoordinator, read_experiences
from rollfleet.model import RolloutConfig, RolloutStatus
from rollfleet.runner.runner import Runner
from rollfleet.store.base import Store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = connect(f"sqlite:///{tmp_path}/rf.db")
    yield s
    await s.close()


class GatedAgent:
    """Returns the task's reward at once, except tasks marked slow, which wait for the gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.cancelled: list[str] = []

    async def __call__(self, input: dict[str, Any], ctx: Any) -> float:
        if input.get("slow"):
            try:
                await self.gate.wait()
            except asyncio.CancelledError:  # the runner stops the agent when the store cancels it
                self.cancelled.append(ctx.rollout_id)
                raise
        return float(input["reward"])


async def _running(runner: Runner) -> AsyncIterator[Runner]:
    task = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        runner.stop()
        runner.stop()
        await asyncio.wait_for(task, 30)


async def test_runner_killed_at_dispatch_does_not_stall_the_batch(store: Store) -> None:
    coord = RolloutCoordinator(store, poll_interval_s=0.05, reap_interval_s=0.2)
    tasks = [{"duration": 0.01} for _ in range(6)]
    await coord.submit_batch("s1", tasks, config=RolloutConfig(heartbeat_s=0.6, max_attempts=3))
    (dead,) = await store.claim(
        "killed-runner"
    )  # claimed, then the process died: no heartbeat ever
    runner = Runner(
        store, "rollfleet.agents.sleep", worker_id="live", concurrency=3, claim_wait_s=0.2
    )
    async for _ in _running(runner):
        result = await asyncio.wait_for(coord.finalize_train_batch("s1"), 60)
    assert result.finished_task_count == 6 and result.rollouts_by_status["succeeded"] == 6
    again = await store.get_rollout(dead.rollout_id)
    assert again.status is RolloutStatus.SUCCEEDED and again.num_attempts == 2
    assert again.attempt is not None and again.attempt.worker_id == "live"


async def test_carried_straggler_keeps_running_on_the_runner_and_joins_next_batch(
    store: Store, tmp_path: Path
) -> None:
    coord = RolloutCoordinator(store, experience_dir=tmp_path / "xp", poll_interval_s=0.05)
    agent = GatedAgent()
    runner = Runner(store, agent, worker_id="w", concurrency=8, claim_wait_s=0.2)
    async for _ in _running(runner):
        await coord.submit_batch(
            "s1", [{"reward": 1.0}, {"reward": 0.0}, {"reward": 1.0, "slow": True}], min_wait_num=2
        )
        first = await coord.finalize_train_batch("s1")
        assert first.finished_task_count == 2 and first.carried_out_task_count == 1
        assert (await store.get_rollout("s1:2:0")).status is RolloutStatus.RUNNING
        await coord.submit_batch("s2", [{"reward": 0.5}])
        agent.gate.set()
        second = await coord.finalize_train_batch("s2")
    assert second.carried_in_task_count == 1 and agent.cancelled == []
    out = await coord.process_experiences("s2")
    rows = {e.rollout_id: e for e in read_experiences(out.path)}
    assert (
        rows["s1:2:0"].staleness == 1
        and rows["s1:2:0"].reward == 1.0
        and rows["s2:0:0"].staleness == 0
    )


async def test_cancel_policy_stops_the_straggling_agent_through_the_store(store: Store) -> None:
    coord = RolloutCoordinator(store, poll_interval_s=0.05)
    agent = GatedAgent()
    runner = Runner(store, agent, worker_id="w", concurrency=4, claim_wait_s=0.2)
    async for _ in _running(runner):
        await coord.submit_batch(
            "s1",
            [{"reward": 1.0}, {"reward": 1.0, "slow": True}],
            config=RolloutConfig(heartbeat_s=0.6),
            min_wait_num=1,
            policy="cancel",
        )
        result = await coord.finalize_train_batch("s1")
        async with asyncio.timeout(30):
            while not agent.cancelled:  # the runner hears of the cancel on its next heartbeat
                await asyncio.sleep(0.05)
    assert result.rollouts_by_status == {"succeeded": 1, "failed": 0, "cancelled": 1}
    assert agent.cancelled == ["s1:1:0"]
    assert (await store.get_rollout("s1:1:0")).status is RolloutStatus.CANCELLED
