"""Issue 19's acceptance: three ``rollfleet serve`` replicas on one fresh PostgreSQL schema serve
one fleet. Four runner processes, spread over the replicas, run a 1,000-rollout batch; the
replica leading the batch coordinator (and granting a pool lease) is ``kill -9``ed mid-run and
another is restarted. Every rollout succeeds exactly once, the batch finalizes under the new
leader (the finalize was in flight when the old one died), and the lease granted through the dead
replica is still renewed and released through the others.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from support import ServeProcess, eventually

from rollfleet.client import HttpStore
from rollfleet.coordinator import CoordinatorClient
from rollfleet.coordinator.election import LEADER_KEY
from rollfleet.errors import Conflict
from rollfleet.model import AttemptStatus
from rollfleet.pool.remote import RemotePool

pytestmark = pytest.mark.timeout(240)

ROLLOUTS = 1000
POOLS = """
[pools.vm]
provider = "command"
size = 2
lease_s = 60
[pools.vm.options]
start = "echo vm-$ROLLFLEET_INSTANCE_ID"
"""


@pytest.fixture
async def fleet(pg_url: str, tmp_path: Path) -> AsyncIterator[list[ServeProcess]]:
    config = tmp_path / "pools.toml"
    config.write_text(POOLS)
    servers = [ServeProcess(pg_url, "--pools", str(config)).start() for _ in range(3)]
    yield servers
    for server in servers:
        server.kill()


def runners(urls: list[str]) -> list[subprocess.Popen[str]]:
    """Four ``rollfleet workers`` runners, each starting at another replica of the list."""
    procs = []
    for i in range(4):
        order = urls[i % 3 :] + urls[: i % 3]
        cmd = [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "workers",
            "-n",
            "1",
            "--concurrency",
            "8",
            "--agent",
            "rollfleet.agents.sleep",
            "--store",
            ",".join(order),
            "--prefix",
            f"r{i}",
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    return procs


async def leader(store: HttpStore, servers: list[ServeProcess]) -> ServeProcess:
    """The live replica whose URL the coordinator election published."""

    async def published() -> ServeProcess | None:
        found = await store.get_state(LEADER_KEY)
        live = {s.url: s for s in servers if s.proc is not None and s.proc.poll() is None}
        return live.get(found["url"]) if found else None

    elected = await eventually(published, 30, what="a coordinator leader")
    assert isinstance(elected, ServeProcess)
    return elected


async def succeeded(store: HttpStore, at_least: int) -> bool:
    return (await store.statistics()).rollouts["succeeded"] >= at_least


async def succeeded_attempts(store: HttpStore) -> dict[str, int]:
    """How many SUCCEEDED attempts each rollout has."""
    counts: dict[str, int] = {}
    cursor = None
    while True:
        page = await store.query_attempts(
            status=[AttemptStatus.SUCCEEDED], cursor=cursor, limit=500
        )
        for attempt in page.items:
            counts[attempt.rollout_id] = counts.get(attempt.rollout_id, 0) + 1
        cursor = page.next_cursor
        if cursor is None:
            return counts


async def test_three_replicas_lose_one_and_restart_another(fleet: list[ServeProcess]) -> None:
    urls = [s.url for s in fleet]
    store, coord = HttpStore(urls), CoordinatorClient(urls)
    first = await leader(store, fleet)
    through_first = RemotePool(",".join(f"{u}/pools" for u in [first.url, *urls]), "vm")
    procs: list[subprocess.Popen[str]] = []
    try:
        tasks = [{"duration": 0.3, "i": i} for i in range(ROLLOUTS)]
        await coord.submit_batch("b1", tasks, "train")

        # a lease granted through the leader, visible through every replica
        instance = await through_first.acquire(30, attempt_id="at-held")
        others = [s for s in fleet if s is not first]
        async with httpx.AsyncClient() as http:
            held = (await http.get(f"{others[0].url}/pools/vm/leases")).json()
        assert [x["lease_id"] for x in held] == [instance.lease_id]

        procs = runners(urls)
        finalizing = asyncio.create_task(coord.finalize_train_batch("b1"))
        await eventually(lambda: succeeded(store, 150), 90, what="150 rollouts to succeed")
        first.kill()  # kill -9: the coordinator's leader, and the replica that granted the lease
        renewed = await through_first.renew(instance)  # honoured through another replica
        assert renewed.lease_id == instance.lease_id and renewed.expires_at > instance.expires_at
        second = await leader(store, fleet)
        assert second is not first

        await eventually(lambda: succeeded(store, 450), 90, what="450 rollouts to succeed")
        third = next(s for s in fleet if s not in (first, second))
        third.stop()  # another replica restarted: its runners fail over meanwhile
        third.start()

        result = await asyncio.wait_for(finalizing, 150)
        assert result.finished_task_count == ROLLOUTS
        assert {k.value: v for k, v in result.rollouts_by_status.items() if v} == {
            "succeeded": ROLLOUTS
        }
        counts = await succeeded_attempts(store)
        assert len(counts) == ROLLOUTS and set(counts.values()) == {1}  # each exactly once
        stats = await store.statistics()
        assert stats.rollouts["succeeded"] == ROLLOUTS and stats.rollouts["failed"] == 0

        await through_first.release(renewed)  # the dead replica's lease ends through the others
        with pytest.raises(Conflict):
            await through_first.renew(renewed)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            _, err = await asyncio.to_thread(proc.communicate, timeout=60)
            assert proc.returncode == 0, err[-2000:]
        await store.close()
        await coord.close()
        await through_first.close()
