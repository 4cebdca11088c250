"""The coordinator as a Ray actor on a real local Ray cluster, sharing a SQLite store with the test."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.client import connect
from rollfleet.coordinator import BatchInfo, BatchLifecycleState, FinalizeResult, get_actor
from rollfleet.model import AttemptStatus, RolloutResult

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    require(importlib.util.find_spec("ray") is not None, "Ray (rollfleet[ray])")
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


async def test_actor_submits_and_finalizes_on_the_shared_store(
    ray_cluster: Any, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path.resolve()}/rf.db"
    actor = get_actor(url, name="coord-test", poll_interval_s=0.05)
    same = get_actor(url, name="coord-test")
    assert same._actor_id == actor._actor_id  # named: found again, not created twice
    state = await actor.submit_batch.remote("s1", ["a", "b"], "train", None, 2)
    assert isinstance(state, BatchInfo) and state.repeat_times == 2
    assert state.state is BatchLifecycleState.RUNNING
    store = connect(url)
    try:
        for r in await store.claim("w", max_n=10):
            assert r.attempt is not None
            await store.complete(
                r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.5)
            )
        result = await actor.finalize_train_batch.remote("s1", timeout=60)
        assert (
            isinstance(result, FinalizeResult)
            and result.finished_task_count == 2
            and result.metrics["reward/mean"] == 0.5
        )
        assert (await store.get_state("batch/s1"))["state"] == "finalized"
    finally:
        await store.close()
        await actor.shutdown.remote()
        ray_cluster.kill(actor)
