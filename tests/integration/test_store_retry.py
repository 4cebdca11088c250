"""Retry scheduling on every backend: delays with jitter, two budgets (own failures, lost runners),
suspected poison, and a runner that restarts under its id taking over its dead predecessor's work."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from rollfleet.errors import Conflict
from rollfleet.model import AttemptStatus, RolloutSpec, RolloutStatus
from rollfleet.store import open_sql_store

pytestmark = pytest.mark.timeout(120)


def spec(rid: str, **config: object) -> RolloutSpec:
    return RolloutSpec(input=rid, rollout_id=rid, config={"heartbeat_s": 5, **config})


async def lose(case, rid: str, worker: str) -> None:  # type: ignore[no-untyped-def]
    """Lease the rollout to ``worker`` once it may be claimed, then let the lease lapse."""
    s = case.store
    case.clock.advance(max(0.0, (await s.get_rollout(rid)).available_at - case.clock()))
    got = await s.claim(worker)
    assert [r.rollout_id for r in got] == [rid]
    case.clock.advance(6)
    assert (await s.reap()).lost == [got[0].attempt.attempt_id]


async def test_a_lost_attempt_comes_back_after_a_delay_that_doubles_with_jitter(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([spec("r", retry_delay_s=2.0)])
    waits = []
    for n, worker in enumerate(["w1", "w2", "w3"], start=1):
        await lose(case, "r", worker)
        r = await s.get_rollout("r")
        assert (
            r.status is RolloutStatus.QUEUING and r.attempts_lost == n and r.attempts_charged == 0
        )
        wait = r.available_at - case.clock()
        full = 2.0 * 2 ** (n - 1)
        assert full / 2 <= wait <= full, (n, wait)  # half fixed, half jitter
        waits.append(wait)
        assert await s.claim("eager") == []  # held back: a fresh runner does not take it at once
        case.clock.advance(wait / 2)
        assert await s.claim("eager") == []
    assert waits[0] < waits[2]
    case.clock.advance(waits[-1])
    assert [r.rollout_id for r in await s.claim("late")] == ["r"]


async def test_losses_spend_max_lost_not_the_rollouts_own_budget(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([spec("p", max_attempts=1, max_lost=3, retry_delay_s=0)])
    await lose(case, "p", "w1")
    await lose(
        case, "p", "w2"
    )  # with one budget for both, max_attempts=1 would have failed it here
    r = await s.get_rollout("p")
    assert r.status is RolloutStatus.QUEUING and not r.suspect  # 2 runners in a row: not yet
    await lose(case, "p", "w3")
    r = await s.get_rollout("p")
    assert r.status is RolloutStatus.FAILED and r.attempts_lost == 3 and r.attempts_charged == 0
    assert r.suspect
    assert "lost with its runner 3 times (max_lost 3), last on w3, w2, w1" in r.error
    assert (await s.statistics()).suspects == ["p"]


async def test_an_own_failure_breaks_the_streak_and_spends_max_attempts(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([spec("f", max_attempts=2, retry_delay_s=0)])
    await lose(case, "f", "w1")
    await lose(case, "f", "w2")
    att = (await s.claim("w3"))[0].attempt
    await s.complete(att.attempt_id, AttemptStatus.FAILED, error="agent raised")
    r = await s.get_rollout("f")
    assert r.status is RolloutStatus.QUEUING and r.attempts_charged == 1 and r.attempts_lost == 2
    await lose(case, "f", "w4")
    await lose(case, "f", "w5")
    assert not (await s.get_rollout("f")).suspect  # w4, w5 in a row since the failure: two runners
    att = (await s.claim("w6"))[0].attempt
    await s.complete(att.attempt_id, AttemptStatus.FAILED, error="agent raised")
    r = await s.get_rollout("f")
    assert r.status is RolloutStatus.FAILED and r.error == "agent raised" and not r.suspect


async def test_a_runner_registering_again_takes_over_its_dead_predecessors_attempts(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([spec(f"t-{i}", retry_delay_s=0) for i in range(3)])
    await s.register_worker("w1", lease_s=10)
    mine = await s.claim("w1", max_n=2)
    other = (await s.claim("w2"))[0]
    await s.register_worker("w1", lease_s=10)  # its process died and came back: no lease waited for
    for r in mine:
        now = await s.get_rollout(r.rollout_id)
        assert now.status is RolloutStatus.QUEUING and now.attempts_lost == 1
        with pytest.raises(Conflict):  # the dead process's attempt is fenced
            await s.complete(r.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    attempts = (await s.query_attempts(rollout_id=mine[0].rollout_id)).items
    assert (
        attempts[0].status is AttemptStatus.LOST
        and attempts[0].error == "lost with runner w1: it restarted"
    )
    assert (
        await s.get_rollout(other.rollout_id)
    ).status is RolloutStatus.PREPARING  # w2's is its own
    again = await s.claim("w1", max_n=3)
    assert sorted(r.rollout_id for r in again) == sorted(r.rollout_id for r in mine)


async def test_a_release_is_free_and_claimable_at_once(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([spec("g", retry_delay_s=10)])
    att = (await s.claim("w1"))[0].attempt
    await s.release(att.attempt_id, "runner shutting down")
    r = await s.get_rollout("g")
    assert r.status is RolloutStatus.QUEUING and r.attempts_lost == 0 and r.attempts_charged == 0
    assert [x.rollout_id for x in await s.claim("w2")] == ["g"]


NEW_COLUMNS = ["attempts_lost", "max_lost", "retry_delay_s", "available_at", "suspect"]


async def test_a_database_made_before_retry_scheduling_is_migrated(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    store = open_sql_store(url)
    await store.enqueue_many([spec("old")])
    await store.close()
    with sqlite3.connect(tmp_path / "old.db") as conn:  # the table as an older version made it
        for column in NEW_COLUMNS:
            conn.execute(f"ALTER TABLE rollouts DROP COLUMN {column}")
    store = open_sql_store(url)
    try:
        got = await store.claim("w1")
        assert [r.rollout_id for r in got] == ["old"] and got[0].config.max_lost == 10
        await store.register_worker("w1")  # a takeover: a LOST with a delay, on the old row
        r = await store.get_rollout("old")
        assert r.status is RolloutStatus.QUEUING and r.attempts_lost == 1
    finally:
        await store.close()


async def test_a_postgres_database_made_before_retry_scheduling_is_migrated(pg_url: str) -> None:
    import psycopg

    store = open_sql_store(pg_url)
    await store.enqueue_many([spec("old")])
    await store.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for column in NEW_COLUMNS:
            conn.execute(f"ALTER TABLE rollouts DROP COLUMN {column}")
    store = open_sql_store(pg_url)
    try:
        assert [r.rollout_id for r in await store.claim("w1")] == ["old"]
        await store.register_worker("w1")
        assert (await store.get_rollout("old")).attempts_lost == 1
    finally:
        await store.close()
