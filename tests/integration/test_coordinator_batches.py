"""Submit, finalize and abort against a real embedded SQLite store, for each straggler policy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollfleet.client import connect
from rollfleet.coordinator import BatchLifecycleState, RolloutCoordinator
from rollfleet.errors import Conflict, InvalidInput, NotFound
from rollfleet.model import AttemptStatus, RolloutResult, RolloutStatus
from rollfleet.store.base import Store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = connect(f"sqlite:///{tmp_path}/rf.db")
    yield s
    await s.close()


@pytest.fixture
def coord(store: Store, tmp_path: Path) -> RolloutCoordinator:
    return RolloutCoordinator(store, experience_dir=tmp_path / "xp", poll_interval_s=0.05)


async def claim_all(store: Store) -> dict[str, str]:
    """Claim everything queued; rollout id → attempt id."""
    return {
        r.rollout_id: r.attempt.attempt_id for r in await store.claim("w", max_n=500) if r.attempt
    }


async def finish(store: Store, attempts: dict[str, str], rewards: dict[str, float]) -> None:
    for rid, reward in rewards.items():
        await store.complete(
            attempts[rid],
            AttemptStatus.SUCCEEDED,
            RolloutResult(reward=reward, metrics={"turns": 2.0}),
        )


async def test_submit_enqueues_every_repeat_with_ids_groups_and_persisted_state(
    store: Store, coord: RolloutCoordinator
) -> None:
    await store.add_resources({"model": "m"})
    batch = await coord.submit_batch("s1", [{"q": 1}, {"q": 2}], "train", repeat_times=2)
    assert batch.state is BatchLifecycleState.RUNNING and batch.expected_task_count == 2
    page = await store.query_rollouts(batch_id="s1")
    assert sorted(r.rollout_id for r in page.items) == ["s1:0:0", "s1:0:1", "s1:1:0", "s1:1:1"]
    r = await store.get_rollout("s1:1:1")
    assert r.group_id == "s1:1" and r.input == {"q": 2} and r.metadata["policy_version"] == 1
    saved = await store.get_state("batch/s1")
    assert saved["state"] == "running" and saved["repeat_times"] == 2
    with pytest.raises(Conflict, match="exists already"):
        await coord.submit_batch("s1", [{"q": 1}])
    assert len((await store.query_rollouts(batch_id="s1")).items) == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tasks": []}, "tasks"),
        ({"min_wait_num": 3}, "min_wait_num"),
        ({"repeat_times": 0}, "repeat_times"),
        ({"batch_type": "test"}, "batch_type"),
        ({"policy": "drop"}, "policy"),
        ({"batch_type": "eval", "policy": "carry_over"}, "eval batch cannot carry"),
    ],
)
async def test_submit_refuses_bad_input_by_name(
    coord: RolloutCoordinator, kwargs: dict, match: str
) -> None:
    args = {"batch_id": "bad", "tasks": [1, 2], **kwargs}
    with pytest.raises(InvalidInput, match=match):
        await coord.submit_batch(**args)


async def test_finalize_all_aggregates_and_is_idempotent(
    store: Store, coord: RolloutCoordinator
) -> None:
    await coord.submit_batch("s1", ["a", "b", "c", "d"])
    attempts = await claim_all(store)
    await finish(store, attempts, {"s1:0:0": 1.0, "s1:1:0": 0.0, "s1:2:0": 0.5, "s1:3:0": 0.5})
    result = await coord.finalize_train_batch("s1")
    assert (
        result.batch_id == "s1" and result.batch_type == "train" and result.finished_task_count == 4
    )
    metrics = result.metrics
    assert (
        metrics["reward/mean"] == 0.5
        and metrics["reward/max"] == 1.0
        and metrics["reward/min"] == 0.0
    )
    assert metrics["reward/std"] == pytest.approx(0.125**0.5)
    assert metrics["metric/turns/mean"] == 2.0 and metrics["latency/max"] >= 0.0
    assert await coord.finalize_train_batch("s1") == result
    restarted = RolloutCoordinator(store)
    assert await restarted.finalize_train_batch("s1") == result
    assert (await restarted.get_batch("s1")).state is BatchLifecycleState.FINALIZED


async def test_finalize_unknown_aborted_or_wrong_type_is_a_clear_error(
    store: Store, coord: RolloutCoordinator
) -> None:
    with pytest.raises(NotFound, match="batch nope not found"):
        await coord.finalize_train_batch("nope")
    await coord.submit_batch("ev", [1], "eval")
    with pytest.raises(InvalidInput, match="finalize_eval_batch"):
        await coord.finalize_train_batch("ev")
    await coord.submit_batch("s1", [1])
    await coord.abort_batch("s1", reason="bad weights")
    with pytest.raises(Conflict, match="aborted \\(bad weights\\)"):
        await coord.finalize_train_batch("s1")


async def test_partial_finalize_at_min_wait_num_carries_stragglers_into_next_batch(
    store: Store, coord: RolloutCoordinator
) -> None:
    await coord.submit_batch("s1", ["a", "b", "c", "d"], min_wait_num=3)
    attempts = await claim_all(store)
    await finish(store, attempts, {"s1:0:0": 1.0, "s1:1:0": 1.0, "s1:2:0": 0.0})
    first = await coord.finalize_train_batch("s1", wait_after_min=0.0)
    assert first.finished_task_count == 3 and first.carried_out_task_count == 1
    assert first.metrics["reward/mean"] == pytest.approx(2 / 3)
    straggler = await store.get_rollout("s1:3:0")
    assert straggler.status is RolloutStatus.PREPARING  # still running, not cancelled
    assert (await coord.get_batch("s1")).carried_out == ["s1:3"]

    await coord.submit_batch("s2", ["e", "f"])
    attempts.update(await claim_all(store))
    await finish(store, attempts, {"s1:3:0": 0.25, "s2:0:0": 1.0, "s2:1:0": 1.0})
    second = await coord.finalize_train_batch("s2")
    assert second.finished_task_count == 2 and second.carried_in_task_count == 1
    assert second.rollout_count == 3 and second.metrics["staleness/max"] == 1.0
    assert (await coord.get_batch_state("s2")).included == {"s2:0:0": 0, "s2:1:0": 0, "s1:3:0": 1}
    assert (await coord.get_batch_state("s2")).carry_pool == []


async def test_carried_group_waits_whole_and_grows_staler(
    store: Store, coord: RolloutCoordinator
) -> None:
    await coord.submit_batch("s1", ["a", "b"], min_wait_num=1, repeat_times=2)
    attempts = await claim_all(store)
    await finish(
        store, attempts, {"s1:0:0": 1.0, "s1:0:1": 0.0, "s1:1:0": 0.5}
    )  # s1:1:1 still runs
    assert (await coord.finalize_train_batch("s1")).carried_out_task_count == 1
    await coord.submit_batch("s2", ["c"], repeat_times=2)
    attempts.update(await claim_all(store))
    await finish(store, attempts, {"s2:0:0": 1.0, "s2:0:1": 1.0})
    second = await coord.finalize_train_batch("s2")
    assert second.carried_in_task_count == 0  # half a group never joins: GRPO needs it whole
    await coord.submit_batch("s3", ["d"], repeat_times=2)
    attempts.update(await claim_all(store))
    await finish(store, attempts, {"s1:1:1": 0.0, "s3:0:0": 1.0, "s3:0:1": 0.0})
    third = await coord.finalize_train_batch("s3")
    assert third.carried_in_task_count == 1
    assert {
        k: v for k, v in (await coord.get_batch_state("s3")).included.items() if k.startswith("s1")
    } == {"s1:1:0": 2, "s1:1:1": 2}


async def test_cancel_policy_cancels_stragglers_and_calls_the_abort_hook(
    store: Store, tmp_path: Path
) -> None:
    aborted: list[str] = []

    async def hook(rollout_id: str) -> None:
        aborted.append(rollout_id)

    coord = RolloutCoordinator(store, abort_hook=hook, poll_interval_s=0.05)
    await coord.submit_batch("s1", ["a", "b", "c", "d"], min_wait_num=2, policy="cancel")
    attempts = await claim_all(store)
    await finish(store, attempts, {"s1:0:0": 1.0, "s1:1:0": 0.0})
    result = await coord.finalize_train_batch("s1")
    assert result.finished_task_count == 2 and result.carried_out_task_count == 0
    assert result.rollouts_by_status == {"succeeded": 2, "failed": 0, "cancelled": 2}
    assert sorted(aborted) == ["s1:2:0", "s1:3:0"]
    assert (await store.get_rollout("s1:3:0")).status is RolloutStatus.CANCELLED
    with pytest.raises(Conflict):  # the runner's late result is fenced
        await store.complete(attempts["s1:3:0"], AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0))


async def test_timeout_keeps_every_finished_result(store: Store, coord: RolloutCoordinator) -> None:
    await coord.submit_batch("s1", ["a", "b", "c"], policy="wait")
    attempts = await claim_all(store)
    await finish(store, attempts, {"s1:0:0": 1.0, "s1:1:0": 0.0})
    result = await coord.finalize_train_batch("s1", timeout=0.2)
    assert result.finished_task_count == 2 and result.rollouts_by_status["succeeded"] == 2
    assert result.carried_out_task_count == 1  # a timeout never throws the straggler's work away
    assert (await store.get_rollout("s1:2:0")).status is RolloutStatus.PREPARING


async def test_abort_cancels_queued_and_running_and_keeps_finished_if_asked(store: Store) -> None:
    hooked: list[str] = []

    async def hook(rollout_id: str) -> None:
        hooked.append(rollout_id)
        raise RuntimeError("gateway down")  # a failing hook does not stop the abort

    coord = RolloutCoordinator(store, abort_hook=hook)
    await coord.submit_batch("s1", ["a", "b"])
    attempts = await claim_all(store)
    await coord.submit_batch("s2", ["c"], repeat_times=2)  # stays queued
    await finish(store, attempts, {"s1:0:0": 0.75})
    result = await coord.abort_batch("s1", reason="diverged", keep_partial_results=True)
    assert result.aborted and result.reason == "diverged"
    assert result.metrics["reward/mean"] == 0.75 and result.finished_task_count == 1
    assert hooked == ["s1:1:0"]
    assert (await store.get_rollout("s1:1:0")).status is RolloutStatus.CANCELLED
    assert await coord.abort_batch("s1", reason="again") == result
    queued = await coord.abort_batch("s2", reason="stop")
    assert (
        queued.rollout_count == 0
        and (await store.get_rollout("s2:0:0")).status is RolloutStatus.CANCELLED
    )
    assert (await store.get_state("batch/s2"))["state"] == "aborted"


async def test_abort_of_finalized_batch_is_refused(store: Store, coord: RolloutCoordinator) -> None:
    await coord.submit_batch("s1", ["a"])
    await finish(store, await claim_all(store), {"s1:0:0": 1.0})
    await coord.finalize_train_batch("s1")
    with pytest.raises(Conflict, match="finalized already"):
        await coord.abort_batch("s1", reason="late")


async def test_abort_interrupts_a_finalize_that_is_waiting(
    store: Store, coord: RolloutCoordinator
) -> None:
    await coord.submit_batch("s1", ["a", "b"])
    finalize = asyncio.create_task(coord.finalize_train_batch("s1"))
    async with asyncio.timeout(10):
        while (await coord.get_batch("s1")).state is not BatchLifecycleState.FINALIZING:
            await asyncio.sleep(0)
    await coord.abort_batch("s1", reason="operator")
    with pytest.raises(Conflict, match="aborted"):
        await asyncio.wait_for(finalize, 10)


async def test_eval_batch_reports_at_n_and_at_k(store: Store, coord: RolloutCoordinator) -> None:
    await coord.submit_batch("ev", ["x", "y"], "eval", repeat_times=4)
    attempts = await claim_all(store)
    rewards = {
        "ev:0:0": 1.0,
        "ev:0:1": 0.0,
        "ev:0:2": 0.0,
        "ev:0:3": 1.0,
        "ev:1:0": 0.0,
        "ev:1:1": 0.0,
        "ev:1:2": 0.0,
        "ev:1:3": 0.0,
    }
    await finish(store, attempts, rewards)
    result = await coord.finalize_eval_batch("ev")
    metrics = result.metrics
    assert result.finished_task_count == 2
    assert metrics["mean@4"] == pytest.approx(0.25) and metrics["std@4"] == pytest.approx(0.25)
    assert metrics["best@2"] == pytest.approx(5 / 12) and metrics["worst@2"] == pytest.approx(
        1 / 12
    )
    assert metrics["pass@4"] == pytest.approx(0.5)
    assert await coord.finalize_eval_batch("ev") == result


async def test_eval_timeout_cancels_stragglers_and_keeps_the_rest(
    store: Store, coord: RolloutCoordinator
) -> None:
    await coord.submit_batch("ev", ["x", "y"], "eval", repeat_times=2)
    attempts = await claim_all(store)
    await finish(store, attempts, {"ev:0:0": 1.0, "ev:0:1": 1.0, "ev:1:0": 0.0})
    result = await coord.finalize_eval_batch("ev", timeout=0.1)
    assert result.rollouts_by_status == {"succeeded": 3, "failed": 0, "cancelled": 1}
    assert result.metrics["mean@2"] == pytest.approx(0.5)  # task y scored on the sample it has
