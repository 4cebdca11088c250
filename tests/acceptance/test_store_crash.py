"""kill -9 the server in the middle of enqueue and claim traffic; restart it on the same SQLite file.

Nothing acknowledged may be lost, and nothing may be completed twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from support import ServeProcess, eventually

from rollfleet.client import HttpStore
from rollfleet.errors import RollfleetError
from rollfleet.model import AttemptStatus, RolloutResult, RolloutSpec, RolloutStatus
from rollfleet.store import open_sql_store

pytestmark = pytest.mark.timeout(240)


async def producer(store: HttpStore, acked: set[str], prefix: str, stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        ids = [f"{prefix}-{i + k}" for k in range(5)]
        i += 5
        try:
            await store.enqueue_many(
                [RolloutSpec(input=x, rollout_id=x, config={"heartbeat_s": 2}) for x in ids]
            )
        except RollfleetError:
            await asyncio.sleep(0.01)
            continue
        acked.update(ids)


async def consumer(
    store: HttpStore, completed: dict[str, str], worker: str, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            for r in await store.claim(worker, wait_s=0.2, max_n=4):
                done = await store.complete(
                    r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1)
                )
                assert done.status is RolloutStatus.SUCCEEDED
                completed[r.rollout_id] = r.attempt.attempt_id
        except RollfleetError:
            await asyncio.sleep(0.01)


class Traffic:
    """Concurrent enqueue (optional) and claim+complete clients against one server."""

    def __init__(self, url: str, acked: set[str], completed: dict[str, str], produce: bool) -> None:
        self.stores = [HttpStore(url, timeout=5) for _ in range(3)]
        self.stop_event = asyncio.Event()
        self.tasks = [
            asyncio.create_task(consumer(s, completed, f"w{i}", self.stop_event))
            for i, s in enumerate(self.stores[1:])
        ]
        if produce:
            self.tasks.append(
                asyncio.create_task(
                    producer(self.stores[0], acked, f"p{len(acked)}", self.stop_event)
                )
            )

    def check(self) -> None:
        """Fail at once if a client task died (instead of waiting for a timeout)."""
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise AssertionError("traffic task died") from t.exception()

    async def stop(self) -> None:
        self.stop_event.set()
        for t in self.tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, RollfleetError):
                await t
        for s in self.stores:
            await s.close()


async def until(check, load: Traffic, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    async def ok() -> bool:
        load.check()
        return bool(check())

    await eventually(ok, timeout, interval=0.01, what=getattr(check, "__doc__", None) or "traffic")


async def test_kill_9_server_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/crash.db"
    acked: set[str] = set()
    completed: dict[str, str] = {}
    server = ServeProcess(db).start()
    try:
        load = Traffic(server.url, acked, completed, produce=True)
        await until(lambda: len(completed) >= 300, load)
        server.kill()  # mid-traffic: requests are in flight right now
        await load.stop()
        server = ServeProcess(db).start()
        store = HttpStore(server.url)
        for rid in acked:
            assert (await store.get_rollout(rid)).rollout_id == rid
        for rid, attempt_id in completed.items():
            r = await store.get_rollout(rid)
            assert r.status is RolloutStatus.SUCCEEDED and r.attempt.attempt_id == attempt_id
        # drain after the restart: claims lost in flight come back through lease expiry; a completion
        # committed just before the kill stays done even though its answer never arrived
        drain = Traffic(server.url, acked, completed, produce=False)
        finished = await store.wait_for_rollouts(sorted(acked), 120)
        drain.check()
        await drain.stop()
        assert all(r.status is RolloutStatus.SUCCEEDED for r in finished)
        await store.close()
    finally:
        server.kill()
    local = open_sql_store(db)
    try:
        for rid in acked:
            attempts = (await local.query_attempts(rollout_id=rid)).items
            assert [a.status for a in attempts].count(AttemptStatus.SUCCEEDED) == 1, rid
            assert (await local.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
    finally:
        await local.close()
