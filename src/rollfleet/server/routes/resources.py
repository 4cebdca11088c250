"""Resources: store a new version of what agents use, read the newest."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from rollfleet.server import schemas as s
from rollfleet.server.routes.common import as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The resource routes over ``store``, declared on ``r``."""

    @r.post("/resources")
    async def add_resources(body: s.AddResources) -> Response:
        return as_json(await store.add_resources(body.values, body.resources_id))

    @r.get("/resources/latest")
    async def latest_resources() -> Response:
        return as_json(await store.get_latest_resources())

    return r
