"""RemotePool: lease instances from a pool served over HTTP (same ``lease()`` as a local Pool).

``async with remote.lease(attempt_id=...) as instance:`` acquires, renews the lease in the
background while the body runs, and releases it afterwards whatever happens. Given several
control-plane replicas, a call that cannot reach one goes to the next: their leases live in the
shared store, so a renewal or release through any of them is honoured (an acquire whose answer was
lost leaves a lease that nobody renews, so it expires). If a renewal
is refused (the lease expired: the instance may already belong to someone else) the body
is cancelled and the ``async with`` raises :class:`~rollfleet.errors.PoolError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from rollfleet.errors import Conflict, InvalidInput, PoolError, RollfleetError
from rollfleet.pool.base import Instance, PoolStats
from rollfleet.pool.leases import Lease
from rollfleet.web.errors import error_from_answer
from rollfleet.web.serving import segment

log = logging.getLogger("rollfleet.pool")


def _raise_for(response: httpx.Response) -> None:
    """Turn an error response into the rollfleet error the server raised."""
    if not response.is_success:
        raise error_from_answer(
            response.status_code,
            response.content,
            default=PoolError,
            where=str(response.request.url),
        )


class RemotePool:
    """A client for one pool of a pool service (``…/pools``), with background lease renewal."""

    def __init__(
        self,
        url: str,
        pool: str,
        *,
        token: str | None = None,
        lease_s: float = 60.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        """``url``: the service's pools root, e.g. ``http://127.0.0.1:8000/pools``; several
        (comma-separated: control-plane replicas over one database) are failed over between."""
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        if not self.urls:
            raise InvalidInput("RemotePool: no pool service URL given")
        self.url = self.urls[0]
        self._current = 0
        self.name = pool
        self.lease_s = lease_s
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30.0))

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout: float | None | object = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        last: httpx.HTTPError | None = None
        for _ in self.urls:  # a replica that cannot be reached hands over to the next
            url = f"{self.urls[self._current]}/{self.name}{path}"
            try:
                response = await self._client.request(method, url, json=json, timeout=timeout)  # type: ignore[arg-type]
            except httpx.HTTPError as exc:
                last = exc
                self._current = (self._current + 1) % len(self.urls)
                continue
            _raise_for(response)
            return response
        raise PoolError(f"pool service at {url} cannot be reached: {last!r}") from last

    async def acquire(
        self,
        timeout: float | None = None,
        *,
        attempt_id: str | None = None,
        lease_s: float | None = None,
    ) -> Instance:
        """Wait (FIFO, server side) for an instance; PoolTimeout after ``timeout`` seconds."""
        body = {"attempt_id": attempt_id, "timeout_s": timeout, "lease_s": lease_s or self.lease_s}
        read = None if timeout is None else timeout + 30.0
        response = await self._call(
            "POST", "/leases", json=body, timeout=httpx.Timeout(30.0, read=read)
        )
        return Lease.model_validate(response.json()).instance()

    async def renew(self, instance: Instance, lease_s: float | None = None) -> Instance:
        """Extend the lease; Conflict when it has already expired."""
        response = await self._call(
            "POST",
            f"/leases/{segment(instance.lease_id or '-')}/renew",
            json={"lease_s": lease_s or self.lease_s},
        )
        return Lease.model_validate(response.json()).instance()

    async def release(self, instance: Instance, *, broken: bool = False, reason: str = "") -> None:
        """End the lease; the server resets (or replaces, if ``broken``) the instance."""
        await self._call(
            "POST",
            f"/leases/{segment(instance.lease_id or '-')}/release",
            json={"broken": broken, "reason": reason},
        )

    async def stats(self) -> PoolStats:
        """The pool's stats."""
        return PoolStats.model_validate((await self._call("GET", "")).json())

    @asynccontextmanager
    async def lease(
        self, *, attempt_id: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[Instance]:
        """Hold an instance for the body, renewing in the background; release it afterwards."""
        instance = await self.acquire(timeout, attempt_id=attempt_id)
        holder = asyncio.current_task()
        lost: list[RollfleetError] = []
        renewer = asyncio.create_task(
            self._keep(instance, holder, lost), name=f"renew {instance.lease_id}"
        )
        try:
            yield instance
        except asyncio.CancelledError:
            if not lost:
                raise
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            if not lost:
                await asyncio.shield(self._release_quietly(instance))
        if lost:  # we cancelled the body (or it finished just as the lease was refused)
            if holder is not None and holder.cancelling() and holder.uncancel() > 0:
                raise asyncio.CancelledError()
            raise PoolError(
                f"lease {instance.lease_id} on {instance.instance_id} was lost: {lost[0].message}"
            ) from lost[0]

    async def _keep(
        self, instance: Instance, holder: asyncio.Task[Any] | None, lost: list[RollfleetError]
    ) -> None:
        """Renew every third of the lease; cancel the holder if the lease is refused."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.renew(instance)
            except Conflict as exc:
                lost.append(exc)
                log.error("lease %s lost: %s", instance.lease_id, exc.message)
                if holder is not None:
                    holder.cancel()
                return
            except PoolError as exc:  # transient: keep trying until the server says it is gone
                log.warning("renewing lease %s failed: %s", instance.lease_id, exc.message)

    async def _release_quietly(self, instance: Instance) -> None:
        try:
            await self.release(instance)
        except RollfleetError as exc:
            log.warning("releasing lease %s failed: %s", instance.lease_id, exc.message)

    async def close(self) -> None:
        """Close the HTTP client (if this object made it)."""
        if self._own_client:
            await self._client.aclose()

    async def __aenter__(self) -> RemotePool:
        """Nothing to start."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the client."""
        await self.close()


async def fetch_pool_stats(url: str, *, token: str | None = None) -> list[PoolStats]:
    """Every pool's stats from a ``/pools`` root (``rollfleet status``); [] if none is hosted."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as client:
        try:
            response = await client.get(url.rstrip("/"))
        except httpx.HTTPError as exc:
            raise PoolError(f"pool service at {url} cannot be reached: {exc!r}") from exc
        if response.status_code == 404:
            return []  # a control plane that hosts no pools: the /pools root is not mounted
        _raise_for(response)
        return [PoolStats.model_validate(item) for item in response.json()]
