"""The lease service over real HTTP (uvicorn in-process) with RemotePool as the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from support import free_port

from rollfleet.errors import Conflict, NotFound, PoolError, PoolTimeout, Unauthorized
from rollfleet.pool.leases import PoolRegistry
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.memory import MemoryProvider
from rollfleet.pool.remote import RemotePool, fetch_pool_stats
from rollfleet.pool.service import pool_app


@dataclass
class Served:
    """A running pool service: its registry, URL and the provider behind its pool."""

    registry: PoolRegistry
    url: str
    provider: MemoryProvider

    @property
    def pool(self) -> Pool:
        """The one pool, called ``m``."""
        return self.registry.pool("m")


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``condition`` to hold, checking every few milliseconds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def serve(
    registry: PoolRegistry, token: str | None = None
) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    """Start uvicorn for ``registry`` on a free port; wait until it listens."""
    port = free_port()
    config = uvicorn.Config(
        pool_app(registry, token=token),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws="none",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started)
    return server, task, f"http://127.0.0.1:{port}/pools"


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """A one-instance memory pool served over HTTP."""
    provider = MemoryProvider()
    registry = PoolRegistry([(Pool(provider, 1, name="m", policy=PoolPolicy(backoff_s=0.0)), 30.0)])
    server, task, url = await serve(registry)
    yield Served(registry, url, provider)
    server.should_exit = True
    await task


async def test_remote_acquire_renew_release_roundtrip(served: Served) -> None:
    async with RemotePool(served.url, "m", lease_s=5) as remote:
        instance = await remote.acquire(5, attempt_id="att-1")
        assert instance.instance_id == "m-0" and instance.endpoint == "memory://m-0/1"
        assert instance.lease_id and instance.handle is None
        [lease] = served.registry.leases("m")
        assert (lease.lease_id, lease.attempt_id) == (instance.lease_id, "att-1")
        renewed = await remote.renew(instance, lease_s=60)
        assert renewed.expires_at is not None and instance.expires_at is not None
        assert renewed.expires_at > instance.expires_at
        await remote.release(instance)
        assert served.registry.leases() == []
        await served.pool.wait_for(lambda s: s.states["IDLE"] == 1, 5)
        stats = await remote.stats()
        assert stats.acquired == 1 and stats.instances[0].leases == 1
        assert [s.name for s in await fetch_pool_stats(served.url)] == ["m"]


async def test_unrenewed_lease_expires_and_the_instance_is_reset_and_reused(served: Served) -> None:
    async with RemotePool(served.url, "m", lease_s=0.3) as remote:
        first = await remote.acquire(5, attempt_id="dead-runner")
        await until(
            lambda: served.registry.leases() == [] and served.pool.stats().states["IDLE"] == 1
        )
        assert served.provider.envs[0].resets == 1
        with pytest.raises(Conflict, match="expired"):
            await remote.renew(first)
        with pytest.raises(Conflict, match="expired"):
            await remote.release(first)
        second = await remote.acquire(5, attempt_id="next")
        assert second.instance_id == first.instance_id and second.lease_id != first.lease_id
        await remote.release(second)


async def test_lease_context_renews_in_the_background(served: Served) -> None:
    async with RemotePool(served.url, "m", lease_s=0.3) as remote:
        async with remote.lease(attempt_id="long", timeout=5) as instance:
            [lease] = served.registry.leases()
            first_expiry = lease.expires_at
            await until(lambda: served.registry.leases()[0].expires_at > first_expiry + 0.3)
            assert served.registry.leases()[0].lease_id == instance.lease_id
        await until(lambda: served.registry.leases() == [])
        assert served.pool.stats().instances[0].leases == 1


async def test_lost_lease_cancels_the_holder_and_raises(served: Served) -> None:
    never = asyncio.Event()
    async with RemotePool(served.url, "m", lease_s=0.3) as remote:
        with pytest.raises(PoolError, match="was lost"):
            async with remote.lease(attempt_id="slow", timeout=5) as instance:
                await served.registry.release(instance.lease_id or "")  # the server ends it
                await asyncio.wait_for(never.wait(), 10)
        assert not never.is_set()


async def test_server_errors_come_back_as_rollfleet_errors(served: Served) -> None:
    async with RemotePool(served.url, "m") as remote, RemotePool(served.url, "nope") as missing:
        held = await remote.acquire(5)
        with pytest.raises(PoolTimeout, match="within 0.05s"):
            await remote.acquire(0.05)
        with pytest.raises(NotFound, match="no pool named 'nope'"):
            await missing.acquire(1)
        await remote.release(held)


async def test_a_waiter_that_disconnects_loses_its_place(served: Served) -> None:
    async with RemotePool(served.url, "m") as remote:
        held = await remote.acquire(5)
        waiter = asyncio.create_task(remote.acquire(30, attempt_id="gone"))
        await served.pool.wait_for(lambda s: s.waiting == 1, 5)
        waiter.cancel()
        await served.pool.wait_for(lambda s: s.waiting == 0, 5)
        await remote.release(held)
        again = await remote.acquire(5, attempt_id="next")
        assert served.registry.leases()[0].attempt_id == "next"
        await remote.release(again)


async def test_bearer_token_is_required_when_set() -> None:
    registry = PoolRegistry([(Pool(MemoryProvider(), 1, name="m"), 30.0)])
    server, task, url = await serve(registry, token="s3cret")
    try:
        with pytest.raises(Unauthorized):
            await fetch_pool_stats(url)
        assert [s.name for s in await fetch_pool_stats(url, token="s3cret")] == ["m"]
        async with RemotePool(url, "m", token="s3cret") as remote:
            await remote.release(await remote.acquire(5))
    finally:
        server.should_exit = True
        await task


async def test_unreachable_service_is_a_pool_error() -> None:
    async with RemotePool(f"http://127.0.0.1:{free_port()}/pools", "m") as remote:
        with pytest.raises(PoolError, match="cannot be reached"):
            await remote.acquire(1)


async def test_registry_refuses_bad_lease_lengths_and_unknown_leases() -> None:
    from rollfleet.errors import InvalidInput

    async with PoolRegistry([(Pool(MemoryProvider(), 1, name="m"), 30.0)]) as registry:
        with pytest.raises(InvalidInput, match="lease_s"):
            await registry.acquire("m", lease_s=-1)
        with pytest.raises(NotFound, match="no lease"):
            registry.renew("nope")
        with pytest.raises(InvalidInput, match="two pools"):
            registry.add(Pool(MemoryProvider(), 1, name="m"))


async def test_malformed_requests_are_invalid_input(served: Served) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{served.url}/m/leases", json={"timeout_s": -1})
    assert response.status_code == 422
    assert response.json()["error"] == "InvalidInput" and "timeout_s" in response.json()["message"]


async def test_a_server_hosting_no_pools_reports_none(served: Served) -> None:
    assert await fetch_pool_stats(served.url.removesuffix("/pools") + "/elsewhere") == []
