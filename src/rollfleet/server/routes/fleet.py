"""The operator's calls on the whole queue: statistics, and reaping lapsed leases now."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from rollfleet.server.routes.common import as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The statistics and reap routes over ``store``, declared on ``r``."""

    @r.get("/statistics")
    async def statistics() -> Response:
        return as_json(await store.statistics())

    @r.post("/reap")
    async def reap() -> Response:
        return as_json(await store.reap())

    return r
