"""Leases on pool instances: the control plane's record of who holds what, until when.

A lease ties an instance to a rollout attempt and expires unless renewed. The reaper
releases expired leases, so an instance held by a runner that was killed (even with
SIGKILL) is reset and handed to the next waiter once its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from rollfleet.errors import Conflict, InvalidInput, NotFound
from rollfleet.pool.base import Instance, PoolStats, Report
from rollfleet.pool.pool import Pool

log = logging.getLogger("rollfleet.pool")

MAX_LEASE_S = 24 * 3600.0


class Lease(Report):
    """An instance held by one rollout attempt until ``expires_at`` (unix time) unless renewed."""

    lease_id: str
    pool: str
    instance_id: str
    endpoint: str | None
    generation: int
    attempt_id: str | None
    ticket: int
    serial: int
    lease_s: float
    expires_at: float

    def instance(self) -> Instance:
        """The instance as a remote holder sees it (no in-process handle)."""
        return Instance(
            instance_id=self.instance_id,
            pool=self.pool,
            endpoint=self.endpoint,
            generation=self.generation,
            attempt_id=self.attempt_id,
            lease_id=self.lease_id,
            ticket=self.ticket,
            serial=self.serial,
            expires_at=self.expires_at,
        )


@dataclass
class _Held:
    lease: Lease
    instance: Instance
    deadline: float  # time.monotonic()


def _check_lease_s(lease_s: float) -> float:
    if not 0 < lease_s <= MAX_LEASE_S:
        raise InvalidInput(f"lease_s must be in (0, {MAX_LEASE_S}], got {lease_s}")
    return lease_s


class PoolRegistry:
    """Named pools plus the lease table and its reaper; what the control plane serves."""

    def __init__(self, pools: Iterable[tuple[Pool, float]] = ()) -> None:
        """``pools``: (pool, default lease seconds) pairs."""
        self._pools: dict[str, Pool] = {}
        self._lease_s: dict[str, float] = {}
        self._held: dict[str, _Held] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # recent ended leases, for clear errors
        self._changed = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        for pool, lease_s in pools:
            self.add(pool, lease_s)

    def add(self, pool: Pool, lease_s: float = 60.0) -> None:
        """Serve ``pool`` under its name, with leases of ``lease_s`` seconds by default."""
        if pool.name in self._pools:
            raise InvalidInput(f"two pools are named {pool.name!r}")
        self._pools[pool.name] = pool
        self._lease_s[pool.name] = _check_lease_s(lease_s)

    @property
    def names(self) -> list[str]:
        """The pools' names."""
        return list(self._pools)

    def pool(self, name: str) -> Pool:
        """The pool called ``name``; NotFound otherwise."""
        try:
            return self._pools[name]
        except KeyError:
            raise NotFound(
                f"no pool named {name!r} (pools: {', '.join(self._pools) or 'none'})"
            ) from None

    async def start(self) -> None:
        """Start every pool and the lease reaper (idempotent)."""
        if self._reaper is not None:
            return
        for pool in self._pools.values():
            await pool.start()
        self._reaper = asyncio.get_running_loop().create_task(
            self._reap_forever(), name="lease reaper"
        )

    async def close(self) -> None:
        """Stop the reaper and close every pool."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await asyncio.gather(*(pool.close() for pool in self._pools.values()))

    async def __aenter__(self) -> PoolRegistry:
        """Start everything."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close everything."""
        await self.close()

    # ---- leases ----------------------------------------------------------------------

    async def acquire(
        self,
        pool_name: str,
        *,
        attempt_id: str | None = None,
        timeout: float | None = None,
        lease_s: float | None = None,
    ) -> Lease:
        """Wait for an instance of ``pool_name`` (FIFO) and lease it to ``attempt_id``."""
        lease, instance = await self._grant(pool_name, attempt_id, timeout, lease_s)
        self._held[lease.lease_id] = _Held(lease, instance, time.monotonic() + lease.lease_s)
        self._changed.set()
        return lease

    async def _grant(
        self, pool_name: str, attempt_id: str | None, timeout: float | None, lease_s: float | None
    ) -> tuple[Lease, Instance]:
        """Wait for an instance and describe its lease (recording it is the caller's part)."""
        await self.start()
        pool = self.pool(pool_name)
        seconds = _check_lease_s(lease_s or self._lease_s[pool_name])
        instance = await pool.acquire(timeout, attempt_id=attempt_id)
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            pool=pool_name,
            instance_id=instance.instance_id,
            endpoint=instance.endpoint,
            generation=instance.generation,
            attempt_id=attempt_id,
            ticket=instance.ticket,
            serial=instance.serial,
            lease_s=seconds,
            expires_at=time.time() + seconds,
        )
        log.info(
            "lease %s: %s → attempt %s for %.0fs",
            lease.lease_id,
            instance.instance_id,
            attempt_id,
            seconds,
        )
        return lease, instance

    def renew(self, lease_id: str, lease_s: float | None = None) -> Lease:
        """Push the lease's expiry ``lease_s`` seconds (default: its own length) into the future."""
        held = self._current(lease_id)
        seconds = _check_lease_s(lease_s or held.lease.lease_s)
        held.deadline = time.monotonic() + seconds
        held.lease = held.lease.model_copy(
            update={"expires_at": time.time() + seconds, "lease_s": seconds}
        )
        self._changed.set()
        return held.lease

    async def renew_lease(self, lease_id: str, lease_s: float | None = None) -> Lease:
        """``renew`` as the HTTP API calls it (a shared registry renews in the store)."""
        return self.renew(lease_id, lease_s)

    async def held_leases(self, pool_name: str | None = None) -> list[Lease]:
        """``leases`` as the HTTP API calls it (a shared registry reads the store)."""
        return self.leases(pool_name)

    async def release(self, lease_id: str, *, broken: bool = False, reason: str = "") -> None:
        """End the lease; the instance is reset (or replaced if ``broken``) in the background."""
        held = self._current(lease_id)
        await self._end(
            held, "released" + (f" as broken: {reason}" if broken else ""), broken=broken
        )

    def leases(self, pool_name: str | None = None) -> list[Lease]:
        """Leases held now, oldest first."""
        return [h.lease for h in self._held.values() if pool_name in (None, h.lease.pool)]

    def stats(self) -> list[PoolStats]:
        """Every pool's stats."""
        return [pool.stats() for pool in self._pools.values()]

    async def expire_due(self) -> list[Lease]:
        """Release every lease whose deadline has passed; return them."""
        now = time.monotonic()
        due = [h for h in self._held.values() if h.deadline <= now]
        for held in due:
            log.warning(
                "lease %s: attempt %s did not renew; expired, reclaiming %s",
                held.lease.lease_id,
                held.lease.attempt_id,
                held.lease.instance_id,
            )
            await self._end(held, "expired")
        return [h.lease for h in due]

    # ---- internals ---------------------------------------------------------------------

    def _current(self, lease_id: str) -> _Held:
        held = self._held.get(lease_id)
        if held is not None:
            return held
        if lease_id in self._gone:
            raise Conflict(f"lease {lease_id} has ended ({self._gone[lease_id]})")
        raise NotFound(f"no lease {lease_id}")

    async def _end(self, held: _Held, why: str, *, broken: bool = False) -> None:
        self._held.pop(held.lease.lease_id, None)
        self._gone[held.lease.lease_id] = why
        while len(self._gone) > 10_000:
            self._gone.popitem(last=False)
        await self._pools[held.lease.pool].release(held.instance, broken=broken, reason=why)
        self._changed.set()

    async def _reap_forever(self) -> None:
        """Sleep until the next deadline (or a change), then expire what is due."""
        while True:
            self._changed.clear()
            await self.expire_due()
            deadlines = [h.deadline for h in self._held.values()]
            wait = min(deadlines) - time.monotonic() if deadlines else None
            try:
                await asyncio.wait_for(self._changed.wait(), wait)
            except TimeoutError:
                pass
