"""The live hub: one task per server watches the store and pushes changes to every open dashboard.

It sleeps on ``store.wait_for_change`` (woken by every write, no polling of the database), then
reads what changed since its last pass (``query_rollouts(updated_after=…)``), the statistics,
the workers and the extras (batches, pools, engines), and sends each subscriber only the
sections that differ from what it sent before. Bursts of writes are coalesced to at most
one push per ``MIN_INTERVAL_S``. With no subscriber left, the task stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson

from rollfleet.model import TERMINAL_ROLLOUT, Rollout, RolloutStatus
from rollfleet.server.dashboard import views
from rollfleet.store.base import Store, iter_pages

log = logging.getLogger("rollfleet.dashboard")

Provider = Callable[[], Awaitable[Any] | Any]
EXTRA_SECTIONS = ("batches", "pools", "engines")
MIN_INTERVAL_S = 0.1  # a burst of writes becomes one push per this interval
IDLE_REFRESH_S = 2.0  # extras (pools, engines) change without store writes: look again this often
OVERLAP_S = 2.0  # re-read this much before the last pass: a write's clock may precede its commit
MAX_CHANGED = 2000  # rollouts sent per push at most; the page refetches when told it was truncated
QUEUE_SIZE = 64
HISTORY_PAGE = 250  # small reads, so loading the charts' history interleaves with page requests


async def call_provider(fn: Provider | None) -> Any:
    """Call a sync or async provider; None when there is none."""
    if fn is None:
        return None
    value = fn()
    if inspect.isawaitable(value):
        value = await value
    return value


async def load_history(store: Store, now: float) -> views.History:
    """Read the last hour's finished rollouts into a fresh History."""
    history = views.History()
    pages = iter_pages(
        lambda cursor: _query(
            store,
            status=list(TERMINAL_ROLLOUT),
            cursor=cursor,
            updated_after=now - views.HISTORY_S,
            limit=HISTORY_PAGE,
        )
    )
    async for items in pages:
        history.add(items, now)
    return history


def knows_updated_after(store: Store) -> bool:
    """True for stores whose query_rollouts can filter by ``updated_after`` (the SQL stores)."""
    return "updated_after" in inspect.signature(store.query_rollouts).parameters


async def _query(store: Store, **kwargs: Any) -> Any:
    """query_rollouts, passing ``updated_after`` only to stores that know it."""
    if not knows_updated_after(store):
        kwargs.pop("updated_after", None)
    return await store.query_rollouts(**kwargs)


def sse(event: str, data: Any) -> bytes:
    """One server-sent event frame."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Subscriber:
    """One open event stream: a bounded queue; a slow reader gets a resync instead of a backlog."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_SIZE)
        self.stale = False

    def put(self, frame: bytes | None) -> None:
        """Queue a frame; if the reader lags, drop what is queued and mark it stale."""
        if self.stale and frame is not None:
            return  # the snapshot it gets next is newer than this frame
        try:
            self.queue.put_nowait(frame)
        except asyncio.QueueFull:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.stale = True
            self.queue.put_nowait(None if frame is None else b"")


class LiveHub:
    """Watches the store for one server and fans the changes out to subscribers."""

    def __init__(self, store: Store, extras: Mapping[str, Any]) -> None:
        self.store = store
        self.extras = extras
        self.subscribers: set[Subscriber] = set()
        self.state: dict[str, Any] = {}
        self.history: views.History | None = None
        self._since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._incremental = knows_updated_after(store)
        self._lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        """True while the watch task runs."""
        return self._task is not None and not self._task.done()

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscriber]:
        """Register a stream; the first one starts the watch task, the last one stops it."""
        sub = Subscriber()
        async with self._lock:
            if not self.running:
                await self._start()
        self.subscribers.add(sub)
        try:
            yield sub
        finally:
            self.subscribers.discard(sub)
            if not self.subscribers and self._task is not None:
                self._task.cancel()
                self._task = None
                log.info("dashboard live updates stopped (no viewer)")

    def snapshot(self) -> dict[str, Any]:
        """Everything a freshly opened page needs to show live data."""
        return {**self.state, "server_time": time.time()}

    async def _start(self) -> None:
        now = time.time()
        self.history = None
        self._since = now
        self.state = await self.collect([], now)
        self._task = asyncio.create_task(self._run(), name="rollfleet-dashboard-live")
        log.info("dashboard live updates started")

    async def _run(self) -> None:
        # The charts' history loads after the first snapshot went out, so it never delays a page.
        self.history = await load_history(self.store, self._since or time.time())
        wait = getattr(self.store, "wait_for_change", None)
        while True:
            started = time.monotonic()
            # Arm the wake-up before reading, so a write that lands during the read is not missed.
            woken = asyncio.ensure_future(
                wait(IDLE_REFRESH_S) if wait else asyncio.sleep(IDLE_REFRESH_S / 2)
            )
            await asyncio.sleep(0)
            try:
                await self.push()
            except Exception:  # a passing store error must not end live updates
                log.exception("dashboard live update failed")
            try:
                await woken
            finally:
                woken.cancel()
            spent = time.monotonic() - started
            if spent < MIN_INTERVAL_S:
                await asyncio.sleep(MIN_INTERVAL_S - spent)  # coalesce a burst of writes

    async def push(self) -> None:
        """Read what changed and send each differing section to every subscriber."""
        now = time.time()
        changed = await self._changed_rollouts(now) if self._incremental else []
        state = await self.collect(changed, now)
        update = {k: v for k, v in state.items() if self.state.get(k) != v}
        self.state = state
        if not self._incremental and "stats" in update:
            # this store cannot say which rollouts changed: pages refetch
            update["truncated"] = True
        if changed:
            update["rollouts"] = [views.rollout_row(r) for r in changed[:MAX_CHANGED]]
            update["truncated"] = len(changed) > MAX_CHANGED
        if not update:
            return
        update["server_time"] = now
        self.broadcast(sse("update", update))

    def broadcast(self, frame: bytes | None) -> None:
        """Queue a frame for every subscriber (None ends their streams)."""
        for sub in list(self.subscribers):
            sub.put(frame)

    async def _changed_rollouts(self, now: float) -> list[Rollout]:
        since = (self._since or now) - OVERLAP_S
        self._since = now
        found: dict[str, Rollout] = {}
        async for items in iter_pages(
            lambda cursor: _query(self.store, updated_after=since, cursor=cursor, limit=1000)
        ):
            found.update((r.rollout_id, r) for r in items)
            if len(found) > MAX_CHANGED:
                break
        return list(found.values())

    async def collect(self, changed: list[Rollout], now: float) -> dict[str, Any]:
        """The current state of every live section."""
        if self.history is not None:
            self.history.add(changed, now)
        stats = await self.store.statistics()
        state: dict[str, Any] = {
            "stats": views.stats_view(stats),
            "workers": await self._workers(now),
            "series": self.history.series(now) if self.history else None,
            "configured": {name: name in self.extras for name in (*EXTRA_SECTIONS, "abort_batch")},
        }
        for name in EXTRA_SECTIONS:
            state[name] = await self._extra(name)
        return state

    async def _extra(self, name: str) -> Any:
        if name not in self.extras:
            return None
        try:
            return await call_provider(self.extras[name])
        except (
            Exception
        ) as exc:  # a broken provider shows as an error on its page, not a dead stream
            log.warning("dashboard provider %s failed: %s", name, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}

    async def _workers(self, now: float) -> list[dict[str, Any]]:
        workers = (await self.store.query_workers(None, 1000)).items
        active = await self.store.query_rollouts(
            status=[RolloutStatus.PREPARING, RolloutStatus.RUNNING], limit=1000
        )
        by_attempt = {r.attempt.attempt_id: r.rollout_id for r in active.items if r.attempt}
        rows = [views.worker_row(w, by_attempt, now) for w in workers]
        if self.history is not None:
            for row in rows:
                row["recent_per_min"] = self.history.worker_rate(row["worker_id"], now)
        return rows
