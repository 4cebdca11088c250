"""Trajectory steps: append to an attempt, read a rollout's in order; the images they reference."""

from __future__ import annotations

import base64

from fastapi import APIRouter
from fastapi.responses import Response

from rollfleet.server import schemas as s
from rollfleet.server.routes.common import PageLimit, as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The step routes over ``store``, declared on ``r``."""

    @r.post("/attempts/{attempt_id}/steps")
    async def add_steps(attempt_id: str, body: s.AddSteps) -> Response:
        return as_json({"added": await store.add_steps(attempt_id, body.steps)})

    @r.get("/rollouts/{rollout_id}/steps")
    async def query_steps(
        rollout_id: str,
        attempt_id: str | None = None,
        cursor: str | None = None,
        limit: PageLimit = 500,
    ) -> Response:
        await store.get_rollout(rollout_id)  # 404 for an unknown rollout
        return as_json(await store.query_steps(rollout_id, attempt_id, cursor, limit))

    @r.get("/blobs/{sha256}")
    async def get_blob(sha256: str) -> Response:
        blob = await store.get_blob(sha256)
        data = base64.b64encode(blob.data).decode()
        return as_json({"sha256": blob.sha256, "media_type": blob.media_type, "data": data})

    @r.post("/rollouts/steps")
    async def query_steps_many(body: s.StepsQuery) -> Response:
        return as_json(await store.query_steps_many(body.rollout_ids, body.cursor, body.limit))

    return r
