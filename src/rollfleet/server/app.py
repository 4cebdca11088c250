"""The control plane's HTTP API: FastAPI over any Store, JSON errors, bearer-token auth.

Every store method has one route (:mod:`rollfleet.server.routes`, one module per noun); responses
are the model records as JSON. Errors are ``{"error": <class>, "message": …}`` with 404 (unknown
id), 409 (illegal transition or fenced write), 422 (bad payload) and never a 500 for a caller's
mistake.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from rollfleet.errors import RollfleetError
from rollfleet.server.routes import LeanRoutes, describe, hot_routes, store_router
from rollfleet.store.base import Store
from rollfleet.web.errors import ERROR_RESPONSES, error_body, error_response
from rollfleet.web.guard import GUARD, GuardConfig, RequestGuard
from rollfleet.web.jsonbody import check_json_body
from rollfleet.web.serving import bearer_check

log = logging.getLogger("rollfleet.server")

Hook = Callable[[], Awaitable[None]]  # run as the app starts or stops
Middleware = tuple[Any, dict[str, Any]]  # an ASGI middleware class and its options


class ControlPlane(FastAPI):
    """FastAPI with the request guard and the lean hot routes in front of its whole stack.

    FastAPI wraps every request in its own layers (the 500 handler, exception telemetry, a body
    limit, a telemetry check per request) before any user middleware: for the hot calls, which
    need none of them, they were ~4% of the server's CPU per one-at-a-time handover (a py-spy
    profile, issue 34).
    Every HTTP request passes the guard first, then the lean routes, then FastAPI as before.
    """

    front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve an HTTP request through the front; anything else (lifespan) as FastAPI does."""
        if scope["type"] == "http" and self.front is not None:
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def behind(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's own handling of a request the front passed on."""
        await super().__call__(scope, receive, send)


def create_app(
    store: Store,
    *,
    token: str | None = None,
    routers: Sequence[tuple[str, APIRouter]] = (),
    checked_routers: Sequence[tuple[str, APIRouter]] = (),
    reaper_interval_s: float | None = 1.0,
    on_startup: Sequence[Hook] = (),
    on_shutdown: Sequence[Hook] = (),
    guard: GuardConfig = GUARD,
    middleware: Sequence[Middleware] = (),
) -> FastAPI:
    """Build the control plane app over ``store``; extra routers mount under their prefixes,
    behind the token (``routers``) or checking their own callers (``checked_routers``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if reaper_interval_s is not None:
            store.start_reaper(reaper_interval_s)
        for hook in on_startup:
            await hook()
        log.info("control plane started")
        yield
        for hook in on_shutdown:
            await hook()
        await store.close()
        log.info("control plane stopped")

    app = ControlPlane(
        title="rollfleet",
        version="0.1.0",
        lifespan=lifespan,
        description="Durable rollouts for LLM agents: the store, workers, batches, pools, engines.",
    )
    app.state.store = store
    check = bearer_check(token)
    auth = [Depends(check), Depends(check_json_body)]

    @app.exception_handler(RollfleetError)
    async def rollfleet_error(_: Request, exc: RollfleetError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown path or method answers in the API's one error shape too
        name = {404: "NotFound", 401: "Unauthorized", 409: "Conflict"}.get(exc.status_code)
        return error_body(name or "InvalidInput", str(exc.detail), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_body("InvalidInput", describe(exc.errors()), 422)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    hot = hot_routes(store)
    app.include_router(store_router(store, hot), dependencies=auth, responses=ERROR_RESPONSES)
    for cls, options in middleware:  # inside the hot routes and the guard
        app.add_middleware(cls, **options)
    # outermost the guard, then the hot routes, then FastAPI's stack
    app.front = RequestGuard(LeanRoutes(app.behind, routes=hot, check=check), config=guard)
    for prefix, router in routers:
        app.include_router(router, prefix=prefix, dependencies=auth, responses=ERROR_RESPONSES)
    for prefix, router in checked_routers:
        app.include_router(router, prefix=prefix, responses=ERROR_RESPONSES)
    return app
