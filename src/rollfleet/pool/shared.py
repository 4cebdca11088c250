"""A pool registry whose lease table is the store: what replicas of the control plane serve.

Every ``rollfleet serve --db postgresql://… --pools FILE`` replica hosts its own instances, but
the leases on them live in the shared database
(:class:`~rollfleet.store.pool_leases.PoolLeaseTable`).
So a lease granted through replica A is renewed, released or expired through replica B, and one
held through a replica that died stays honoured: its holder renews and releases it through
another. The replica that holds an instance (the lease's ``owner``) gives it back to its pool
when the lease ends, whoever ended it: at once when it ended the lease itself, else at its next
sweep (every ``sweep_s``). Every replica's sweep also expires lapsed leases, any owner's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollfleet.errors import InvalidInput
from rollfleet.pool.base import Instance
from rollfleet.pool.config import build_pool, load_config
from rollfleet.pool.leases import Lease, PoolRegistry, _check_lease_s
from rollfleet.pool.pool import Pool
from rollfleet.store.pool_leases import PoolLeaseTable
from rollfleet.store.sql_store import SqlStore

log = logging.getLogger("rollfleet.pool")

SWEEP_S = 1.0


def replica_id() -> str:
    """A name for this replica process, unique across restarts: host, pid, random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _lease(row: dict[str, Any]) -> Lease:
    return Lease.model_validate({k: row[k] for k in Lease.model_fields})


class SharedPoolRegistry(PoolRegistry):
    """Named pools whose leases are rows in the store, honoured by every replica."""

    def __init__(
        self,
        store: SqlStore,
        pools: Iterable[tuple[Pool, float]] = (),
        *,
        owner: str | None = None,
        sweep_s: float = SWEEP_S,
    ) -> None:
        super().__init__(pools)
        self.owner = owner or replica_id()
        self._table = PoolLeaseTable(store)
        self._sweep_s = sweep_s
        self._local: dict[str, Instance] = {}  # leases granted here whose instance is held

    async def acquire(
        self,
        pool_name: str,
        *,
        attempt_id: str | None = None,
        timeout: float | None = None,
        lease_s: float | None = None,
    ) -> Lease:
        """Wait for an instance of ``pool_name`` and record its lease in the store."""
        lease, instance = await self._grant(pool_name, attempt_id, timeout, lease_s)
        try:
            await self._table.insert(lease.model_dump(), self.owner)
        except BaseException:
            await self.pool(pool_name).release(instance, reason="lease not recorded")
            raise
        self._local[lease.lease_id] = instance
        return lease

    async def renew_lease(self, lease_id: str, lease_s: float | None = None) -> Lease:
        """Extend a live lease, whichever replica granted it; Conflict once it has ended."""
        seconds = None if lease_s is None else _check_lease_s(lease_s)
        return _lease(await self._table.renew(lease_id, seconds))

    async def held_leases(self, pool_name: str | None = None) -> list[Lease]:
        """Leases held now through any replica, oldest first."""
        return [_lease(row) for row in await self._table.held(pool_name)]

    async def release(self, lease_id: str, *, broken: bool = False, reason: str = "") -> None:
        """End a lease, whichever replica granted it; its owner resets or replaces the instance."""
        why = "released" + (f" as broken: {reason}" if broken else "")
        row = await self._table.end(lease_id, why, broken)
        if row["owner"] == self.owner:
            await self._settle(row)

    def renew(self, lease_id: str, lease_s: float | None = None) -> Lease:
        """Not here: a shared registry renews in the store, ``await renew_lease(…)``."""
        raise InvalidInput("a shared pool registry renews through `await renew_lease(...)`")

    def leases(self, pool_name: str | None = None) -> list[Lease]:
        """Not here: a shared registry reads the store, ``await held_leases(…)``."""
        raise InvalidInput("a shared pool registry lists leases through `await held_leases(...)`")

    async def expire_due(self) -> list[Lease]:
        """End every lapsed lease (any replica's), settle this replica's ended ones; return the
        expired."""
        expired = await self._table.expire_due()
        for row in expired:
            log.warning(
                "lease %s: attempt %s did not renew; expired", row["lease_id"], row["attempt_id"]
            )
        for row in await self._table.unsettled(self.owner):
            await self._settle(row)
        return [_lease(row) for row in expired]

    async def _settle(self, row: dict[str, Any]) -> None:
        instance = self._local.pop(row["lease_id"], None)
        if instance is not None:
            pool = self.pool(row["pool"])
            await pool.release(instance, broken=bool(row["broken"]), reason=row["ended"])
        await self._table.settle(row["lease_id"])

    async def _reap_forever(self) -> None:
        """Sweep the lease table every ``sweep_s``; a failing sweep is logged and retried."""
        while True:
            try:
                await self.expire_due()
            except Exception:  # the store may be briefly unreachable: the next sweep catches up
                log.exception("pool lease sweep failed")
            await asyncio.sleep(self._sweep_s)


def load_shared_registry(path: str | Path, store: SqlStore) -> SharedPoolRegistry:
    """Every pool of a config file in a registry whose leases live in ``store`` (not started)."""
    config = load_config(path)
    return SharedPoolRegistry(
        store, ((build_pool(name, spec), spec.lease_s) for name, spec in config.pools.items())
    )
