"""Attempts: heartbeat, complete, release (give back), query.

Claiming and completing (one or many) are hot calls (:mod:`rollfleet.server.routes.hot`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from rollfleet.model import AttemptStatus
from rollfleet.server import schemas as s
from rollfleet.server.routes.common import PageLimit, as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The attempt routes over ``store``, declared on ``r``."""

    @r.post("/attempts/{attempt_id}/heartbeat")
    async def heartbeat(attempt_id: str) -> Response:
        return as_json(await store.heartbeat(attempt_id))

    @r.post("/attempts/{attempt_id}/release")
    async def release(attempt_id: str, body: s.ReleaseRequest) -> Response:
        return as_json(await store.release(attempt_id, body.reason))

    @r.get("/attempts")
    async def query_attempts(
        rollout_id: str | None = None,
        worker_id: str | None = None,
        status: Annotated[list[AttemptStatus] | None, Query()] = None,
        cursor: str | None = None,
        limit: PageLimit = 100,
    ) -> Response:
        return as_json(await store.query_attempts(rollout_id, worker_id, status, cursor, limit))

    return r
