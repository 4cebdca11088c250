"""The batch coordinator among ``rollfleet serve`` replicas on one PostgreSQL database: one replica
leads (an advisory lock), the others forward ``/batches`` to it, and when the leader is killed
another takes over and a finalize in flight still returns the batch's result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from support import ServeProcess

from rollfleet.client import HttpStore
from rollfleet.coordinator import CoordinatorClient
from rollfleet.coordinator.election import LEADER_KEY, Election
from rollfleet.model import AttemptStatus, Completion, RolloutResult
from rollfleet.store import open_sql_store


@pytest.fixture
def replicas(pg_url: str) -> Iterator[list[ServeProcess]]:
    servers = [ServeProcess(pg_url).start(), ServeProcess(pg_url).start()]
    yield servers
    for server in servers:
        server.kill()


async def leader_of(store: HttpStore, servers: list[ServeProcess]) -> ServeProcess:
    """The replica whose URL the election published, once one has."""
    deadline = time.monotonic() + 30
    while True:
        found = await store.get_state(LEADER_KEY)
        by_url = {s.url: s for s in servers}
        if found and found["url"] in by_url and by_url[found["url"]].proc.poll() is None:  # type: ignore[union-attr]
            return by_url[found["url"]]
        assert time.monotonic() < deadline, "no replica was elected"
        await asyncio.sleep(0.05)


async def run_all(store: HttpStore, n: int) -> None:
    """Claim and complete ``n`` rollouts, reward 1 each (a runner in miniature)."""
    done = 0
    while done < n:
        claimed = await store.claim("w", wait_s=5.0, max_n=n)
        items = [
            Completion(
                attempt_id=r.attempt.attempt_id,  # type: ignore[union-attr]
                status=AttemptStatus.SUCCEEDED,
                result=RolloutResult(reward=1.0),
            )
            for r in claimed
        ]
        await store.complete_many(items)
        done += len(items)


async def test_a_follower_forwards_and_a_new_leader_finishes_the_batch(
    replicas: list[ServeProcess],
) -> None:
    urls = [s.url for s in replicas]
    store, client = HttpStore(urls), CoordinatorClient(urls)
    try:
        leader = await leader_of(store, replicas)
        follower = next(s for s in replicas if s is not leader)
        through_follower = CoordinatorClient(follower.url)
        info = await through_follower.submit_batch("b1", [{"q": i} for i in range(4)], "train")
        assert info.expected_task_count == 4 and info.state.value == "running"
        assert [b.batch_id for b in await client.list_batches()] == ["b1"]
        await through_follower.close()
        async with httpx.AsyncClient(base_url=follower.url) as http:  # its dashboard reads only
            panel = (await http.get("/dashboard/api/extras/batches")).json()
            assert [b["batch_id"] for b in panel["items"]] == ["b1"]
            refused = await http.post("/dashboard/api/batches/b1/abort", json={"reason": "no"})
            assert refused.status_code == 409 and leader.url in refused.json()["message"]

        finalizing = asyncio.create_task(client.finalize_train_batch("b1"))
        await asyncio.sleep(0)  # the finalize is sent (to whichever replica) and waits there
        leader.kill()
        assert await leader_of(store, replicas) is follower  # the survivor took over
        await run_all(store, 4)
        result = await asyncio.wait_for(finalizing, 60)
        assert result.finished_task_count == 4 and result.metrics["reward/mean"] == 1.0
        again = await client.finalize_train_batch("b1")  # the same result, not a second one
        assert again.finished_task_count == 4
        assert (await client.get_batch("b1")).state.value == "finalized"
    finally:
        await store.close()
        await client.close()


async def until_leader(election: Election) -> None:
    """Wait until ``election`` leads; fail after 10 s."""
    deadline = time.monotonic() + 10
    while not election.is_leader:
        assert time.monotonic() < deadline, "never elected"
        await election.changed(0.1)


async def test_one_replica_leads_and_the_next_takes_over_when_its_connection_goes(
    pg_url: str,
) -> None:
    stores = [open_sql_store(pg_url), open_sql_store(pg_url)]
    elected: list[str] = []

    async def note_b() -> None:
        elected.append("b")

    a = Election(pg_url, stores[0], "http://a", interval_s=0.05)
    b = Election(pg_url, stores[1], None, interval_s=0.05, on_elected=note_b)
    try:
        await a.start()
        await until_leader(a)
        await b.start()
        await b.changed(0.5)  # ten tries at the lock, all refused
        assert not b.is_leader and elected == []
        assert await b.leader_url() == "http://a"
        await a.close()  # its connection closes: PostgreSQL releases the lock
        await until_leader(b)
        assert elected == ["b"] and not a.is_leader
        assert await a.leader_url() is None  # b published no URL (an embedded server)
    finally:
        await a.close()
        await b.close()
        for store in stores:
            await store.close()


async def test_a_replica_publishes_its_advertise_url_and_the_others_forward_there(
    pg_url: str,
) -> None:
    from support import free_port

    ports = [free_port(), free_port()]
    advertised = [f"http://localhost:{p}" for p in ports]  # not the default http://127.0.0.1:PORT
    servers = [
        ServeProcess(pg_url, "--advertise-url", url, port=p).start()
        for url, p in zip(advertised, ports, strict=True)
    ]
    store = HttpStore(servers[0].url)
    try:
        deadline = time.monotonic() + 30
        while not (found := await store.get_state(LEADER_KEY)):
            assert time.monotonic() < deadline, "no replica was elected"
            await asyncio.sleep(0.05)
        assert found["url"] in advertised
        follower = servers[1 - advertised.index(found["url"])]
        through = CoordinatorClient(follower.url)
        info = await through.submit_batch(
            "adv", [{"q": 1}], "train"
        )  # forwarded to the advertised URL
        assert info.expected_task_count == 1
        await through.close()
    finally:
        await store.close()
        for s in servers:
            s.kill()
