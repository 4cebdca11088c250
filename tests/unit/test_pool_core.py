"""Pool behaviour with the in-package memory provider: order, timeouts, background resets, health."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from rollfleet.errors import Conflict, PoolError, PoolTimeout
from rollfleet.pool.base import Instance, InstanceState, PoolStats
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.memory import MemoryProvider
from rollfleet.stats import percentile

FAST = PoolPolicy(backoff_s=0.0, backoff_max_s=0.0, max_start_attempts=2)


def idle(n: int) -> Callable[[PoolStats], bool]:
    """A stats predicate: exactly ``n`` instances are IDLE."""
    return lambda s: s.states["IDLE"] == n


def waiting(n: int) -> Callable[[PoolStats], bool]:
    """A stats predicate: exactly ``n`` acquires are waiting."""
    return lambda s: s.waiting == n


async def ready_pool(provider: MemoryProvider, size: int, **kw: object) -> Pool:
    """A started pool with every instance IDLE."""
    pool = Pool(provider, size, name="t", policy=kw.pop("policy", FAST))  # type: ignore[arg-type]
    await pool.start()
    await pool.wait_for(idle(size), timeout=5)
    return pool


async def test_acquires_are_served_in_arrival_order() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    held = await pool.acquire(1)
    served: list[int] = []

    async def taker(i: int) -> None:
        instance = await pool.acquire(5)
        served.append(i)
        await pool.release(instance)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(taker(i)))
        await pool.wait_for(waiting(i + 1), timeout=5)
    await pool.release(held)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert served == [0, 1, 2, 3, 4]
    await pool.close()


async def test_acquire_times_out_with_pool_timeout_and_leaves_no_waiter() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    held = await pool.acquire(1)
    with pytest.raises(PoolTimeout, match="within 0.05s"):
        await pool.acquire(0.05)
    stats = pool.stats()
    assert (stats.waiting, stats.timeouts) == (0, 1)
    await pool.release(held)
    await pool.close()


async def test_release_returns_at_once_and_resets_run_concurrently() -> None:
    provider = MemoryProvider()
    pool = await ready_pool(provider, 2)
    provider.reset_gate = asyncio.Event()
    a, b = await pool.acquire(1), await pool.acquire(1)
    await asyncio.wait_for(pool.release(a), 1)
    await asyncio.wait_for(pool.release(b), 1)
    await pool.wait_for(
        lambda s: s.states["RESETTING"] == 2 and provider.resets_in_progress == 2, 5
    )
    assert provider.max_concurrent_resets == 2
    provider.reset_gate.set()
    await pool.wait_for(idle(2), 5)
    await pool.close()


async def test_next_holder_gets_a_clean_instance() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    async with pool.lease(attempt_id="a1") as first:
        first.handle.state["dirty"] = True
        assert pool.stats().instances[0].attempt_id == "a1"
    async with pool.lease(attempt_id="a2") as second:
        assert second.instance_id == first.instance_id
        assert second.handle.state == {}
        assert second.handle.resets == 1
    await pool.close()


@pytest.mark.parametrize(
    ("failing", "error"), [("fail_resets", "reset failed"), ("fail_checks", "health check failed")]
)
async def test_failed_reset_or_check_quarantines_and_replaces_the_instance(
    failing: str, error: str
) -> None:
    provider = MemoryProvider()
    pool = await ready_pool(provider, 1)
    first = await pool.acquire(1)
    setattr(provider, failing, 1)
    await pool.release(first)
    stats = await pool.wait_for(lambda s: s.replacements == 1 and s.states["IDLE"] == 1, 5)
    assert stats.instances[0].generation == 1
    assert error in (stats.instances[0].last_error or "")
    second = await pool.acquire(1)
    assert first.handle.stopped and not second.handle.stopped
    assert second.handle is not first.handle and second.generation == 1
    await pool.close()


async def test_holder_can_report_an_instance_broken() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    first = await pool.acquire(1)
    await pool.release(first, broken=True, reason="screen frozen")
    assert pool.stats().instances[0].state in (
        InstanceState.BROKEN,
        InstanceState.STARTING,
        InstanceState.IDLE,
    )
    second = await pool.acquire(5)
    assert second.handle is not first.handle and second.generation == 1
    assert "screen frozen" in (pool.stats().instances[0].last_error or "")
    await pool.close()


async def test_failed_start_is_retried_and_recovers() -> None:
    provider = MemoryProvider()
    provider.fail_starts = 1
    pool = await ready_pool(provider, 1)
    info = pool.stats().instances[0]
    assert (info.failures, info.state) == (1, InstanceState.IDLE)
    await pool.close()


async def test_pool_that_cannot_start_fails_acquires_and_says_degraded() -> None:
    provider = MemoryProvider()
    provider.fail_starts = 100
    pool = Pool(provider, 2, name="t", policy=FAST)
    with pytest.raises(PoolError, match="scripted start failure"):
        await pool.acquire(10)
    stats = await pool.wait_for(lambda s: s.states["STOPPED"] == 2, 5)
    assert stats.degraded and stats.healthy == 0
    with pytest.raises(PoolError, match="every instance failed"):
        await pool.acquire(1)
    await pool.close()


async def test_one_dead_slot_degrades_but_pool_keeps_serving() -> None:
    provider = MemoryProvider()
    pool = await ready_pool(provider, 2)
    first = await pool.acquire(1)
    provider.fail_resets, provider.fail_starts = 1, 100
    await pool.release(first)
    stats = await pool.wait_for(lambda s: s.states["STOPPED"] == 1, 5)
    assert stats.degraded and stats.healthy == 1 and stats.size == 2
    async with pool.lease(timeout=1) as instance:
        assert not instance.handle.stopped
    await pool.close()


async def test_stale_release_is_refused_and_double_release_is_harmless() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    first = await pool.acquire(1)
    await pool.release(first)
    await pool.release(first)  # same holder, twice: no effect
    second = await pool.acquire(5)
    with pytest.raises(Conflict, match="no longer held"):
        await pool.release(first)
    assert pool.stats().states["BUSY"] == 1
    await pool.release(second)
    await pool.close()


async def test_cancelled_waiter_does_not_leak_the_instance() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    held = await pool.acquire(1)
    first = asyncio.create_task(pool.acquire(5, attempt_id="first"))
    second = asyncio.create_task(pool.acquire(5, attempt_id="second"))
    await pool.wait_for(lambda s: s.waiting == 2, 5)
    await pool.release(held)
    await pool.wait_for(lambda s: s.instances[0].attempt_id == "first", 5)
    first.cancel()
    done = await asyncio.gather(first, return_exceptions=True)
    if isinstance(done[0], Instance):  # it resumed before the cancel landed: give it back
        await pool.release(done[0])
    instance = await asyncio.wait_for(second, 5)
    assert instance.attempt_id == "second"
    assert pool.stats().states["BUSY"] == 1
    await pool.close()


async def test_lease_releases_when_the_body_raises() -> None:
    pool = await ready_pool(MemoryProvider(), 1)
    with pytest.raises(ValueError):
        async with pool.lease(timeout=1):
            raise ValueError("agent crashed")
    await pool.wait_for(idle(1), 5)
    await pool.close()


async def test_stats_report_waits_and_utilisation() -> None:
    pool = await ready_pool(MemoryProvider(), 2)
    a = await pool.acquire(1)
    waiter = asyncio.create_task(pool.acquire(5))
    b = await pool.acquire(1)
    await pool.release(a)
    c = await asyncio.wait_for(waiter, 5)
    stats = pool.stats()
    assert stats.acquired == 3 and stats.wait_p99_s >= stats.wait_p50_s >= 0.0
    assert 0.0 < stats.utilisation <= 1.0
    assert {i.leases for i in stats.instances} == {1, 2}
    for instance in (b, c):
        await pool.release(instance)
    await pool.close()


async def test_periodic_health_check_replaces_an_unhealthy_idle_instance() -> None:
    provider = MemoryProvider()
    policy = PoolPolicy(check_interval_s=0.01, backoff_s=0.0)
    pool = await ready_pool(provider, 1, policy=policy)
    provider.envs[0].healthy = False
    await pool.wait_for(lambda s: s.replacements == 1 and s.states["IDLE"] == 1, 5)
    async with pool.lease(timeout=1) as instance:
        assert instance.handle.healthy and instance.handle is not provider.envs[0]
    await pool.close()


async def test_close_fails_waiters_and_stops_instances() -> None:
    provider = MemoryProvider()
    pool = await ready_pool(provider, 1)
    held = await pool.acquire(1)
    waiter = asyncio.create_task(pool.acquire(10))
    await pool.wait_for(lambda s: s.waiting == 1, 5)
    await pool.close()
    with pytest.raises(PoolError, match="closed"):
        await waiter
    assert held.handle.stopped and pool.stats().states["STOPPED"] == 1
    await pool.release(held)  # after close: ignored


def test_percentile_and_backoff() -> None:
    with pytest.raises(ValueError):
        percentile([], 0.5)
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(101)], 0.99) == 99.0
    policy = PoolPolicy(backoff_s=1.0, backoff_max_s=5.0)
    assert [policy.backoff(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]


def test_size_must_be_positive() -> None:
    with pytest.raises(PoolError, match="at least 1"):
        Pool(MemoryProvider(), 0)


def test_stats_before_start_are_empty() -> None:
    stats: PoolStats = Pool(MemoryProvider(), 3, name="x").stats()
    assert stats.states["STARTING"] == 3 and stats.utilisation == 0.0 and stats.size == 3
