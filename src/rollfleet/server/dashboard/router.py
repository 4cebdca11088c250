"""The dashboard's routes: a public page shell and assets, and data routes behind the API's auth.

The shell (``/``) and its assets hold no data, so they are plain Starlette routes: FastAPI applies
an ``include_router(..., dependencies=[bearer])`` dependency only to path operations, which keeps
them loadable without a token so the page can ask for one. Every data route, the event stream
included, is a path operation and gets the server's bearer check. The browser sends the token as
an ``Authorization`` header on every fetch, the event stream too (read with ``fetch``, not
``EventSource``, which cannot send headers), so no token ever travels in a URL.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.routing import Route

from rollfleet.errors import InvalidInput, NotFound
from rollfleet.model import RESUME_STEP, Attempt, RolloutStatus
from rollfleet.server.dashboard import views
from rollfleet.server.dashboard.live import (
    EXTRA_SECTIONS,
    LiveHub,
    call_provider,
    load_history,
    sse,
)
from rollfleet.server.routes.common import as_json
from rollfleet.store.base import Store
from rollfleet.web.jsonbody import strict_json

log = logging.getLogger("rollfleet.dashboard")

KEEPALIVE_S = 15.0
MEDIA_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".html": "text/html",
    ".svg": "image/svg+xml",
}
ASSET_PREFIX = "/dashboard/assets/"
MAX_ATTEMPTS = 1000  # attempts a rollout's page lists
RESUME_SCAN = 200  # steps of a later attempt read to find its resume step (before its first turn)


def _read_assets() -> dict[str, bytes]:
    """Every file under ``static/``, keyed by its path relative to it."""
    found: dict[str, bytes] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.rsplit(".", 1)[-1] in ("js", "css", "html", "svg"):
                found[prefix + child.name] = child.read_bytes()

    walk(resources.files("rollfleet.server.dashboard") / "static", "")
    return found


class Assets:
    """The shipped page and assets, read once; served with a content hash as their ETag."""

    def __init__(self) -> None:
        self.files = _read_assets()
        everything = b"".join(self.files[k] for k in sorted(self.files))
        self.version = hashlib.sha256(everything).hexdigest()[:12]
        modules = sorted(k for k in self.files if k.startswith("js/") and k != "js/app.js")
        preload = "".join(f'<link rel="modulepreload" href="{ASSET_PREFIX}{m}">' for m in modules)
        index = self.files["index.html"].replace(b"{{preload}}", preload.encode())
        self.index = index.replace(b"{{version}}", self.version.encode())

    def response(self, name: str, request: Request) -> Response:
        """The asset's bytes, or 304 when the browser has this version already."""
        body = self.index if name == "index.html" else self.files.get(name)
        if body is None:
            return Response(b"not found", status_code=404, media_type="text/plain")
        etag = f'"{self.version}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"etag": etag})
        media = MEDIA_TYPES.get("." + name.rsplit(".", 1)[-1], "application/octet-stream")
        cache = "no-cache"  # revalidate by ETag: module imports carry no version
        return Response(body, media_type=media, headers={"etag": etag, "cache-control": cache})


def dashboard_router(store: Store, extras: Mapping[str, Any] | None = None) -> APIRouter:
    """The dashboard: the page at ``/``, its data under ``/dashboard/api``, live events by SSE.

    ``extras`` maps ``batches``, ``pools``, ``engines`` to (async) callables returning JSON-able
    lists, and ``abort_batch`` to an (async) ``fn(batch_id, reason)``; missing ones show as
    "none configured".
    """
    extras = dict(extras or {})
    unknown = set(extras) - {*EXTRA_SECTIONS, "abort_batch"}
    if unknown:
        raise InvalidInput(f"dashboard extras: unknown keys {sorted(unknown)}")
    assets = Assets()
    hub = LiveHub(store, extras)
    r = APIRouter()

    async def shell(request: Request) -> Response:
        return assets.response("index.html", request)

    async def asset(request: Request) -> Response:
        return assets.response(request.path_params["name"], request)

    r.routes.append(Route("/", shell, methods=["GET"], include_in_schema=False))
    r.routes.append(
        Route(ASSET_PREFIX + "{name:path}", asset, methods=["GET"], include_in_schema=False)
    )
    _data_routes(r, store, extras, hub)
    return r


def _data_routes(r: APIRouter, store: Store, extras: dict[str, Any], hub: LiveHub) -> None:
    @r.get("/dashboard/api/rollouts", include_in_schema=False)
    async def rollouts(
        status: RolloutStatus | None = None,
        mode: str | None = None,
        batch_id: str | None = None,
        worker_id: str | None = None,
        search: str | None = None,
        cursor: str | None = None,
        limit: int = Query(50, ge=1, le=500),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ) -> Response:
        page = await store.query_rollouts(
            status=status,
            mode=mode or None,
            batch_id=batch_id or None,
            worker_id=worker_id or None,
            search=search or None,
            cursor=cursor or None,
            limit=limit,
            order=order,
        )
        return as_json(
            {"items": [views.rollout_row(x) for x in page.items], "next_cursor": page.next_cursor}
        )

    @r.get("/dashboard/api/rollouts/{rollout_id}/attempts", include_in_schema=False)
    async def rollout_attempts(rollout_id: str) -> Response:
        await store.get_rollout(rollout_id)  # NotFound: 404
        attempts = (await store.query_attempts(rollout_id, limit=MAX_ATTEMPTS)).items
        rows = [views.attempt_row(a, await _resume_of(store, a)) for a in attempts]
        return as_json({"items": rows})

    @r.get("/dashboard/api/overview", include_in_schema=False)
    async def overview() -> Response:
        now = time.time()
        history = hub.history if hub.running and hub.history else await load_history(store, now)
        stats = views.stats_view(await store.statistics())
        return as_json({"stats": stats, "series": history.series(now), "server_time": now})

    @r.get("/dashboard/api/extras/{name}", include_in_schema=False)
    async def extra(name: str) -> Response:
        if name not in EXTRA_SECTIONS:
            raise NotFound(f"no dashboard section {name!r}")
        if name not in extras:
            return as_json({"configured": False, "items": None})
        return as_json({"configured": True, "items": await call_provider(extras[name])})

    @r.post("/dashboard/api/batches/{batch_id}/abort", include_in_schema=False)
    async def abort_batch(batch_id: str, request: Request) -> Response:
        fn = extras.get("abort_batch")
        if fn is None:
            raise NotFound("aborting batches is not configured on this server")
        raw = await request.body()
        body = strict_json(raw) if raw.strip() else {}
        if not isinstance(body, dict) or not isinstance(body.get("reason") or "", str):
            raise InvalidInput('body: expected {"reason": "<text>"} or nothing')
        reason = (body.get("reason") or "aborted from the dashboard")[:2000]  # the API's cap
        log.info("dashboard: abort batch %s (%s)", batch_id, reason)
        return as_json(
            {"batch_id": batch_id, "result": await call_provider(lambda: fn(batch_id, reason))}
        )

    @r.get("/dashboard/api/events", include_in_schema=False)
    async def events() -> StreamingResponse:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(_stream(hub), media_type="text/event-stream", headers=headers)


async def _resume_of(store: Store, attempt: Attempt) -> dict[str, Any] | None:
    """The payload of the ``resume`` step a later attempt recorded before its first turn (None for
    a first attempt, or one whose agent recorded none among its first steps)."""
    if attempt.sequence <= 1:
        return None
    steps = await store.query_steps(attempt.rollout_id, attempt.attempt_id, limit=RESUME_SCAN)
    return next((s.payload for s in steps.items if s.kind == RESUME_STEP), None)


async def _stream(hub: LiveHub) -> AsyncIterator[bytes]:
    """The event stream of one viewer: a snapshot, then updates, with keep-alive comments."""
    async with hub.subscribe() as sub:
        yield sse("snapshot", hub.snapshot())
        while True:
            try:
                frame = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if frame is None:
                return
            if sub.stale:  # it fell behind: send the whole state again instead of the backlog
                sub.stale = False
                frame = sse("snapshot", hub.snapshot())
            yield frame
