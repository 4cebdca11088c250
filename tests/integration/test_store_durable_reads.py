"""Durable reads (docs/store.md, "What a read sees"): SQLite's barrier, PostgreSQL's synchronous commits.

The contract suite checks a completion on every backend; these check the rest of the path: a
rollout the reaper fails (a write that is not itself waited for), the barrier's free fast path,
and on PostgreSQL that such a reaper pass commits synchronously.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from rollfleet.model import RolloutStatus
from rollfleet.store import open_sql_store
from rollfleet.store import sqlite as sqlite_backend
from rollfleet.testing import FakeClock

pytestmark = pytest.mark.timeout(60)


class DiskGate:
    """Stands in for ``os.fdatasync``: counts syncs, and holds them while ``held``."""

    def __init__(self) -> None:
        self.real = os.fdatasync
        self.calls = 0
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.opened.set()

    def hold(self) -> None:
        self.entered.clear()
        self.opened.clear()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        assert self.opened.wait(30), "the test never let the disk finish"
        self.real(fd)


async def test_a_rollout_the_reaper_fails_is_read_only_once_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    store = open_sql_store(f"sqlite:///{tmp_path}/r.db", clock=clock)
    gate = DiskGate()
    monkeypatch.setattr(sqlite_backend.os, "fdatasync", gate)
    try:
        made = await store.enqueue_rollout("x", config={"heartbeat_s": 5, "max_lost": 1})
        [leased] = await store.claim("w1")
        clock.advance(10)
        # a reaper pass is answered at its commit, not after a sync: this one also ends the rollout
        gate.hold()
        report = await store.reap()
        assert report.failed == [made.rollout_id]
        got = asyncio.create_task(store.get_rollout(made.rollout_id))
        waited = asyncio.create_task(store.wait_for_rollouts([made.rollout_id], timeout=30))
        try:
            assert await asyncio.to_thread(gate.entered.wait, 30)  # the barrier asked for a sync
            done, _ = await asyncio.wait([got, waited], timeout=0.3)  # a bounded wait for nothing
            assert not done, "FAILED was read before it was on disk"
        finally:
            gate.opened.set()
        assert (await got).status is RolloutStatus.FAILED
        assert [r.status for r in await waited] == [RolloutStatus.FAILED]
        assert leased.attempt is not None
    finally:
        gate.opened.set()
        await store.close()


async def test_a_durable_read_with_nothing_pending_costs_no_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_sql_store(f"sqlite:///{tmp_path}/f.db")
    gate = DiskGate()
    monkeypatch.setattr(sqlite_backend.os, "fdatasync", gate)
    try:
        made = await store.enqueue_rollout("x")  # durable: answered after its sync
        before = gate.calls
        for _ in range(20):
            assert (await store.get_rollout(made.rollout_id)).status is RolloutStatus.QUEUING
        await store.wait_for_rollouts([made.rollout_id], timeout=0)
        assert gate.calls == before  # everything read was on disk already: no sync, no write
        await store.claim("w1")  # not durable: committed, not synced
        assert (await store.get_rollout(made.rollout_id)).status is RolloutStatus.PREPARING
        assert gate.calls == before + 1  # the read waited for one sync
    finally:
        await store.close()


async def test_postgres_reaper_pass_that_fails_a_rollout_commits_synchronously(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollfleet.store.postgres import PostgresTx

    seen: list[str] = []
    real = PostgresTx.commit_durably

    def spy(self: PostgresTx) -> None:
        real(self)
        seen.append(self._conn.execute("SHOW synchronous_commit").fetchone()["synchronous_commit"])

    monkeypatch.setattr(PostgresTx, "commit_durably", spy)
    clock = FakeClock()
    store = open_sql_store(pg_url, clock=clock)
    try:
        retried = await store.enqueue_rollout("x", config={"heartbeat_s": 5, "max_lost": 2})
        await store.claim("w1")
        clock.advance(10)
        report = await store.reap()  # requeued, not ended: stays an asynchronous commit
        assert report.requeued == [retried.rollout_id] and seen == []
        clock.advance(1)  # past its retry delay
        await store.claim("w1")
        clock.advance(10)
        report = await store.reap()  # the budget is spent: FAILED, committed synchronously
        assert report.failed == [retried.rollout_id] and seen == ["on"]
        assert (await store.get_rollout(retried.rollout_id)).status is RolloutStatus.FAILED
    finally:
        await store.close()


async def test_postgres_commit_durably_overrides_an_asynchronous_write(pg_url: str) -> None:
    store: Any = open_sql_store(pg_url)

    def setting(tx: Any, upgrade: bool) -> str:
        if upgrade:
            tx.commit_durably()
        return str(tx._conn.execute("SHOW synchronous_commit").fetchone()["synchronous_commit"])

    try:
        assert await store.backend.write(setting, False, durable=False) == "off"
        assert await store.backend.write(setting, True, durable=False) == "on"
    finally:
        await store.close()


async def test_a_group_that_changed_nothing_leaves_nothing_to_wait_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_sql_store(f"sqlite:///{tmp_path}/n.db")
    gate = DiskGate()
    monkeypatch.setattr(sqlite_backend.os, "fdatasync", gate)
    try:
        made = await store.enqueue_rollout("x")
        before = gate.calls
        await store.reap()  # an idle reaper pass: committed, but it changed no row
        assert (await store.get_rollout(made.rollout_id)).status is RolloutStatus.QUEUING
        assert gate.calls == before
    finally:
        await store.close()
