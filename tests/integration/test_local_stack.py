"""The local stack (rollfleet.run.stack): one context manager starts the control plane and the
runners and stops them in reverse order; ``stop_runners(drain=...)`` finishes or releases what
runs; a killed run's attempts go back to the queue; a runner process takes one typed spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support import eventually

from rollfleet.client import connect
from rollfleet.model import RolloutStatus
from rollfleet.run.stack import local_stack
from rollfleet.runner.local import LocalFleet
from rollfleet.server.embedded import ServerThread

SLEEP = "rollfleet.agents.sleep"
pytestmark = pytest.mark.timeout(120)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_the_stack_runs_rollouts_and_stops_everything_it_started(tmp_path: Path) -> None:
    async with local_stack(tmp_path / "store.db") as stack:
        stack.start_runners(LocalFleet(stack.url, SLEEP, n=2, grace_s=5.0))
        made = [await stack.store.enqueue_rollout({"duration": 0.01}) for _ in range(6)]
        done = await stack.store.wait_for_rollouts([r.rollout_id for r in made], 60)
        assert {r.status for r in done} == {RolloutStatus.SUCCEEDED}
        assert stack.fleet is not None
        fleet = stack.fleet

        async def both_up() -> bool:
            return len(fleet.pids()) == 2

        await eventually(both_up, what="both runners up")
        pids, url = list(fleet.pids().values()), stack.url
    assert not [p for p in pids if alive(p)]
    async with httpx.AsyncClient(timeout=2) as client:
        with pytest.raises(httpx.TransportError):  # the control plane is gone too
            await client.get(f"{url}/health")


@pytest.mark.parametrize("drain", [True, False])
async def test_stop_runners_drains_or_releases_what_runs(tmp_path: Path, drain: bool) -> None:
    async with local_stack(tmp_path / "store.db") as stack:
        stack.start_runners(LocalFleet(stack.url, SLEEP, n=1, grace_s=30.0))
        made = await stack.store.enqueue_rollout({"duration": 2.0})

        async def running() -> bool:
            found = await stack.store.get_rollout(made.rollout_id)
            return found.status is RolloutStatus.RUNNING

        await eventually(running, what="the rollout running")
        await stack.stop_runners(drain=drain)
        after = await stack.store.get_rollout(made.rollout_id)
    # drained: it finished on its runner; released: it went back to the queue, unfinished
    assert after.status is (RolloutStatus.SUCCEEDED if drain else RolloutStatus.QUEUING)


async def test_a_killed_runs_attempts_go_back_to_the_queue(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    with ServerThread(f"sqlite:///{db}") as server:  # a run that died holding an attempt
        store = connect(server.url)
        made = await store.enqueue_rollout({"duration": 0.01})
        [claimed] = await store.claim("dead-runner", wait_s=1.0)
        assert claimed.rollout_id == made.rollout_id
        await store.close()
    async with local_stack(db) as stack:
        back = await stack.store.get_rollout(made.rollout_id)
        assert back.status is RolloutStatus.QUEUING


def test_a_runner_process_names_the_field_its_spec_gets_wrong() -> None:
    spec = '{"store": "http://127.0.0.1:1", "worker_id": "w", "concurrency": 0}'
    done = subprocess.run(
        [sys.executable, "-m", "rollfleet.runner.child", "--spec", spec],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ROLLFLEET_TOKEN": ""},
    )
    assert done.returncode == 2
    assert "--spec: agent: Field required" in done.stderr
    assert "Traceback" not in done.stderr
