"""The runner against a real embedded store: results, steps, failures, timeouts, cancel, shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import runner_agents

from rollfleet.errors import AgentError
from rollfleet.model import AttemptStatus, RolloutSpec, RolloutStatus, WorkerStatus
from rollfleet.runner.runner import Runner
from rollfleet.store import SqlStore, open_sql_store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def store(tmp_path: Path) -> SqlStore:
    s = open_sql_store(f"sqlite:///{tmp_path}/r.db")
    yield s
    await s.close()


async def run_until_done(
    store: SqlStore, runner: Runner, ids: list[str], timeout: float = 60
) -> list:  # type: ignore[type-arg]
    task = asyncio.create_task(runner.run())
    done = await store.wait_for_rollouts(ids, timeout)
    runner.stop()
    await asyncio.wait_for(task, 30)
    return done


async def test_results_steps_and_worker_state(store: SqlStore) -> None:
    made = await store.enqueue_many([RolloutSpec(input=i) for i in range(6)])
    runner = Runner(store, runner_agents.steps_agent, worker_id="w-a", concurrency=3)
    done = await run_until_done(store, runner, [r.rollout_id for r in made])
    assert all(
        r.status is RolloutStatus.SUCCEEDED and r.result.metrics == {"turns": 3.0} for r in done
    )
    assert done[2].result.output == {"echo": 2}
    steps = (await store.query_steps(done[0].rollout_id)).items
    assert [s.payload["i"] for s in steps] == [0, 1, 2]
    worker = (await store.query_workers()).items[0]
    assert (
        worker.worker_id == "w-a"
        and worker.rollouts_succeeded == 6
        and worker.status is WorkerStatus.OFFLINE
    )


async def test_agent_errors_are_recorded_and_retried(store: SqlStore) -> None:
    made = await store.enqueue_rollout("t", config={"max_attempts": 2})
    done = await run_until_done(
        store, Runner(store, runner_agents.failing_agent), [made.rollout_id]
    )
    assert done[0].status is RolloutStatus.FAILED and "ValueError: bad task t" in done[0].error
    assert done[0].num_attempts == 2


async def test_timeout_cancels_the_agent(store: SqlStore) -> None:
    made = await store.enqueue_rollout(
        {"duration": 3600}, config={"timeout_s": 0.2, "max_attempts": 1}
    )
    done = await run_until_done(store, Runner(store, "rollfleet.agents.sleep"), [made.rollout_id])
    assert (
        done[0].status is RolloutStatus.FAILED and done[0].attempt.status is AttemptStatus.TIMEOUT
    )


async def test_cancel_in_the_store_stops_the_agent(store: SqlStore) -> None:
    runner_agents.STARTED = asyncio.Event()
    made = await store.enqueue_rollout("t", config={"heartbeat_s": 0.3})
    runner = Runner(store, runner_agents.waits_for_cancel, worker_id="w-c")
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(runner_agents.STARTED.wait(), 20)
    await store.cancel(made.rollout_id)
    while runner.active:  # the next heartbeat reply stops the agent
        await asyncio.wait_for(runner._wake.wait(), 20)
        runner._wake.clear()
    assert runner.stats.stopped_by_store == 1
    runner.stop()
    await asyncio.wait_for(task, 20)
    assert (await store.get_rollout(made.rollout_id)).status is RolloutStatus.CANCELLED


async def test_stop_twice_releases_running_rollouts_without_charging(store: SqlStore) -> None:
    runner_agents.STARTED = asyncio.Event()
    made = await store.enqueue_rollout("t")
    runner = Runner(store, runner_agents.waits_for_cancel, grace_s=60)
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(runner_agents.STARTED.wait(), 20)
    runner.stop()
    runner.stop()
    await asyncio.wait_for(task, 20)
    back = await store.get_rollout(made.rollout_id)
    assert back.status is RolloutStatus.QUEUING and back.attempts_charged == 0
    assert runner.stats.released == 1


async def test_class_agents_and_dict_results(store: SqlStore) -> None:
    made = await store.enqueue_rollout("t")
    done = await run_until_done(store, Runner(store, runner_agents.ClassAgent), [made.rollout_id])
    assert done[0].result.reward == 2.0 and done[0].result.metrics == {"k": 1.0}


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("no_such_module_xyz:agent", "cannot import no_such_module_xyz"),
        ("runner_agents:missing", "has no attribute 'missing'"),
        ("runner_agents:not_async", "must be an async function"),
        ("runner_agents:one_arg", "must take two arguments"),
    ],
)
async def test_broken_agents_fail_at_start(store: SqlStore, ref: str, message: str) -> None:
    with pytest.raises(AgentError, match=message):
        Runner(store, ref)


async def test_env_is_leased_around_each_rollout(store: SqlStore) -> None:
    from rollfleet.pool import MemoryProvider, env_source

    source = env_source(MemoryProvider(), use_pool=True, num_instances=2)
    made = await store.enqueue_many([RolloutSpec(input=i) for i in range(6)])
    runner = Runner(store, runner_agents.uses_env, concurrency=3, env=source)
    done = await run_until_done(store, runner, [r.rollout_id for r in made])
    used = {r.result.output["instance"] for r in done}
    assert all(r.status is RolloutStatus.SUCCEEDED for r in done) and 1 <= len(used) <= 2
    stats = source.stats()
    await source.close()
    assert stats.size == 2 and stats.acquired == 6 and stats.states.get("busy", 0) == 0


async def test_agent_decorator_timeout_applies_when_the_rollout_sets_none(store: SqlStore) -> None:
    made = await store.enqueue_rollout("t", config={"max_attempts": 1})
    done = await run_until_done(
        store, Runner(store, runner_agents.slow_with_default_timeout), [made.rollout_id]
    )
    assert done[0].attempt.status is AttemptStatus.TIMEOUT


async def test_an_end_recorded_while_the_server_restarts_is_retried_not_lost(
    tmp_path: Path,
) -> None:
    import logging

    from support import ServeProcess, eventually

    from rollfleet.client import HttpStore

    db = f"sqlite:///{tmp_path}/restart.db"
    server = ServeProcess(db).start()
    client = HttpStore(server.url, timeout=5)
    retrying = asyncio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "server unreachable; retrying the end of survivor" in record.getMessage():
                retrying.set()

    seen = Seen()
    logging.getLogger("rollfleet.runner").addHandler(seen)
    logging.getLogger("rollfleet.runner").setLevel(logging.INFO)
    runner = Runner(client, "rollfleet.agents.sleep", worker_id="w-r", concurrency=1)
    task = asyncio.create_task(runner.run())
    try:
        made = await client.enqueue_rollout({"duration": 1.0}, rollout_id="survivor")

        async def running() -> bool:
            return (await client.get_rollout(made.rollout_id)).status is RolloutStatus.RUNNING

        await eventually(running, 30, what="the rollout to run")
        server.kill()  # the agent finishes while nobody listens
        await asyncio.wait_for(retrying.wait(), 30)
        server = ServeProcess(db, port=server.port).start()
        done = (await client.wait_for_rollouts([made.rollout_id], 60))[0]
        assert (
            done.status is RolloutStatus.SUCCEEDED and done.num_attempts == 1
        )  # the first attempt's end landed
    finally:
        logging.getLogger("rollfleet.runner").removeHandler(seen)
        runner.stop()
        await asyncio.wait_for(task, 30)
        await client.close()
        server.kill()
