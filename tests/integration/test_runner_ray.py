"""Runners as Ray actors on a real local Ray cluster: they drain the queue; a killed actor's rollouts
come back; Ray's restarts follow the supervisor's policy (backoff only without progress)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ServeProcess, eventually, require

from rollfleet.client import HttpStore
from rollfleet.model import AttemptStatus, RolloutSpec, RolloutStatus

pytestmark = [pytest.mark.timeout(240), pytest.mark.ray]

try:
    import ray
except ImportError:  # pragma: no cover - checked by require()
    ray = None


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    require(ray is not None, "Ray (pip install 'rollfleet[ray]')")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 * 1024 * 1024,
    )
    yield
    ray.shutdown()


def test_restart_decision_backs_off_only_without_progress() -> None:
    from rollfleet.runner.ray_fleet import restart_decision

    now = 1000.0
    first = restart_decision({"started_at": now - 1, "finished": 4, "restarts": 0}, 4, now)
    assert (first["delay_s"], first["restarts"]) == (0.5, 1) and "without progress" in first[
        "reason"
    ]
    third = restart_decision({"started_at": now - 1, "finished": 4, "restarts": 2}, 4, now)
    assert (third["delay_s"], third["restarts"]) == (2.0, 3)
    capped = restart_decision({"started_at": now - 1, "finished": 0, "restarts": 20}, 0, now)
    assert capped["delay_s"] == 30.0
    worked = restart_decision({"started_at": now - 1, "finished": 4, "restarts": 5}, 6, now)
    assert (worked["delay_s"], worked["restarts"]) == (0.0, 0) and "2 rollouts finished" in worked[
        "reason"
    ]
    lived = restart_decision({"started_at": now - 61, "finished": 4, "restarts": 5}, 4, now)
    assert (lived["delay_s"], lived["restarts"]) == (0.0, 0) and "ran 61 s" in lived["reason"]


async def test_two_actors_drain_and_a_killed_actor_is_requeued(
    ray_cluster: None, tmp_path: Path
) -> None:
    from rollfleet.runner.ray_fleet import STATE_PREFIX, RayFleet

    server = ServeProcess(f"sqlite:///{tmp_path}/ray.db").start()
    store = HttpStore(server.url)
    events: list[dict] = []  # type: ignore[type-arg]
    fleet = RayFleet(
        server.url,
        "rollfleet.agents.sleep",
        n=2,
        concurrency=4,
        cpus_per_runner=1,
        grace_s=5,
        on_event=events.append,
    )
    run = asyncio.create_task(fleet.run())
    try:
        specs = [
            RolloutSpec(
                input={"duration": 0.3},
                rollout_id=f"ray-{i}",
                config={"heartbeat_s": 2, "max_attempts": 10},
            )
            for i in range(200)
        ]
        await store.enqueue_many(specs)

        async def victim_busy_after_progress() -> list[str]:
            workers = {w.worker_id: w for w in (await store.query_workers()).items}
            w0 = workers.get("worker-0")
            return (
                list(w0.current_attempts)
                if w0 and w0.rollouts_succeeded and w0.current_attempts
                else []
            )

        held = await eventually(
            victim_busy_after_progress, 120, interval=0.02, what="worker-0 to finish and hold"
        )
        ray.kill(
            fleet.actors["worker-0"], no_restart=False
        )  # Ray restarts it; its leases must expire
        done = await store.wait_for_rollouts([s.rollout_id for s in specs], 180)
        assert all(r.status is RolloutStatus.SUCCEEDED for r in done)
        lost = [
            a for a in (await store.query_attempts(status=[AttemptStatus.LOST], limit=1000)).items
        ]
        assert {a.attempt_id for a in lost} & set(held), (
            "the killed actor's attempts must have been lost"
        )
        for attempt in lost:
            r = await store.get_rollout(attempt.rollout_id)
            assert (
                r.status is RolloutStatus.SUCCEEDED and r.attempt.attempt_id != attempt.attempt_id
            )
        assert {e["worker_id"] for e in events if e["event"] == "worker_started"} == {
            "worker-0",
            "worker-1",
        }
        restarted = await store.get_state(STATE_PREFIX + "worker-0")
        assert restarted["last"]["delay_s"] == 0.0, restarted  # it had finished rollouts: at once
        assert "made progress" in restarted["last"]["reason"]
        assert (await store.get_state(STATE_PREFIX + "worker-1"))["last"] is None  # never restarted
    finally:
        fleet.stop()
        await asyncio.wait_for(run, 120)
        await store.close()
        server.kill()


async def test_an_actor_that_crashes_at_start_is_backed_off(
    ray_cluster: None, tmp_path: Path
) -> None:
    from rollfleet.runner.process import Tokens
    from rollfleet.runner.ray_fleet import STATE_PREFIX, runner_actor_class
    from rollfleet.runner.spec import RunnerSpec

    class CrashesOnLoad:  # a local class: Ray ships it by value; building it kills the process
        def __init__(self) -> None:
            os._exit(3)

        async def rollout(self, input: Any, ctx: Any) -> float:
            return 1.0

    server = ServeProcess(f"sqlite:///{tmp_path}/ray.db").start()
    store = HttpStore(server.url)
    spec = RunnerSpec(store=server.url, agent="crashes:on_load", worker_id="crasher", grace_s=1.0)
    actor = runner_actor_class(0).remote(spec, Tokens(), CrashesOnLoad)
    seen: dict[int, float] = {}  # restarts in a row -> when that incarnation started (wall clock)
    try:

        async def third_backoff() -> bool:
            state = await store.get_state(STATE_PREFIX + "crasher")
            if state is not None:
                seen[state["restarts"]] = state["started_at"]
            return state is not None and state["restarts"] >= 3

        await eventually(
            third_backoff, 120, interval=0.02, what="three restarts of the crashing actor"
        )
        state = await store.get_state(STATE_PREFIX + "crasher")
        assert "without progress" in state["last"]["reason"]
        assert state["last"]["delay_s"] == 0.5 * 2 ** (state["restarts"] - 1)
        gaps = {k: seen[k] - seen[k - 1] for k in seen if k - 1 in seen}
        assert gaps, f"no two consecutive incarnations observed: {seen}"
        for k, gap in gaps.items():  # incarnation k started at least its backoff after k-1
            assert gap >= 0.5 * 2 ** (k - 1), (k, gap, seen)
    finally:
        ray.kill(actor, no_restart=True)
        await store.close()
        server.kill()


async def test_the_workers_command_joins_a_ray_cluster_by_its_address(
    ray_cluster: None, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys

    address = ray.get_runtime_context().gcs_address  # the cluster a user's head node runs
    server = ServeProcess(f"sqlite:///{tmp_path}/cli.db").start()
    store = HttpStore(server.url)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "workers",
            "--backend",
            "ray",
            "--ray-address",
            address,
            "-n",
            "2",
            "--concurrency",
            "2",
            "--prefix",
            "raycli",
            "--agent",
            "rollfleet.agents.sleep",
            "--store",
            server.url,
            "--grace",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        specs = [RolloutSpec(input={"duration": 0.05}, rollout_id=f"cli-{i}") for i in range(12)]
        await store.enqueue_many(specs)
        done = await store.wait_for_rollouts([s.rollout_id for s in specs], 180)
        assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 12
        assert {r.attempt.worker_id for r in done if r.attempt} <= {"raycli-0", "raycli-1"}
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert any("raycli-0" in n for n in named), named  # its actors live in this very cluster
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=90)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
        await store.close()
        server.kill()
