"""Pool leases in the store: a lease granted through one control-plane replica is renewed,
released and expired through any other.

Each row is one lease on one pool instance. ``owner`` is the replica process that holds the
instance itself (instances are processes, sandboxes or VMs of that replica); the row is the
truth about who holds it until when. Any replica renews a live lease, ends one (released or
expired), and lists the held ones; the owner then gives ended leases' instances back to its pool
and marks them ``settled``. The table is created on first use, so an existing database gains it.
"""

from __future__ import annotations

from typing import Any

from rollfleet.errors import Conflict, NotFound
from rollfleet.model import now as wall_now
from rollfleet.store.sql_store import SqlStore
from rollfleet.store.tx import Row, Tx

_SCHEMA = ("pool_leases_lock", "pool_leases_table", "pool_leases_index")


def _create(tx: Tx) -> None:
    for name in _SCHEMA:
        tx.run(name)


def _renew(tx: Tx, lease_id: str, lease_s: float | None, now: float) -> Row:
    row = tx.one("pool_lease_get", lease_id=lease_id)
    if row is None:
        raise NotFound(f"no lease {lease_id}")
    seconds = lease_s or float(row["lease_s"])
    renewed = tx.one(
        "pool_lease_renew", lease_id=lease_id, lease_s=seconds, expires_at=now + seconds, now=now
    )
    if renewed is not None:
        return renewed
    # lapsed but not yet reaped counts as expired: the next reaper pass of any replica ends it
    raise Conflict(f"lease {lease_id} has ended ({row['ended'] or 'expired'})")


def _end(tx: Tx, lease_id: str, why: str, broken: bool) -> Row:
    row = tx.one("pool_lease_end", lease_id=lease_id, why=why, broken=int(broken))
    if row is not None:
        return row
    found = tx.one("pool_lease_get", lease_id=lease_id)
    if found is None:
        raise NotFound(f"no lease {lease_id}")
    raise Conflict(f"lease {lease_id} has ended ({found['ended']})")


class PoolLeaseTable:
    """The ``pool_leases`` table of one SQL store, one method per operation."""

    def __init__(self, store: SqlStore) -> None:
        self._backend = store.backend
        self._ready = False

    async def _write(self, fn: Any, *args: Any) -> Any:
        if not self._ready:
            await self._backend.write(_create)
            self._ready = True
        return await self._backend.write(fn, *args)

    async def insert(self, lease: dict[str, Any], owner: str) -> None:
        """Record a lease just granted by ``owner``."""
        row = {**lease, "owner": owner, "now": wall_now()}
        await self._write(lambda tx: tx.run("pool_lease_insert", **row))

    async def renew(self, lease_id: str, lease_s: float | None) -> Row:
        """Push a live lease's expiry ``lease_s`` (default: its own length) seconds ahead;
        Conflict once it has ended or lapsed, NotFound for an unknown id."""
        row: Row = await self._write(_renew, lease_id, lease_s, wall_now())
        return row

    async def end(self, lease_id: str, why: str, broken: bool = False) -> Row:
        """End a live lease (its owner settles the instance); Conflict if it had ended."""
        row: Row = await self._write(_end, lease_id, why, broken)
        return row

    async def expire_due(self) -> list[Row]:
        """End every lease, whoever owns it, whose expiry has passed; return them."""
        now = wall_now()
        rows: list[Row] = await self._write(lambda tx: tx.all("pool_leases_expire", now=now))
        return rows

    async def held(self, pool: str | None = None) -> list[Row]:
        """Leases held now (of one pool, or all), oldest first."""
        rows: list[Row] = await self._write(lambda tx: tx.all("pool_leases_held", pool=pool))
        return rows

    async def unsettled(self, owner: str) -> list[Row]:
        """Ended leases whose instances ``owner`` has not given back to its pools yet."""
        rows: list[Row] = await self._write(lambda tx: tx.all("pool_leases_unsettled", owner=owner))
        return rows

    async def settle(self, lease_id: str) -> None:
        """The owner has given this lease's instance back to its pool."""
        await self._write(lambda tx: tx.run("pool_lease_settle", lease_id=lease_id))
