"""The Store contract, run against every backend: SQLite and PostgreSQL in-process, and HTTP to each."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollfleet.errors import Conflict, InvalidInput, NotFound
from rollfleet.model import (
    AttemptStatus,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    StepIn,
    WorkerStatus,
)
from rollfleet.store.base import Store

pytestmark = pytest.mark.timeout(120)


async def claim_one(store, worker="w1"):  # type: ignore[no-untyped-def]
    got = await store.claim(worker)
    assert len(got) == 1
    return got[0]


async def test_enqueue_is_idempotent_by_rollout_id(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    first = await s.enqueue_rollout({"q": 1}, "math", rollout_id="task-1")
    again = await s.enqueue_rollout({"q": 1}, "math", rollout_id="task-1")
    assert first.status is RolloutStatus.QUEUING and again.rollout_id == "task-1"
    assert again.created_at == first.created_at
    assert (await s.statistics()).total_rollouts == 1


async def test_enqueue_many_is_all_or_nothing(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    with pytest.raises(InvalidInput):
        await s.enqueue_many(
            [RolloutSpec(input=1, rollout_id="dup"), RolloutSpec(input=2, rollout_id="dup")]
        )
    assert (await s.statistics()).total_rollouts == 0
    made = await s.enqueue_many([RolloutSpec(input=i) for i in range(5)])
    assert [r.input for r in made] == list(range(5))


async def test_claim_takes_priority_then_fifo(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many(
        [
            RolloutSpec(input="low-1", rollout_id="a"),
            RolloutSpec(input="high", rollout_id="b", priority=5),
            RolloutSpec(input="low-2", rollout_id="c"),
        ]
    )
    got = await s.claim("w1", max_n=3)
    assert [r.rollout_id for r in got] == ["b", "a", "c"]
    assert all(r.status is RolloutStatus.PREPARING and r.attempt.worker_id == "w1" for r in got)
    assert await s.claim("w2") == []


async def test_long_poll_claim_wakes_on_enqueue(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    waiter = asyncio.create_task(s.claim("w1", wait_s=60))
    await asyncio.sleep(0)  # let the claim start waiting
    await s.enqueue_rollout("hello", rollout_id="r1")
    got = await asyncio.wait_for(waiter, 20)  # well before wait_s: it was woken, not timed out
    assert [r.rollout_id for r in got] == ["r1"]


async def test_claim_returns_empty_after_wait(case) -> None:  # type: ignore[no-untyped-def]
    assert await case.store.claim("w1", wait_s=0.05) == []


async def test_heartbeat_runs_and_extends_lease(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("x", config={"heartbeat_s": 10})
    r = await claim_one(s)
    case.clock.advance(5)
    reply = await s.heartbeat(r.attempt.attempt_id)
    assert reply.keep_going and reply.status is AttemptStatus.RUNNING
    assert reply.lease_expires_at == pytest.approx(case.clock() + 10)
    assert (await s.get_rollout(r.rollout_id)).status is RolloutStatus.RUNNING
    case.clock.advance(9)
    await s.reap()
    assert (await s.get_rollout(r.rollout_id)).status is RolloutStatus.RUNNING


async def test_every_backend_is_a_store_reaped_in_background(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    assert isinstance(s, Store)  # every member of the protocol, start_reaper included
    s.start_reaper(0.01)  # in-process: a task until close(); over HTTP: nothing, the server reaps
    s.start_reaper(0.01)  # a second start changes nothing
    await s.enqueue_rollout("x", config={"heartbeat_s": 5})
    old = await claim_one(s)
    case.clock.advance(6)
    deadline = time.monotonic() + 10  # nobody calls reap() here
    while (await s.get_rollout(old.rollout_id)).status is not RolloutStatus.QUEUING:
        assert time.monotonic() < deadline, "the lapsed lease was never reaped"
        await asyncio.sleep(0.02)


async def test_complete_records_result_once(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("x")
    r = await claim_one(s)
    done = await s.complete(
        r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.5, metrics={"f1": 1})
    )
    assert (
        done.status is RolloutStatus.SUCCEEDED
        and done.result.reward == 0.5
        and done.finished_at is not None
    )
    again = await s.complete(
        r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.5)
    )
    assert again.status is RolloutStatus.SUCCEEDED  # a retried completion is answered, not refused
    with pytest.raises(Conflict):
        await s.complete(r.attempt.attempt_id, AttemptStatus.FAILED, error="late")
    assert (await s.get_rollout(r.rollout_id)).result.reward == 0.5


async def test_lost_lease_requeues_and_fences_the_old_attempt(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("x", config={"heartbeat_s": 5})
    old = await claim_one(s, "w1")
    case.clock.advance(6)
    report = await s.reap()
    assert old.attempt.attempt_id in report.lost and old.rollout_id in report.requeued
    assert (await s.get_rollout(old.rollout_id)).status is RolloutStatus.QUEUING
    case.clock.advance(1)  # past its retry delay (at most retry_delay_s, 0.5 s, for a 1st retry)
    new = await claim_one(s, "w2")
    assert new.attempt.sequence == 2
    with pytest.raises(Conflict):
        await s.complete(old.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1))
    with pytest.raises(Conflict):
        await s.add_steps(old.attempt.attempt_id, [StepIn(kind="llm")])
    reply = await s.heartbeat(old.attempt.attempt_id)
    assert not reply.keep_going and reply.status is AttemptStatus.LOST
    done = await s.complete(
        new.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1)
    )
    assert done.status is RolloutStatus.SUCCEEDED and done.attempt.worker_id == "w2"


async def test_failures_retry_until_the_budget_is_spent(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("x", config={"max_attempts": 2})
    first = await claim_one(s)
    after_first = await s.complete(first.attempt.attempt_id, AttemptStatus.FAILED, error="boom")
    assert after_first.status is RolloutStatus.QUEUING and after_first.error == "boom"
    case.clock.advance(1)  # past its retry delay
    second = await claim_one(s)
    final = await s.complete(second.attempt.attempt_id, AttemptStatus.FAILED, error="boom again")
    assert final.status is RolloutStatus.FAILED and final.attempts_charged == 2
    attempts = (await s.query_attempts(rollout_id=first.rollout_id)).items
    assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.FAILED]


async def test_timeout_is_enforced_by_the_reaper(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("x", config={"timeout_s": 10, "heartbeat_s": 1000, "max_attempts": 1})
    r = await claim_one(s)
    case.clock.advance(30)
    report = await s.reap()
    assert report.timed_out == [r.attempt.attempt_id]
    final = await s.get_rollout(r.rollout_id)
    assert final.status is RolloutStatus.FAILED and final.attempt.status is AttemptStatus.TIMEOUT


async def test_cancel_is_final_and_stops_the_attempt(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many(
        [RolloutSpec(input=1, rollout_id="queued"), RolloutSpec(input=2, rollout_id="running")]
    )
    r = await s.claim("w1")
    assert r[0].rollout_id == "queued"
    cancelled = await s.cancel("queued")
    assert cancelled.status is RolloutStatus.CANCELLED
    reply = await s.heartbeat(r[0].attempt.attempt_id)
    assert reply.cancelled and not reply.keep_going
    with pytest.raises(Conflict):  # a late success never overwrites a cancel
        await s.complete(r[0].attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1))
    assert (await s.get_rollout("queued")).status is RolloutStatus.CANCELLED
    assert (await s.cancel("queued")).status is RolloutStatus.CANCELLED
    other = await claim_one(s)
    await s.complete(other.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    with pytest.raises(Conflict):
        await s.cancel("running")
    with pytest.raises(NotFound):
        await s.cancel("nope")


async def test_start_rollout_cannot_stay_preparing(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    started = await s.start_rollout(
        {"prompt": "Task 1"}, "test", worker_id="dies", config={"heartbeat_s": 5}
    )
    assert started.status is RolloutStatus.PREPARING and started.attempt.worker_id == "dies"
    assert await s.claim("w2") == []
    case.clock.advance(6)  # the caller died without a heartbeat
    await s.reap()
    case.clock.advance(1)  # past its retry delay
    rescued = await claim_one(s, "w2")
    assert rescued.rollout_id == started.rollout_id and rescued.attempt.sequence == 2


async def test_operator_requeue(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([RolloutSpec(input=i) for i in range(3)])
    claimed = await s.claim("w1", max_n=3)
    await s.heartbeat(claimed[0].attempt.attempt_id)  # RUNNING; the other two stay PREPARING
    ids = await s.requeue([RolloutStatus.PREPARING])
    assert sorted(ids) == sorted(r.rollout_id for r in claimed[1:])
    assert (await s.get_rollout(claimed[1].rollout_id)).status is RolloutStatus.QUEUING
    assert (await s.get_rollout(claimed[1].rollout_id)).attempts_charged == 0
    with pytest.raises(InvalidInput):
        await s.requeue([RolloutStatus.SUCCEEDED])


async def test_query_filters_and_pagination(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many(
        [
            RolloutSpec(input=i, mode="math" if i % 2 else "py", batch_id="b1" if i < 6 else None)
            for i in range(10)
        ]
    )
    got = await s.claim("w9", max_n=2)
    seen, cursor = [], None
    while True:
        page = await s.query_rollouts(limit=3, cursor=cursor)
        seen += [r.input for r in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == list(range(10))
    assert [r.input for r in (await s.query_rollouts(mode="math")).items] == [1, 3, 5, 7, 9]
    assert len((await s.query_rollouts(batch_id="b1")).items) == 6
    assert {r.rollout_id for r in (await s.query_rollouts(worker_id="w9")).items} == {
        r.rollout_id for r in got
    }
    assert len((await s.query_rollouts(status=[RolloutStatus.QUEUING])).items) == 8
    newest = await s.query_rollouts(order="desc", limit=2)
    assert [r.input for r in newest.items] == [9, 8]
    assert (await s.query_rollouts(search=got[0].rollout_id[:12])).items[0].rollout_id == got[
        0
    ].rollout_id


async def test_steps_are_ordered_and_paged(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("x")
    r = await claim_one(s)
    for chunk in range(3):
        await s.add_steps(
            r.attempt.attempt_id,
            [StepIn(kind="llm", payload={"i": chunk * 2 + j}) for j in range(2)],
        )
    page = await s.query_steps(r.rollout_id, limit=4)
    rest = await s.query_steps(r.rollout_id, cursor=page.next_cursor)
    steps = page.items + rest.items
    assert [st.payload["i"] for st in steps] == list(range(6)) and [
        st.sequence for st in steps
    ] == list(range(1, 7))
    assert all(st.attempt_id == r.attempt.attempt_id for st in steps)


async def test_steps_of_many_rollouts_in_one_paged_query(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([RolloutSpec(rollout_id=f"b:{i}", input=i) for i in range(3)])
    for r in await s.claim("w1", max_n=3):
        steps = [StepIn(kind="llm", payload={"r": r.rollout_id, "i": j}) for j in range(3)]
        await s.add_steps(r.attempt.attempt_id, steps)
    wanted = ["b:2", "b:0", "never-enqueued"]
    page = await s.query_steps_many(wanted, limit=4)  # a page ends inside b:2's steps
    rest = await s.query_steps_many(wanted, cursor=page.next_cursor, limit=4)
    steps = page.items + rest.items
    assert [(st.rollout_id, st.sequence) for st in steps] == [
        ("b:0", 1),
        ("b:0", 2),
        ("b:0", 3),
        ("b:2", 1),
        ("b:2", 2),
        ("b:2", 3),
    ]
    assert all(st.payload["r"] == st.rollout_id for st in steps) and rest.next_cursor is None
    assert (await s.query_steps_many([])).items == []
    with pytest.raises(InvalidInput, match="at most 1000 rollout ids"):
        await s.query_steps_many([f"b:{i}" for i in range(1001)])
    with pytest.raises(InvalidInput, match="cursor"):
        await s.query_steps_many(wanted, cursor="nonsense")


async def test_workers_registry_and_offline_detection(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.register_worker("w1", {"host": "a"}, lease_s=10)
    await s.register_worker("w2", lease_s=10)
    await s.enqueue_rollout("x", config={"heartbeat_s": 1000})
    r = await claim_one(s, "w1")
    workers = {w.worker_id: w for w in (await s.query_workers()).items}
    assert workers["w1"].status is WorkerStatus.BUSY and workers["w1"].current_attempts == [
        r.attempt.attempt_id
    ]
    assert workers["w2"].status is WorkerStatus.IDLE and workers["w1"].metadata == {"host": "a"}
    case.clock.advance(11)
    await s.heartbeat_many([r.attempt.attempt_id], "w1")
    report = await s.reap()
    assert report.workers_offline == ["w2"]
    await s.complete(r.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    updated = await s.update_worker("w1", WorkerStatus.IDLE)
    assert updated.status is WorkerStatus.IDLE and updated.rollouts_succeeded == 1
    with pytest.raises(NotFound):
        await s.update_worker("ghost", WorkerStatus.IDLE)


async def test_seed_check_script_names(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.register_worker("Worker-0")
    for i in range(3):
        await s.enqueue_rollout({"prompt": f"Task {i}", "task_id": i}, "test")
    await s.claim("Worker-0")
    workers = await s.query_workers()
    assert (workers.items[0].worker_id, workers.items[0].status) == ("Worker-0", WorkerStatus.BUSY)
    rollouts = await s.query_rollouts(limit=20)
    assert rollouts.items[0].attempt.worker_id == "Worker-0" and rollouts.items[1].attempt is None
    assert [r.status for r in rollouts.items].count(RolloutStatus.QUEUING) == 2


async def test_resources_are_versioned(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    assert await s.get_latest_resources() is None
    v1 = await s.add_resources({"model": "smollm2", "weights": 1})
    v2 = await s.add_resources({"model": "smollm2", "weights": 2})
    latest = await s.get_latest_resources()
    assert v2.version > v1.version and latest.values == {"model": "smollm2", "weights": 2}


async def test_statistics_count_by_status(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([RolloutSpec(input=i) for i in range(4)])
    r = await claim_one(s)
    await s.complete(r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.25))
    stats = await s.statistics()
    assert stats.rollouts["succeeded"] == 1 and stats.queue_depth == 3 and stats.total_rollouts == 4
    assert stats.reward_mean == 0.25


async def test_wait_for_rollouts_wakes_on_completion(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    made = await s.enqueue_many([RolloutSpec(input=i) for i in range(2)])
    ids = [r.rollout_id for r in made]
    pending = await s.wait_for_rollouts(ids, timeout=0.05)
    assert [r.status for r in pending] == [RolloutStatus.QUEUING] * 2
    waiter = asyncio.create_task(s.wait_for_rollouts(ids, timeout=60))
    for r in await s.claim("w1", max_n=2):
        await s.complete(r.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    done = await asyncio.wait_for(waiter, 20)
    assert all(r.status is RolloutStatus.SUCCEEDED for r in done)


async def test_unknown_ids_are_not_found(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    with pytest.raises(NotFound):
        await s.get_rollout("missing")
    with pytest.raises(NotFound):
        await s.complete("at-missing", AttemptStatus.SUCCEEDED)
    with pytest.raises(NotFound):
        await s.heartbeat("at-missing")


async def test_state_keys(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.put_state("batch/1", {"state": "running"})
    await s.put_state("batch/2", {"state": "pending"})
    await s.put_state("other", 1)
    assert await s.get_state("batch/1") == {"state": "running"}
    assert await s.get_state("nope") is None
    assert set(await s.scan_state("batch/")) == {"batch/1", "batch/2"}


async def test_complete_many_answers_each_item(case) -> None:  # type: ignore[no-untyped-def]
    from rollfleet.model import Completion

    s = case.store
    await s.enqueue_many([RolloutSpec(input=i) for i in range(3)])
    claimed = await s.claim("w1", max_n=3)
    items = [
        Completion(
            attempt_id=r.attempt.attempt_id,
            status=AttemptStatus.SUCCEEDED,
            result=RolloutResult(reward=float(i)),
        )
        for i, r in enumerate(claimed)
    ]
    items.append(Completion(attempt_id="at-unknown", status=AttemptStatus.SUCCEEDED))
    await s.cancel(claimed[1].rollout_id)
    outcomes = await s.complete_many(items)
    assert [o.attempt_id for o in outcomes] == [i.attempt_id for i in items]
    assert (
        outcomes[0].rollout_status is RolloutStatus.SUCCEEDED
        and outcomes[0].rollout_id == claimed[0].rollout_id
    )
    assert (await s.get_rollout(claimed[2].rollout_id)).result.reward == 2.0
    assert outcomes[1].error_type == "Conflict" and outcomes[1].rollout_status is None
    assert outcomes[3].error_type == "NotFound"
    again = await s.complete_many(
        items[:1]
    )  # a retried batch is answered the same, and changes nothing
    assert again[0].rollout_status is RolloutStatus.SUCCEEDED and again[0].error is None


async def test_claim_documents_are_rollouts_in_wire_form(case) -> None:  # type: ignore[no-untyped-def]
    from rollfleet.model import Rollout

    s = case.store
    await s.enqueue_many(
        [RolloutSpec(input={"n": i}, rollout_id=f"doc-{i}", priority=i) for i in range(3)]
    )
    docs = await s.claim_documents("w-docs", max_n=2)
    leased = [Rollout.model_validate(d) for d in docs]
    assert [r.rollout_id for r in leased] == ["doc-2", "doc-1"]  # highest priority first
    assert all(
        r.status is RolloutStatus.PREPARING and r.attempt.worker_id == "w-docs" for r in leased
    )
    assert leased[0] == await s.get_rollout("doc-2")  # the document is exactly the stored record


async def test_ids_sort_by_creation(case) -> None:  # type: ignore[no-untyped-def]
    # time-ordered ids keep every index's inserts on its last page (docs/store.md)
    s = case.store
    first = await s.enqueue_rollout({"n": 1})
    while time.time_ns() // 1_000_000 <= int(first.rollout_id[3:15], 16):
        pass  # rollout ids carry wall-clock milliseconds: the next id must come from a later one
    second = await s.enqueue_rollout({"n": 2})
    assert first.rollout_id < second.rollout_id
    a = await claim_one(s)
    case.clock.advance(1.0)  # attempt ids carry the store's clock
    b = await claim_one(s)
    assert a.attempt.attempt_id < b.attempt.attempt_id


class DiskGate:
    """Stands in for ``os.fdatasync``: the SQLite flusher's sync waits until the test opens it."""

    def __init__(self) -> None:
        import os
        import threading

        self.real = os.fdatasync
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, fd: int) -> None:
        self.entered.set()
        assert self.opened.wait(30), "the test never let the disk finish"
        self.real(fd)


async def test_training_reads_see_a_completion_only_once_it_is_on_disk(case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # get_rollout and wait_for_rollouts are durable; query_rollouts may run ahead of the disk
    s = case.store
    await s.enqueue_rollout("x", rollout_id="dur-1")
    r = await claim_one(s)
    sqlite = "sqlite" in case.kind
    gate = DiskGate()
    if sqlite:  # every backend runs this test; only SQLite's sync can be held from here
        import os

        monkeypatch.setattr(os, "fdatasync", gate)
    completing = asyncio.create_task(
        s.complete(r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1))
    )
    if sqlite:
        assert await asyncio.to_thread(gate.entered.wait, 30)  # committed; its sync is held
        listed = await s.query_rollouts(status=[RolloutStatus.SUCCEEDED])
        assert [x.rollout_id for x in listed.items] == ["dur-1"]  # the documented pre-durable read
    else:  # PostgreSQL: a committed completion was flushed before anyone could see it
        await completing
    got = asyncio.create_task(s.get_rollout("dur-1"))
    waited = asyncio.create_task(s.wait_for_rollouts(["dur-1"], timeout=30))
    if sqlite:
        try:
            done, _ = await asyncio.wait(
                [got, waited, completing], timeout=0.5
            )  # a bounded wait for nothing
            assert not done, "a training read returned a completion that is not on disk yet"
        finally:
            gate.opened.set()
    assert (await completing).status is RolloutStatus.SUCCEEDED
    assert (await got).status is RolloutStatus.SUCCEEDED
    assert [x.status for x in await waited] == [RolloutStatus.SUCCEEDED]
