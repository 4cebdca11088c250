"""Several control-plane replicas over one PostgreSQL database: the client fails over.

Two real ``rollfleet serve`` processes share a fresh schema. A replica frozen with SIGSTOP holds a
request in flight that it never answers (and is then killed): the client's enqueue and completion
go to the other replica instead, and what the caller chose (ids, the attempt's fence) keeps each
write exactly-once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from support import ServeProcess

from rollfleet.client import HttpStore, connect
from rollfleet.errors import InvalidInput, StoreUnavailable
from rollfleet.model import AttemptStatus, RolloutResult, RolloutSpec, RolloutStatus


@pytest.fixture
def replicas(pg_url: str) -> Iterator[list[ServeProcess]]:
    servers = [ServeProcess(pg_url).start(), ServeProcess(pg_url).start()]
    yield servers
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.kill()


def freeze(server: ServeProcess) -> None:
    """Stop the replica without closing its sockets: requests sent to it are never answered."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)


def test_urls_are_checked_and_split() -> None:
    store = connect("http://127.0.0.1:1, http://127.0.0.1:2/")
    assert isinstance(store, HttpStore) and store.urls == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert connect(["http://127.0.0.1:1", "http://127.0.0.1:2"]).urls == store.urls  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput, match="not an http"):
        HttpStore("http://127.0.0.1:1,ftp://x")
    with pytest.raises(InvalidInput, match="no control-plane URL"):
        HttpStore(" , ")


async def test_writes_in_flight_on_a_dead_replica_go_to_another_exactly_once(
    replicas: list[ServeProcess],
) -> None:
    a, b = replicas
    store = HttpStore([a.url, b.url], timeout=2.0)
    try:
        [rollout] = await store.enqueue_many([RolloutSpec(input={"n": 1}, rollout_id="ro-one")])
        [claimed] = await store.claim("w1", max_n=1)
        assert claimed.attempt is not None

        freeze(a)  # the completion reaches replica a's socket and is never answered there
        done = await store.complete(
            claimed.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
        )
        assert done.status is RolloutStatus.SUCCEEDED
        a.kill()  # whatever a had read dies with it
        again = await store.enqueue_many([RolloutSpec(input={"n": 1}, rollout_id="ro-one")])
        assert [(r.rollout_id, r.status) for r in again] == [("ro-one", RolloutStatus.SUCCEEDED)]
        # the answer of a completion may be lost too: sending it again changes nothing
        same = await store.complete(
            claimed.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
        )
        assert same.status is RolloutStatus.SUCCEEDED
        page = await store.query_rollouts(limit=10)
        assert [r.rollout_id for r in page.items] == [rollout.rollout_id]
        attempts = await store.query_attempts(rollout_id=rollout.rollout_id)
        assert [x.status for x in attempts.items] == [AttemptStatus.SUCCEEDED]
    finally:
        await store.close()


async def test_a_claim_cut_off_by_a_dying_replica_is_taken_again_elsewhere(
    replicas: list[ServeProcess],
) -> None:
    a, b = replicas
    store = HttpStore([a.url, b.url], timeout=2.0)
    try:
        freeze(a)
        with pytest.raises(StoreUnavailable):  # a claim is never sent twice by the client itself
            await store.claim("w1", wait_s=0.0, max_n=1)
        a.kill()
        await store.enqueue_many([RolloutSpec(input={"n": 2}, rollout_id="ro-two")])
        [claimed] = await store.claim("w1", wait_s=5.0, max_n=1)  # the next claim: replica b
        assert claimed.rollout_id == "ro-two"
    finally:
        await store.close()


async def test_every_replica_down_is_one_clear_error(replicas: list[ServeProcess]) -> None:
    for server in replicas:
        server.kill()
    store = HttpStore([s.url for s in replicas], timeout=2.0)
    try:
        with pytest.raises(StoreUnavailable, match="cannot reach the rollfleet server at"):
            await store.statistics()
    finally:
        await store.close()
