"""``complete_and_claim``: a runner's completion and its next claim in one call (issue 34).

Fenced like the two calls it replaces (a stale attempt's completion is refused, then claims nothing
and changes nothing), on every backend; one transaction, so a ``kill -9`` of a real server process
leaves either both halves on disk or neither; bad input is a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollfleet.client import HttpStore
from rollfleet.errors import InvalidInput
from rollfleet.model import (
    AttemptStatus,
    Completion,
    RolloutConfig,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    WorkerStatus,
)
from rollfleet.store.base import read_all
from rollfleet.testing import ServeProcess

pytestmark = pytest.mark.timeout(120)


def done(attempt_id: str, reward: float = 1.0) -> Completion:
    return Completion(
        attempt_id=attempt_id, status=AttemptStatus.SUCCEEDED, result=RolloutResult(reward=reward)
    )


async def snapshot(store: Any) -> tuple[list[Any], list[Any]]:
    """Every rollout and attempt, as the store answers them (to compare before and after)."""
    rollouts = (await store.query_rollouts(limit=100)).items
    attempts = (await store.query_attempts(limit=100)).items
    return sorted(rollouts, key=lambda r: r.rollout_id), sorted(
        attempts, key=lambda a: a.attempt_id
    )


async def test_it_completes_then_leases_the_next_in_queue_order(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i}") for i in range(4)])
    (first,) = await s.claim("w1")
    assert first.attempt is not None
    got = await s.complete_and_claim([done(first.attempt.attempt_id)], "w1", max_n=2)
    assert [o.rollout_status for o in got.outcomes] == [RolloutStatus.SUCCEEDED]
    assert [r.rollout_id for r in got.claimed] == ["r1", "r2"]
    assert all(r.attempt is not None and r.attempt.worker_id == "w1" for r in got.claimed)
    assert (await s.get_rollout("r0")).result.reward == 1.0
    assert (await s.get_rollout("r1")).status is RolloutStatus.PREPARING
    only = await s.complete_and_claim([done(got.claimed[0].attempt.attempt_id)], "w1", max_n=0)
    assert only.claimed == [] and (await s.get_rollout("r3")).status is RolloutStatus.QUEUING


async def test_postgres_ends_in_one_statement_and_claims_in_one_more(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each statement is a round trip and ~0.1 ms of the server's CPU: a complete-and-claim is a
    # read, one end (attempt and rollout), and one claim that also writes the attempts and the
    # worker's row
    from rollfleet.store import open_sql_store
    from rollfleet.store.postgres import PostgresTx

    sent: list[str] = []
    real = PostgresTx._exec

    def spy(self: PostgresTx, name: str, params: Any) -> Any:
        sent.append(name)
        return real(self, name, params)

    monkeypatch.setattr(PostgresTx, "_exec", spy)
    store = open_sql_store(pg_url)
    try:
        await store.enqueue_many(
            [RolloutSpec(input=i, rollout_id=f"r{i}", priority=i % 2) for i in range(4)]
        )
        await store.register_worker("w1")
        (first,) = await store.claim("w1")
        assert first.rollout_id == "r1"  # priority first
        sent.clear()
        got = await store.complete_and_claim([done(first.attempt.attempt_id)], "w1", max_n=2)
        assert sent == ["select_attempts_by_ids", "finish_one", "claim_open"]
        assert [r.rollout_id for r in got.claimed] == ["r3", "r0"]
        attempts = {a.attempt_id: a for a in (await store.query_attempts(limit=10)).items}
        for leased in got.claimed:  # the attempts the answer names are the ones written
            assert attempts[leased.attempt.attempt_id].model_dump() == leased.attempt.model_dump()
        (row,) = (await store.query_workers()).items
        assert (row.status, row.rollouts_succeeded) == (WorkerStatus.BUSY, 1)
    finally:
        await store.close()


async def test_a_stale_completion_claims_nothing_and_changes_nothing(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i}") for i in range(2)])
    (old,) = await s.claim("w1")
    await s.release(old.attempt.attempt_id)  # the rollout is queued again: this attempt is stale
    before = await snapshot(s)
    got = await s.complete_and_claim([done(old.attempt.attempt_id)], "w1", max_n=1)
    assert got.claimed == []
    assert got.outcomes[0].rollout_status is None and got.outcomes[0].error_type == "Conflict"
    assert await snapshot(s) == before
    unknown = await s.complete_and_claim([done("at-nobody")], "w1", max_n=1)
    assert unknown.outcomes[0].error_type == "NotFound" and unknown.claimed == []
    assert await snapshot(s) == before


async def test_a_repeated_completion_is_answered_again_and_still_claims(case) -> None:  # type: ignore[no-untyped-def]
    """The completion half is idempotent, as complete_many is; the claim half is not repeated by
    the HTTP client (see HttpStore.complete_and_claim)."""
    s = case.store
    await s.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i}") for i in range(3)])
    (first,) = await s.claim("w1")
    await s.complete_many([done(first.attempt.attempt_id)])
    again = await s.complete_and_claim([done(first.attempt.attempt_id)], "w1")
    assert again.outcomes[0].rollout_status is RolloutStatus.SUCCEEDED
    assert [r.rollout_id for r in again.claimed] == ["r1"]
    attempts = (await s.query_attempts(rollout_id="r0")).items
    assert len(attempts) == 1 and attempts[0].status is AttemptStatus.SUCCEEDED


async def test_each_outcome_is_counted_once_on_the_worker_that_ran_it(case) -> None:  # type: ignore[no-untyped-def]
    """complete_and_claim updates the claiming worker's row once (outcomes, heartbeat and status
    together): counted whether it claims or not, on the attempt's own worker, never twice."""
    s = case.store
    for worker in ("w1", "w2"):
        await s.register_worker(worker)
    config = RolloutConfig(max_attempts=1)
    await s.enqueue_many(
        [RolloutSpec(input=i, rollout_id=f"r{i}", config=config) for i in range(6)]
    )
    (a,) = await s.claim("w1")
    (b,) = await s.claim("w2")
    failed = Completion(attempt_id=b.attempt.attempt_id, status=AttemptStatus.FAILED, error="x")
    got = await s.complete_and_claim([done(a.attempt.attempt_id), failed], "w1", max_n=1)
    again = await s.complete_and_claim([done(a.attempt.attempt_id)], "w1", max_n=1)
    (c,) = got.claimed
    await s.complete_and_claim([done(c.attempt.attempt_id)], "w1", max_n=0)
    late = Completion(attempt_id=c.attempt.attempt_id, status=AttemptStatus.FAILED, error="x")
    stale = await s.complete_and_claim([late], "w1", max_n=1)
    assert len(again.claimed) == 1 and stale.claimed == []
    rows = {w.worker_id: w for w in (await s.query_workers()).items}
    assert (rows["w1"].rollouts_succeeded, rows["w1"].rollouts_failed) == (2, 0)
    assert (rows["w2"].rollouts_succeeded, rows["w2"].rollouts_failed) == (0, 1)


async def test_the_store_refuses_bad_arguments(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_many([RolloutSpec(input=0, rollout_id="r0")])
    before = await snapshot(s)
    with pytest.raises(InvalidInput):
        await s.complete_and_claim([], "w1")
    with pytest.raises(InvalidInput):
        await s.complete_and_claim([done("at-x")], "w1", max_n=-1)
    assert await snapshot(s) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"items": [], "worker_id": "w1"}, "items"),
        ({"items": [{"attempt_id": "at-x", "status": "succeeded"}]}, "worker_id"),
        (
            {"items": [{"attempt_id": "at-x", "status": "succeeded"}], "worker_id": "w 1"},
            "worker_id",
        ),
        ({"items": [{"attempt_id": "at-x", "status": "won"}], "worker_id": "w1"}, "items.0.status"),
        (
            {
                "items": [{"attempt_id": "at-x", "status": "succeeded"}],
                "worker_id": "w1",
                "max_n": -1,
            },
            "max_n",
        ),
        ({"items": [{"status": "succeeded"}], "worker_id": "w1"}, "items.0.attempt_id"),
    ],
)
def test_bad_input_is_a_422_naming_the_field(
    tmp_path: Path, body: dict[str, Any], field: str
) -> None:
    server = ServeProcess(f"sqlite:///{tmp_path}/inputs.db").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            http.post("/rollouts/batch", json={"items": [{"input": 1, "rollout_id": "r0"}]})
            answer = http.post("/attempts/complete-and-claim", json=body)
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"] == "InvalidInput"
            assert answer.json()["message"].startswith(f"{field}:"), answer.text
            assert http.get("/rollouts/r0").json()["status"] == "queuing"  # nothing was claimed
    finally:
        server.kill()


def frozen(server: ServeProcess) -> None:
    """Stop the server without closing its sockets: a request sent now is read by nobody yet."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)


async def rows_of(store: HttpStore) -> dict[str, tuple[str, int]]:
    """Each rollout's status and its number of attempts."""
    rollouts = (await store.query_rollouts(limit=100)).items
    return {r.rollout_id: (r.status.value, r.num_attempts) for r in rollouts}


def send_unanswered(server: ServeProcess, path: str, body: bytes) -> socket.socket:
    """Send one whole HTTP request to ``server`` and return the socket without reading a reply."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


Served = tuple[ServeProcess, HttpStore]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """A real ``rollfleet serve`` process on a SQLite file (killed at the end), and a client."""
    server = ServeProcess(f"sqlite:///{tmp_path}/kill.db").start()
    store = HttpStore(server.url, timeout=5)
    yield server, store
    await store.close()
    server.kill()


async def test_kill_9_before_the_request_is_served_leaves_neither_half(served: Served) -> None:
    server, store = served
    await store.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i}") for i in range(2)])
    (first,) = await store.claim("w1")
    frozen(server)  # the request below is in the server's socket, read by nobody
    body = orjson.dumps(
        {"items": [done(first.attempt.attempt_id).model_dump(mode="json")], "worker_id": "w1"}
    )
    sock = send_unanswered(server, "/attempts/complete-and-claim", body)
    server.kill()
    sock.close()
    server.start()
    assert await rows_of(store) == {"r0": ("preparing", 1), "r1": ("queuing", 0)}
    got = await store.complete_and_claim([done(first.attempt.attempt_id)], "w1")
    assert [r.rollout_id for r in got.claimed] == ["r1"]
    assert await rows_of(store) == {"r0": ("succeeded", 1), "r1": ("preparing", 1)}


async def test_kill_9_amid_a_stream_of_handovers_loses_and_doubles_nothing(served: Served) -> None:
    """Four runners hand over as fast as they can; the server is killed once 40 answers are in.
    Every answered handover is on disk, and no rollout has two live attempts or a lost count."""
    server, store = served
    answered: list[Any] = []
    enough = asyncio.Event()

    async def runner(worker: str) -> None:
        (held,) = await store.claim(worker)
        while True:
            got = await store.complete_and_claim([done(held.attempt.attempt_id)], worker)
            answered.append((held.attempt.attempt_id, got))
            if len(answered) >= 40:
                enough.set()
            if not got.claimed:
                return
            (held,) = got.claimed

    await store.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i:03}") for i in range(400)])
    tasks = [asyncio.create_task(runner(f"w{k}")) for k in range(4)]
    await enough.wait()
    server.kill()
    await asyncio.gather(*tasks, return_exceptions=True)
    server.start()
    attempts = {
        a.attempt_id: a
        for a in await read_all(lambda c: store.query_attempts(cursor=c, limit=1000))
    }
    for attempt_id, got in answered:  # an answer means both halves are durable
        assert attempts[attempt_id].status is AttemptStatus.SUCCEEDED
        for rollout in got.claimed:
            assert rollout.attempt.attempt_id in attempts
    rollouts = await read_all(lambda c: store.query_rollouts(cursor=c, limit=1000))
    live: dict[str, int] = {}
    for a in attempts.values():
        if a.status in (AttemptStatus.PREPARING, AttemptStatus.RUNNING):
            live[a.rollout_id] = live.get(a.rollout_id, 0) + 1
    assert max(live.values(), default=0) <= 1
    assert sum(r.num_attempts for r in rollouts) == len(attempts)
    assert all(r.num_attempts <= 1 for r in rollouts)
    succeeded = [r for r in rollouts if r.status is RolloutStatus.SUCCEEDED]
    assert len(succeeded) >= len(answered) and len(rollouts) == 400


async def test_kill_9_after_the_answer_keeps_both_halves_once(served: Served) -> None:
    server, store = served
    await store.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i}") for i in range(3)])
    (first,) = await store.claim("w1")
    got = await store.complete_and_claim([done(first.attempt.attempt_id)], "w1")
    server.kill()  # answered means durable: both halves survive the kill
    server.start()
    assert await rows_of(store) == {
        "r0": ("succeeded", 1),
        "r1": ("preparing", 1),
        "r2": ("queuing", 0),
    }
    (second,) = got.claimed
    assert (await store.get_rollout("r1")).attempt.attempt_id == second.attempt.attempt_id
    nxt = await store.complete_and_claim([done(second.attempt.attempt_id)], "w1")
    assert [r.rollout_id for r in nxt.claimed] == ["r2"]
    assert (await store.get_rollout("r0")).num_attempts == 1


@pytest.mark.parametrize("where", ["sqlite", "postgres"])
async def test_an_end_decided_on_a_row_someone_else_ended_is_refused_whole(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # the guard behind every end: decided from a row read as live, written after another writer
    # ended that attempt (here: an end written first in the same transaction) — a Conflict, and
    # nothing written; on PostgreSQL the attempt and its rollout are one statement (finish_one),
    # on SQLite two
    from rollfleet.errors import Conflict
    from rollfleet.store import open_sql_store
    from rollfleet.store.ends import attempt_rows, decide_end, write_ends

    url = request.getfixturevalue("pg_url") if where == "postgres" else f"sqlite:///{tmp_path}/s.db"
    store = open_sql_store(url)
    try:
        await store.enqueue_many([RolloutSpec(input=0, rollout_id="r0")])
        (leased,) = await store.claim("w1")
        attempt_id = leased.attempt.attempt_id

        def race(tx: Any) -> None:
            row = attempt_rows(tx, [attempt_id])[attempt_id]
            end = decide_end(row, AttemptStatus.SUCCEEDED)
            write_ends(tx, [decide_end(row, AttemptStatus.LOST, error="lost")], 1.0)  # the other
            write_ends(tx, [end], 2.0)

        with pytest.raises(Conflict, match=f"attempt {attempt_id} was ended by someone else"):
            await store.backend.write(race)
        after = await store.get_rollout("r0")
        assert (after.status, after.attempt.status) == (
            RolloutStatus.PREPARING,
            AttemptStatus.PREPARING,
        )
    finally:
        await store.close()
