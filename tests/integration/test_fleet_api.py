"""``rollfleet.run_workers`` from Python: in-process threads and local processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import runner_agents

import rollfleet
from rollfleet.model import RolloutSpec, RolloutStatus

pytestmark = pytest.mark.timeout(120)


def test_thread_backend_runs_notebook_agents(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    with rollfleet.connect_sync(url) as store:
        made = store.enqueue_many([RolloutSpec(input=i) for i in range(8)])
        with rollfleet.run_workers(runner_agents.steps_agent, url, n=2, concurrency=2):
            done = store.wait_for_rollouts([r.rollout_id for r in made], 60)
        assert all(r.status is RolloutStatus.SUCCEEDED for r in done)
        assert {w.worker_id for w in store.query_workers().items} == {"worker-0", "worker-1"}


def test_local_backend_needs_an_importable_agent(tmp_path: Path) -> None:
    with pytest.raises(rollfleet.AgentError, match="package.module:function"):
        rollfleet.run_workers(
            runner_agents.steps_agent, f"sqlite:///{tmp_path}/x.db", backend="local"
        )


def test_local_backend_with_embedded_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/l.db"
    with rollfleet.connect_sync(url) as store:
        made = store.enqueue_many([RolloutSpec(input={"duration": 0.01}) for _ in range(10)])
    fleet = rollfleet.run_workers("rollfleet.agents.sleep", url, n=2, backend="local", grace_s=5)
    try:
        with rollfleet.connect_sync(url) as store:
            done = store.wait_for_rollouts([r.rollout_id for r in made], 60)
    finally:
        fleet.stop()
    assert all(r.status is RolloutStatus.SUCCEEDED for r in done)
