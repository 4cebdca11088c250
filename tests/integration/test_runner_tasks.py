"""The runner's own tasks on a real embedded store: none piles up, none is left, crashes named.

A long busy period (every slot held by an agent the test keeps waiting) is measured in ticks of
the runner's heartbeat loop, counted by a thin wrapper around the real store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from rollfleet.model import RolloutConfig, RolloutSpec, RolloutStatus
from rollfleet.runner.runner import Runner
from rollfleet.store import SqlStore, open_sql_store

pytestmark = pytest.mark.timeout(120)
HEARTBEAT_S = 0.6  # the runner heartbeats every HEARTBEAT_S / 3 while these rollouts run
LONG_BUSY_TICKS = 8  # ≥ 1.6 s with every slot busy: the old claim loop leaked a task each second


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStore]:
    s = open_sql_store(f"sqlite:///{tmp_path}/r.db")
    yield s
    await s.close()


class TickingStore:
    """The real store; counts the heartbeat loop's calls, and can make the next one raise."""

    def __init__(self, inner: SqlStore) -> None:
        self._inner = inner
        self.ticks = 0
        self.explode = False
        self._ticked = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def heartbeat_many(self, attempt_ids: Sequence[str], worker_id: str | None = None) -> Any:
        """Pass on; a call from the heartbeat loop is one tick."""
        task = asyncio.current_task()
        in_loop = task is not None and task.get_name() == "rollfleet-heartbeat"
        if in_loop and self.explode:
            raise RuntimeError("a bug in the heartbeat loop")
        replies = await self._inner.heartbeat_many(attempt_ids, worker_id)
        if in_loop:
            self.ticks += 1
            self._ticked.set()
        return replies

    async def ticks_pass(self, n: int) -> None:
        """Wait until the heartbeat loop has called ``n`` more times."""
        target = self.ticks + n
        while self.ticks < target:
            self._ticked.clear()
            await asyncio.wait_for(self._ticked.wait(), 20)


class Gated:
    """An agent that runs until the test opens its rollout's gate."""

    def __init__(self) -> None:
        self.started: asyncio.Queue[str] = asyncio.Queue()
        self.gates: dict[str, asyncio.Event] = {}

    async def agent(self, input: Any, ctx: Any) -> float:
        """Report the start, then wait for the gate."""
        gate = self.gates.setdefault(ctx.rollout_id, asyncio.Event())
        self.started.put_nowait(ctx.rollout_id)
        await gate.wait()
        return 1.0

    async def running(self, n: int) -> list[str]:
        """The next ``n`` rollouts to start."""
        return [await asyncio.wait_for(self.started.get(), 20) for _ in range(n)]

    def open(self, rollout_ids: list[str]) -> None:
        """Let these rollouts finish."""
        for rollout_id in rollout_ids:
            self.gates[rollout_id].set()


def left_pending(before: set[asyncio.Task[Any]]) -> list[str]:
    """Names of the tasks started since ``before`` that have not ended."""
    return sorted(t.get_name() for t in asyncio.all_tasks() - before)


async def test_a_long_busy_period_piles_up_no_tasks_and_stop_leaves_none(store: SqlStore) -> None:
    ticking, gated = TickingStore(store), Gated()
    made = await store.enqueue_many(
        [RolloutSpec(input=i, config=RolloutConfig(heartbeat_s=HEARTBEAT_S)) for i in range(6)]
    )
    runner = Runner(
        ticking,
        gated.agent,
        worker_id="w-busy",
        concurrency=2,
        claim_wait_s=0.2,
        grace_s=0.05,
        lease_s=HEARTBEAT_S,
    )
    before = asyncio.all_tasks()
    run = asyncio.create_task(runner.run())
    counts: list[int] = []
    for period in range(3):  # three busy periods: slots freed and refilled in between
        held = await gated.running(2)
        await ticking.ticks_pass(2)  # the first heartbeats and the last period's ends are done
        counts.append(len(asyncio.all_tasks()))
        if period == 0:
            await ticking.ticks_pass(LONG_BUSY_TICKS)
            counts.append(len(asyncio.all_tasks()))
        if period < 2:
            gated.open(held)
    assert runner.active == 2 and len(set(counts)) == 1, counts  # nothing piles up, ever
    runner.stop()  # the last two outlive the grace period and go back to the queue
    stats = await asyncio.wait_for(run, 30)
    assert left_pending(before) == []
    assert stats.succeeded == 4 and stats.released == 2
    back = [await store.get_rollout(r.rollout_id) for r in made]
    assert sorted(r.status.value for r in back) == sorted(["succeeded"] * 4 + ["queuing"] * 2)


async def test_a_crash_in_a_background_task_is_logged_with_its_name(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    made = await store.enqueue_many([RolloutSpec(input=i) for i in range(2)])
    first = made[0].rollout_id

    def on_event(event: str, **fields: Any) -> None:
        if event == "rollout_finished" and fields["rollout_id"] == first:
            raise ValueError("a bug in the listener")

    caplog.set_level(logging.ERROR, logger="rollfleet.runner")
    runner = Runner(store, _returns_one, worker_id="w-crash", claim_wait_s=0.2, on_event=on_event)
    before = asyncio.all_tasks()
    run = asyncio.create_task(runner.run())
    done = await store.wait_for_rollouts([r.rollout_id for r in made], 30)
    runner.stop()
    stats = await asyncio.wait_for(run, 30)
    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 2  # the runner went on
    assert stats.succeeded == 2 and runner.active == 0 and left_pending(before) == []
    crashes = [r for r in caplog.records if "crashed" in r.getMessage()]
    assert [r.getMessage() for r in crashes] == [
        f"w-crash: background task 'rollout-{first}-finish' crashed"
    ]
    assert crashes[0].exc_info is not None
    assert str(crashes[0].exc_info[1]) == "a bug in the listener"


async def test_a_dead_heartbeat_loop_stops_a_busy_runner_at_once_and_releases_its_rollouts(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    ticking, gated = TickingStore(store), Gated()
    made = await store.enqueue_many(
        [RolloutSpec(input=i, config=RolloutConfig(heartbeat_s=HEARTBEAT_S)) for i in range(2)]
    )
    caplog.set_level(logging.ERROR, logger="rollfleet.runner")
    runner = Runner(
        ticking,
        gated.agent,
        worker_id="w-dead",
        concurrency=2,
        claim_wait_s=0.2,
        grace_s=60,
        lease_s=HEARTBEAT_S,
    )
    before = asyncio.all_tasks()
    run = asyncio.create_task(runner.run())
    await gated.running(2)
    await ticking.ticks_pass(1)
    ticking.explode = True  # every slot is busy: only the loop's death can wake the claim loop
    with pytest.raises(RuntimeError, match="side task rollfleet-heartbeat died"):
        await asyncio.wait_for(run, 30)
    assert left_pending(before) == [] and runner.stats.released == 2
    back = [await store.get_rollout(r.rollout_id) for r in made]
    assert [r.status for r in back] == [RolloutStatus.QUEUING] * 2
    assert "w-dead: background task 'rollfleet-heartbeat' crashed" in caplog.messages


async def _returns_one(input: Any, ctx: Any) -> float:
    """Finish at once."""
    return 1.0


async def test_a_failing_llm_factory_fails_the_attempt_and_frees_the_slot(store: SqlStore) -> None:
    async def agent(input: Any, ctx: Any) -> float:
        return 1.0

    def broken_llm(rollout: Any) -> Any:
        raise RuntimeError("no gateway at that URL")

    runner = Runner(store, agent, worker_id="w-llm", concurrency=1, llm_factory=broken_llm)
    made = await store.enqueue_many(
        [RolloutSpec(input={"i": i}, config=RolloutConfig(max_attempts=1)) for i in range(3)]
    )
    running = asyncio.create_task(runner.run())
    try:
        done = await store.wait_for_rollouts([r.rollout_id for r in made], 30)
    finally:
        runner.stop()
        await running
    # one slot served all three: each failure was recorded and gave the slot back
    assert [r.status for r in done] == [RolloutStatus.FAILED] * 3
    attempts = (await store.query_attempts(made[0].rollout_id)).items
    assert "no gateway at that URL" in (attempts[0].error or "")


class ClaimWatch:
    """The real store; says when a claim has started waiting."""

    def __init__(self, inner: SqlStore) -> None:
        self._inner = inner
        self.claiming = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        """Pass on, after saying so."""
        self.claiming.set()
        return await self._inner.claim(*args, **kwargs)


async def test_a_second_stop_cuts_a_long_poll_the_first_let_run(store: SqlStore) -> None:
    """stop() lets an in-flight claim finish (it may bring work); stop() again, even once the
    runner already waits on that claim alone, cancels it: the run ends now, not at the end of the
    long-poll (an hour here). ``rollfleet run`` relies on it at every run's end."""
    watched = ClaimWatch(store)
    runner = Runner(watched, Gated().agent, worker_id="w-poll", concurrency=1, claim_wait_s=3600)  # type: ignore[arg-type]
    running = asyncio.create_task(runner.run())
    await asyncio.wait_for(watched.claiming.wait(), 20)
    runner.stop()
    for _ in range(10):  # let the claim loop see the first stop and wait on the claim alone
        await asyncio.sleep(0)
    assert not running.done()
    runner.stop()
    stats = await asyncio.wait_for(running, 30)
    assert stats.claimed == 0
