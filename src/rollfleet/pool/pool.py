"""A pool of M expensive environments shared by N holders, with background resets.

How it differs from the seed's VMPoolManager: nothing runs under a pool-wide lock (the
pool lives on one event loop and only touches its own bookkeeping between awaits), a
released instance is reset in its own background task so resets of different instances
overlap, an instance whose reset or health check fails is quarantined, stopped and
replaced (bounded retries with backoff), and acquires are served strictly in arrival order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from rollfleet.aio import TaskSet
from rollfleet.errors import Conflict, PoolError, PoolTimeout
from rollfleet.pool.base import (
    Instance,
    InstanceInfo,
    InstanceState,
    PoolStats,
    Provider,
)
from rollfleet.stats import percentile

log = logging.getLogger("rollfleet.pool")

ALIVE = frozenset(
    {
        InstanceState.STARTING,
        InstanceState.IDLE,
        InstanceState.BUSY,
        InstanceState.RESETTING,
        InstanceState.BROKEN,
    }
)
SERVING = frozenset({InstanceState.IDLE, InstanceState.BUSY, InstanceState.RESETTING})


@dataclass(frozen=True)
class PoolPolicy:
    """Timeouts, health checks and the replacement budget of one pool."""

    start_timeout_s: float | None = 900.0
    reset_timeout_s: float | None = 600.0
    check_timeout_s: float | None = 60.0
    check_after_reset: bool = True
    check_interval_s: float | None = None  # periodic checks of idle instances; None = off
    max_start_attempts: int = 3  # per replacement; then the slot is STOPPED and stats say so
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def backoff(self, failures: int) -> float:
        """Seconds to wait before start attempt number ``failures + 1``."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1)))


@dataclass
class _Slot:
    index: int
    instance_id: str
    state: InstanceState = InstanceState.STARTING
    generation: int = 0
    handle: Any = None
    endpoint: str | None = None
    attempt_id: str | None = None
    serial: int = 0
    released: bool = True
    leases: int = 0
    failures: int = 0
    last_error: str | None = None
    busy_since: float | None = None
    busy_total: float = 0.0


@dataclass
class _Waiter:
    ticket: int
    attempt_id: str | None
    since: float
    future: asyncio.Future[Instance] = field(repr=False)


async def _bounded(awaitable: Awaitable[Any], timeout: float | None, what: str) -> Any:
    """Await ``awaitable`` for at most ``timeout`` seconds, naming ``what`` when it runs over."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError as exc:
        raise PoolError(f"{what} took longer than {timeout}s") from exc


class Pool:
    """M instances of one provider, handed out first-come first-served and reset in the
    background."""

    def __init__(
        self, provider: Provider, size: int, *, name: str = "pool", policy: PoolPolicy | None = None
    ) -> None:
        """Describe the pool; nothing starts until :meth:`start` or the first acquire."""
        if size < 1:
            raise PoolError(f"pool {name}: size must be at least 1, got {size}")
        self.name = name
        self.provider = provider
        self.policy = policy or PoolPolicy()
        self._slots = [_Slot(i, f"{name}-{i}") for i in range(size)]
        self._by_id = {slot.instance_id: slot for slot in self._slots}
        self._idle: deque[_Slot] = deque()
        self._waiters: deque[_Waiter] = deque()
        self._tasks = TaskSet(log, f"pool {name}")
        self._tickets = itertools.count(1)
        self._serials = itertools.count(1)
        self._waits: deque[float] = deque(maxlen=10_000)
        self._changed = asyncio.Event()
        self._acquired = self._timeouts = self._replacements = 0
        self._started_at: float | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start every instance in the background (idempotent); acquire waits for them."""
        if self._started_at is not None:
            return
        if self._closed:
            raise PoolError(f"pool {self.name} is closed")
        preflight = getattr(self.provider, "preflight", None)
        if preflight is not None:
            preflight()  # a missing package or hypervisor is an error now, not a retry loop
        self._started_at = time.monotonic()
        log.info(
            "pool %s: starting %d %s instances", self.name, len(self._slots), self.provider.name
        )
        for slot in self._slots:
            self._tasks.spawn(self._bring_up(slot), f"pool {self.name}: start {slot.instance_id}")
        if self.policy.check_interval_s:
            self._tasks.spawn(
                self._health_loop(self.policy.check_interval_s), f"pool {self.name}: health checks"
            )

    async def close(self) -> None:
        """Stop every instance and fail every waiter; holders' later releases are ignored."""
        if self._closed:
            return
        self._closed = True
        await self._tasks.cancel()
        self._fail_waiters(PoolError(f"pool {self.name} closed"))
        await asyncio.gather(*(self._stop_slot(slot) for slot in self._slots))
        for slot in self._slots:
            slot.state = InstanceState.STOPPED
        self._idle.clear()
        self._bump()
        log.info("pool %s: closed", self.name)

    async def __aenter__(self) -> Pool:
        """Start the pool."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the pool."""
        await self.close()

    # ---- acquire / release -----------------------------------------------------------

    async def acquire(
        self, timeout: float | None = None, *, attempt_id: str | None = None
    ) -> Instance:
        """Wait (first come, first served) for a clean instance; PoolTimeout after ``timeout`` s."""
        await self.start()
        self._raise_if_unusable()
        ticket, since = next(self._tickets), time.monotonic()
        if self._idle and not self._waiters:
            return self._grant(self._idle.popleft(), ticket, attempt_id, since)
        waiter = _Waiter(ticket, attempt_id, since, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._bump()
        try:
            await asyncio.wait({waiter.future}, timeout=timeout)
        except BaseException:
            self._abandon(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()
        self._abandon(waiter)
        self._timeouts += 1
        raise PoolTimeout(
            f"pool {self.name}: no instance became free within {timeout}s "
            f"({len(self._waiters)} other acquires waiting, {self._count(InstanceState.BUSY)} busy)"
        )

    async def release(self, instance: Instance, *, broken: bool = False, reason: str = "") -> None:
        """Give ``instance`` back; it is reset (or, if ``broken``, replaced) in the background."""
        slot = self._slot_of(instance)
        if slot.serial != instance.serial:
            raise Conflict(
                f"pool {self.name}: {instance.instance_id} is no longer held by lease "
                f"#{instance.serial} (now #{slot.serial}, {slot.state.value})"
            )
        if slot.released or self._closed:
            return
        slot.released = True
        slot.busy_total += time.monotonic() - (slot.busy_since or time.monotonic())
        slot.busy_since, slot.attempt_id = None, None
        if broken:
            slot.state = InstanceState.BROKEN
            self._tasks.spawn(
                self._replace(slot, f"holder reported it broken: {reason}"),
                f"pool {self.name}: replace",
            )
        else:
            slot.state = InstanceState.RESETTING
            self._tasks.spawn(self._recycle(slot), f"pool {self.name}: reset {slot.instance_id}")
        self._bump()

    @asynccontextmanager
    async def lease(
        self, *, attempt_id: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[Instance]:
        """Hold one instance for the body of ``async with``; release it whatever happens."""
        instance = await self.acquire(timeout, attempt_id=attempt_id)
        try:
            yield instance
        finally:
            await self.release(instance)

    # ---- observation -----------------------------------------------------------------

    def stats(self) -> PoolStats:
        """Per-instance state, waiting acquires, wait-time percentiles and utilisation."""
        now = time.monotonic()
        infos = [self._info(slot) for slot in self._slots]
        healthy = sum(1 for s in self._slots if s.state in SERVING)
        busy = sum(
            s.busy_total + (now - s.busy_since if s.busy_since else 0.0) for s in self._slots
        )
        elapsed = (now - self._started_at) if self._started_at is not None else 0.0
        waits = list(self._waits)
        return PoolStats(
            name=self.name,
            provider=self.provider.name,
            size=len(self._slots),
            healthy=healthy,
            degraded=any(s.state is InstanceState.STOPPED for s in self._slots)
            and not self._closed,
            states={st.value: self._count(st) for st in InstanceState},
            instances=infos,
            waiting=len(self._waiters),
            acquired=self._acquired,
            timeouts=self._timeouts,
            replacements=self._replacements,
            wait_p50_s=percentile(waits, 0.5) if waits else 0.0,
            wait_p90_s=percentile(waits, 0.9) if waits else 0.0,
            wait_p99_s=percentile(waits, 0.99) if waits else 0.0,
            utilisation=busy / (elapsed * len(self._slots)) if elapsed > 0 else 0.0,
        )

    async def wait_for(self, predicate: Callable[[PoolStats], bool], timeout: float) -> PoolStats:
        """Wait until ``predicate(stats)`` holds; PoolTimeout after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate(stats := self.stats()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolTimeout(f"pool {self.name}: condition not met within {timeout}s: {stats}")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        return stats

    # ---- internals: handing out --------------------------------------------------------

    def _grant(self, slot: _Slot, ticket: int, attempt_id: str | None, since: float) -> Instance:
        now = time.monotonic()
        slot.state, slot.released, slot.attempt_id = InstanceState.BUSY, False, attempt_id
        slot.serial, slot.busy_since = next(self._serials), now
        slot.leases += 1
        self._acquired += 1
        self._waits.append(now - since)
        self._bump()
        return Instance(
            instance_id=slot.instance_id,
            pool=self.name,
            endpoint=slot.endpoint,
            handle=slot.handle,
            generation=slot.generation,
            attempt_id=attempt_id,
            ticket=ticket,
            serial=slot.serial,
        )

    def _make_idle(self, slot: _Slot) -> None:
        """A clean instance: give it to the longest-waiting acquire, or park it."""
        slot.state = InstanceState.IDLE
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(
                    self._grant(slot, waiter.ticket, waiter.attempt_id, waiter.since)
                )
                return
        self._idle.append(slot)
        self._bump()

    def _abandon(self, waiter: _Waiter) -> None:
        """An acquire gave up (timeout, cancellation): drop it, return anything it was granted."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            granted = future.result()
            slot = self._slot_of(granted)
            slot.released, slot.busy_since, slot.attempt_id = True, None, None
            slot.leases -= 1
            self._acquired -= 1
            self._make_idle(slot)
        else:
            waiter.future.cancel()
        self._bump()

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise PoolError(f"pool {self.name} is closed")
        if not any(slot.state in ALIVE for slot in self._slots):
            errors = "; ".join(f"{s.instance_id}: {s.last_error}" for s in self._slots)
            raise PoolError(
                f"pool {self.name}: every instance failed and could not be replaced ({errors})"
            )

    def _fail_waiters(self, error: PoolError) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error)

    # ---- internals: instance lifecycle (each runs in its own background task) -----------

    async def _bring_up(self, slot: _Slot) -> None:
        """Start (and check) a fresh instance in ``slot``, retrying with backoff; give up loudly."""
        for attempt in range(1, self.policy.max_start_attempts + 1):
            slot.state, slot.handle, slot.endpoint = InstanceState.STARTING, None, None
            self._bump()
            try:
                slot.handle = await _bounded(
                    self.provider.start(slot.instance_id),
                    self.policy.start_timeout_s,
                    f"starting {slot.instance_id}",
                )
                await _bounded(
                    self.provider.check(slot.handle),
                    self.policy.check_timeout_s,
                    f"checking new {slot.instance_id}",
                )
            except Exception as exc:  # noqa: BLE001 - any provider failure is a failed start
                self._note_failure(slot, f"start failed (try {attempt}): {exc}")
                await self._stop_slot(slot)
                if attempt < self.policy.max_start_attempts:
                    await asyncio.sleep(self.policy.backoff(attempt))
                continue
            slot.endpoint = self.provider.endpoint(slot.handle)
            log.info(
                "pool %s: %s ready (generation %d)", self.name, slot.instance_id, slot.generation
            )
            self._make_idle(slot)
            return
        slot.state = InstanceState.STOPPED
        log.error(
            "pool %s: gave up on %s after %d start attempts; pool is degraded (%s)",
            self.name,
            slot.instance_id,
            self.policy.max_start_attempts,
            slot.last_error,
        )
        if not any(s.state in ALIVE for s in self._slots):
            self._fail_waiters(
                PoolError(
                    f"pool {self.name}: no instance could be started "
                    f"(last error: {slot.last_error})"
                )
            )
        self._bump()

    async def _recycle(self, slot: _Slot) -> None:
        """Reset (and check) a released instance; replace it when either fails."""
        if not await self._survives(
            slot, self.provider.reset, self.policy.reset_timeout_s, "reset"
        ):
            return
        if self.policy.check_after_reset and not await self._healthy(slot):
            return
        self._make_idle(slot)

    async def _healthy(self, slot: _Slot) -> bool:
        """Run the provider's check; on failure the instance is replaced and False returned."""
        return await self._survives(
            slot, self.provider.check, self.policy.check_timeout_s, "health check"
        )

    async def _survives(
        self, slot: _Slot, step: Callable[[Any], Awaitable[None]], timeout: float | None, what: str
    ) -> bool:
        """Run one provider step on ``slot``; on any failure replace the instance, return False."""
        try:
            await _bounded(step(slot.handle), timeout, f"{what} of {slot.instance_id}")
        except Exception as exc:  # noqa: BLE001 - any provider failure quarantines the instance
            await self._replace(slot, f"{what} failed: {exc}")
            return False
        return True

    async def _replace(self, slot: _Slot, why: str) -> None:
        """Quarantine ``slot``'s instance, stop it and bring up a fresh one in its place."""
        slot.state = InstanceState.BROKEN
        self._note_failure(slot, why)
        self._bump()
        await self._stop_slot(slot)
        if self._closed:
            return
        self._replacements += 1
        slot.generation += 1
        await self._bring_up(slot)

    async def _health_loop(self, interval: float) -> None:
        """Check idle instances every ``interval`` seconds, taking each out of service meanwhile."""
        while True:
            await asyncio.sleep(interval)
            for slot in list(self._idle):
                if slot not in self._idle:
                    continue  # handed out meanwhile
                self._idle.remove(slot)
                slot.state = InstanceState.RESETTING
                if await self._healthy(slot):
                    self._make_idle(slot)

    async def _stop_slot(self, slot: _Slot) -> None:
        """Stop ``slot``'s instance if it has one; errors are logged, never raised."""
        handle, slot.handle = slot.handle, None
        if handle is None:
            return
        try:
            await _bounded(
                self.provider.stop(handle),
                self.policy.reset_timeout_s,
                f"stopping {slot.instance_id}",
            )
        except Exception as exc:  # noqa: BLE001 - a failed stop must not stop the pool
            log.warning("pool %s: stopping %s failed: %s", self.name, slot.instance_id, exc)

    def _note_failure(self, slot: _Slot, why: str) -> None:
        slot.failures += 1
        slot.last_error = why
        log.warning("pool %s: %s quarantined: %s", self.name, slot.instance_id, why)

    # ---- internals: bookkeeping ------------------------------------------------------

    def _slot_of(self, instance: Instance) -> _Slot:
        slot = self._by_id.get(instance.instance_id)
        if slot is None or instance.pool != self.name:
            raise Conflict(f"pool {self.name}: {instance.instance_id} does not belong to this pool")
        return slot

    def _info(self, slot: _Slot) -> InstanceInfo:
        return InstanceInfo(
            instance_id=slot.instance_id,
            state=slot.state,
            generation=slot.generation,
            endpoint=slot.endpoint,
            attempt_id=slot.attempt_id,
            leases=slot.leases,
            failures=slot.failures,
            last_error=slot.last_error,
        )

    def _count(self, state: InstanceState) -> int:
        return sum(1 for slot in self._slots if slot.state is state)

    def _bump(self) -> None:
        """Wake everyone in :meth:`wait_for`."""
        self._changed.set()
        self._changed = asyncio.Event()
