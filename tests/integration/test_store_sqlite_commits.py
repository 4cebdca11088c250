"""The embedded SQLite backend's commit path: groups on the event loop, bulk writes on a thread, the flusher."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollfleet.model import AttemptStatus, Completion, RolloutSpec, RolloutStatus
from rollfleet.store import open_sql_store
from rollfleet.store import sqlite as sqlite_backend
from rollfleet.store.sql_store import BULK


async def test_a_durable_write_is_answered_only_after_the_wal_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_sql_store(f"sqlite:///{tmp_path}/s.db")
    synced = asyncio.Event()
    real = os.fdatasync
    loop = asyncio.get_running_loop()

    def held_sync(fd: int) -> None:  # the flusher waits until the test lets the disk "finish"
        asyncio.run_coroutine_threadsafe(synced.wait(), loop).result(timeout=30)
        real(fd)

    monkeypatch.setattr(sqlite_backend.os, "fdatasync", held_sync)
    enqueue = asyncio.create_task(store.enqueue_rollout({"q": 1}, rollout_id="r1"))
    claim = await store.claim("w1", wait_s=5)  # not durable: answered at once, sync or no sync
    assert [r.rollout_id for r in claim] == ["r1"] and not enqueue.done()
    synced.set()
    assert (await enqueue).rollout_id == "r1"
    monkeypatch.setattr(sqlite_backend.os, "fdatasync", real)
    await store.close()


async def test_writes_made_while_a_bulk_enqueue_runs_all_succeed(tmp_path: Path) -> None:
    store = open_sql_store(f"sqlite:///{tmp_path}/s.db")
    await store.enqueue_rollout({"first": True}, rollout_id="first")
    bulk = asyncio.create_task(store.enqueue_many([RolloutSpec(input=i) for i in range(BULK * 5)]))
    small = [asyncio.create_task(store.claim(f"w{i}")) for i in range(5)]
    claimed = [r for got in await asyncio.gather(*small) for r in got]
    assert len(await bulk) == BULK * 5
    assert claimed and claimed[0].status is RolloutStatus.PREPARING
    outcomes = await store.complete_many(
        [
            Completion(attempt_id=r.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
            for r in claimed
        ]
    )
    assert all(o.rollout_status is RolloutStatus.SUCCEEDED for o in outcomes)
    stats = await store.statistics()
    assert stats.total_rollouts == BULK * 5 + 1 and stats.rollouts["succeeded"] == len(claimed)
    await store.close()
