"""Component state: JSON values under keys (batches and other components' records)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from rollfleet.server import schemas as s
from rollfleet.server.routes.common import as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The state routes over ``store``, declared on ``r``."""

    @r.put("/state/{key:path}")
    async def put_state(key: str, body: s.PutState) -> Response:
        await store.put_state(key, body.value)
        return as_json({"key": key})

    @r.get("/state/{key:path}")
    async def get_state(key: str, prefix: bool = False) -> Response:
        if prefix:
            return as_json(await store.scan_state(key))
        return as_json({"key": key, "value": await store.get_state(key)})

    return r
