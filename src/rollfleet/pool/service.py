"""HTTP API for pools: leases, renewals, releases and stats, as a FastAPI router.

The control plane mounts :func:`pool_router` under ``/pools`` with its own auth;
``rollfleet pool serve`` wraps the same router in :func:`pool_app`. Errors come back as
``{"error": <class name in rollfleet.errors>, "message": …}`` (the control plane's error
shape) so the client can raise the same class. Pools start on the first request at the
latest; a host that can should ``await registry.start()`` at startup so VMs boot early.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from rollfleet.errors import InvalidInput, PoolError, PoolTimeout, RollfleetError
from rollfleet.pool.base import PoolStats, Report
from rollfleet.pool.leases import Lease, PoolRegistry
from rollfleet.web.errors import ERROR_RESPONSES
from rollfleet.web.errors import error_response as web_error_response
from rollfleet.web.guard import GUARD, GuardConfig, RequestGuard
from rollfleet.web.jsonbody import check_json_body
from rollfleet.web.serving import bearer_check

T = TypeVar("T")

STATUS = {PoolTimeout: 504, PoolError: 503}


class AcquireBody(Report):
    """POST /{pool}/leases: who wants an instance, how long to wait, how long to hold."""

    attempt_id: str | None = None
    timeout_s: float | None = Field(default=None, ge=0)
    lease_s: float | None = Field(default=None, gt=0)


class RenewBody(Report):
    """POST /{pool}/leases/{lease_id}/renew."""

    lease_s: float | None = Field(default=None, gt=0)


class ReleaseBody(Report):
    """POST /{pool}/leases/{lease_id}/release: ``broken`` replaces the instance, not resets it."""

    broken: bool = False
    reason: str = ""


def error_response(exc: RollfleetError) -> JSONResponse:
    """The JSON error body and status for a rollfleet error (pool timeouts 504, pool errors 503)."""
    status = next((code for cls, code in STATUS.items() if isinstance(exc, cls)), None)
    return web_error_response(exc, status)


async def _unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T:
    """Run ``work``, cancelling it if the client goes away (a dead waiter must not be served)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _answers_errors(endpoint: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap an endpoint so rollfleet errors become their JSON error responses."""

    @functools.wraps(endpoint)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await endpoint(*args, **kwargs)
        except RollfleetError as exc:
            return error_response(exc)

    return wrapper


def pool_router(registry: PoolRegistry) -> APIRouter:
    """Routes serving ``registry``'s pools; mount under ``/pools``."""

    async def started() -> None:
        await registry.start()

    router = APIRouter(tags=["pools"], dependencies=[Depends(started), Depends(check_json_body)])

    @router.get("", response_model=list[PoolStats])
    async def list_pools() -> list[PoolStats]:
        """Every pool's stats."""
        return registry.stats()

    @router.get("/{name}", response_model=PoolStats)
    @_answers_errors
    async def pool_stats(name: str) -> PoolStats:
        """One pool's stats."""
        return registry.pool(name).stats()

    @router.get("/{name}/leases", response_model=list[Lease])
    @_answers_errors
    async def list_leases(name: str) -> list[Lease]:
        """Leases held now on one pool."""
        registry.pool(name)
        return await registry.held_leases(name)

    @router.post("/{name}/leases", response_model=Lease)
    @_answers_errors
    async def acquire(name: str, body: AcquireBody, request: Request) -> Lease:
        """Wait (first come, first served) for an instance and lease it."""
        work = registry.acquire(
            name, attempt_id=body.attempt_id, timeout=body.timeout_s, lease_s=body.lease_s
        )
        return await _unless_disconnected(request, work)

    @router.post("/{name}/leases/{lease_id}/renew", response_model=Lease)
    @_answers_errors
    async def renew(name: str, lease_id: str, body: RenewBody) -> Lease:
        """Extend a lease; 409 once it has expired (the instance may be someone else's now)."""
        return await registry.renew_lease(lease_id, body.lease_s)

    @router.post("/{name}/leases/{lease_id}/release", status_code=204, response_model=None)
    @_answers_errors
    async def release(name: str, lease_id: str, body: ReleaseBody) -> Response:
        """End a lease; the instance is reset (or replaced) in the background."""
        await registry.release(lease_id, broken=body.broken, reason=body.reason)
        return Response(status_code=204)

    return router


def pool_app(
    registry: PoolRegistry, *, token: str | None = None, guard: GuardConfig = GUARD
) -> FastAPI:
    """A standalone app serving ``registry`` under ``/pools`` (``rollfleet pool serve``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with registry:
            yield

    app = FastAPI(title="rollfleet pools", lifespan=lifespan)

    @app.exception_handler(RollfleetError)
    async def rollfleet_error(request: Request, exc: RollfleetError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(InvalidInput(where))

    app.include_router(
        pool_router(registry),
        prefix="/pools",
        dependencies=[Depends(bearer_check(token, "pool service"))],
        responses=ERROR_RESPONSES,
    )
    app.add_middleware(RequestGuard, config=guard)
    return app
