"""Pool leases in the store (real PostgreSQL): a lease granted through one replica's registry is
renewed, released and expired through another's, also after the granting replica is gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from rollfleet.errors import Conflict, InvalidInput, NotFound
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.memory import MemoryProvider
from rollfleet.pool.shared import SharedPoolRegistry
from rollfleet.store import SqlStore


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``condition`` to hold; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def registry(store: SqlStore) -> SharedPoolRegistry:
    """One replica's registry: a one-instance memory pool called ``m``, swept every 50 ms."""
    pool = Pool(MemoryProvider(), 1, name="m", policy=PoolPolicy(backoff_s=0.0))
    return SharedPoolRegistry(store, [(pool, 30.0)], sweep_s=0.05)


async def test_a_lease_is_renewed_and_released_through_another_replica(
    stores: tuple[SqlStore, SqlStore],
) -> None:
    async with registry(stores[0]) as a, registry(stores[1]) as b:
        lease = await a.acquire("m", attempt_id="at-1", lease_s=5.0)
        assert [x.lease_id for x in await b.held_leases("m")] == [lease.lease_id]
        renewed = await b.renew_lease(lease.lease_id, 20.0)
        assert renewed.expires_at > lease.expires_at + 10 and renewed.lease_s == 20.0
        assert a.pool("m").stats().states["BUSY"] == 1
        await b.release(lease.lease_id)
        await until(lambda: a.pool("m").stats().states["IDLE"] == 1)  # a's sweep gave it back
        assert await a.held_leases() == []
        with pytest.raises(Conflict, match="released"):
            await a.renew_lease(lease.lease_id)
        with pytest.raises(Conflict, match="released"):
            await a.release(lease.lease_id)
        with pytest.raises(NotFound):
            await b.renew_lease("no-such-lease")


async def test_a_lease_outlives_its_replica_and_expires_through_another(
    stores: tuple[SqlStore, SqlStore],
) -> None:
    b = registry(stores[1])
    async with b:
        a = registry(stores[0])
        kept = await a.acquire("m", attempt_id="at-kept", lease_s=1.0)
        await a.close()  # replica a is gone; its lease still stands in the store
        renewed = await b.renew_lease(kept.lease_id, 30.0)
        assert renewed.lease_id == kept.lease_id and renewed.attempt_id == "at-kept"
        await b.release(kept.lease_id)  # released through b: nobody else can renew it now
        with pytest.raises(Conflict):
            await b.renew_lease(kept.lease_id)

        c = registry(stores[0])
        lapsing = await c.acquire("m", attempt_id="at-lapsing", lease_s=0.2)
        await c.close()
        await asyncio.sleep(max(0.0, lapsing.expires_at - time.time()) + 0.05)  # time to lapse
        with pytest.raises(Conflict, match="expired"):  # lapsed: refused even before a sweep
            await b.renew_lease(lapsing.lease_id)
        deadline = time.monotonic() + 10
        while await b.held_leases("m"):  # b's sweep ends the dead replica's lapsed lease
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


async def test_the_in_process_calls_point_to_the_awaited_ones(
    stores: tuple[SqlStore, SqlStore],
) -> None:
    async with registry(stores[0]) as a:
        with pytest.raises(InvalidInput, match="renew_lease"):
            a.renew("x")
        with pytest.raises(InvalidInput, match="held_leases"):
            a.leases()
        with pytest.raises(InvalidInput, match="lease_s"):
            await a.renew_lease("x", -1.0)
