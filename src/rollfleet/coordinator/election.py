"""Which control-plane replica runs the batch coordinator: a PostgreSQL advisory lock.

Every ``rollfleet serve --db postgresql://…`` replica runs an :class:`Election`: on a dedicated
connection it tries ``pg_try_advisory_lock`` every ``interval_s``. The replica that holds the lock
leads: it loads the persisted batches (resuming unfinished finalizes) and answers ``/batches``;
it writes its URL under :data:`LEADER_KEY` so the others forward to it
(:mod:`rollfleet.coordinator.forwarding`). The lock lives as long as that connection: when the
leader dies (``kill -9``, a lost network) PostgreSQL drops the connection and the lock with it,
and the next replica to try takes over. A leader that loses its connection stops leading at once.
The lock is keyed by the database's schema, so fleets in separate schemas elect separately.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rollfleet.coordinator.state import STATE_PREFIX, BatchInfo, BatchState
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.coordinator")

LEADER_KEY = "coordinator/leader"
LOCK_CLASS = 7740114  # the first key of the two-key advisory lock; the second is the schema's hash
TRY_LOCK = (
    "SELECT pg_try_advisory_lock(%s, hashtext(current_database() || '.' || current_schema()))"
)
QUERY_S = 5.0  # a query on the lock's connection that takes longer: the connection is lost
Hook = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


async def stored_batches(store: Store) -> list[BatchInfo]:
    """Every batch as last persisted, read without acting on any (a replica that does not lead)."""
    found = await store.scan_state(STATE_PREFIX)
    listed = [BatchState.from_json(value).info() for value in found.values() if value]
    return sorted(listed, key=lambda b: b.created_at)


class Election:
    """Leadership among replicas through one advisory lock held on a dedicated connection."""

    def __init__(
        self,
        dsn: str,
        store: Store,
        url: str | None,
        *,
        on_elected: Hook = _nothing,
        on_deposed: Hook = _nothing,
        interval_s: float = 0.5,
    ) -> None:
        self.dsn = dsn
        self.url = url
        self._store = store
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._interval_s = interval_s
        self._leader = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this replica holds the lock now."""
        return self._leader

    async def leader_url(self) -> str | None:
        """The URL the current leader published (None before any replica led, or when it
        published none: an embedded server without an advertised URL)."""
        found: Any = await self._store.get_state(LEADER_KEY)
        url = found.get("url") if isinstance(found, dict) else None
        return None if not url else str(url)

    async def changed(self, timeout: float) -> None:
        """Return when this replica's leadership changes, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def start(self) -> None:
        """Begin trying for the lock in the background (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rollfleet-coordinator-election")

    async def close(self) -> None:
        """Stop trying; a held lock goes with the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        import psycopg

        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                    await self._hold(conn)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection dropped: so did the lock, if held
                log.warning("coordinator election connection lost (%s); retrying", exc)
            finally:
                await self._set(False)
            await asyncio.sleep(self._interval_s)

    async def _hold(self, conn: Any) -> None:
        """Try for the lock until granted, then keep checking that the connection lives."""
        while True:
            if not self._leader:
                cursor = await asyncio.wait_for(conn.execute(TRY_LOCK, (LOCK_CLASS,)), QUERY_S)
                row = await cursor.fetchone()
                if row[0]:
                    await self._store.put_state(LEADER_KEY, {"url": self.url})
                    await self._set(True)
            else:
                # raises once the connection is gone; a hung one counts as gone
                await asyncio.wait_for(conn.execute("SELECT 1"), QUERY_S)
            await asyncio.sleep(self._interval_s)

    async def _set(self, leader: bool) -> None:
        if leader == self._leader:
            return
        if leader:
            await self._on_elected()  # batches loaded before the first request is served here
        self._leader = leader
        self._changed.set()
        self._changed = asyncio.Event()
        log.info("coordinator leadership %s (%s)", "taken" if leader else "given up", self.url)
        if not leader:
            await self._on_deposed()
