"""Rollouts: enqueue one, start one already leased, requeue, wait, query, read, cancel.

Enqueueing many is a hot call (:mod:`rollfleet.server.routes.hot`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response

from rollfleet.model import RolloutSpec, RolloutStatus
from rollfleet.server import schemas as s
from rollfleet.server.routes.common import PageLimit, as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The rollout routes over ``store``, declared on ``r``."""

    @r.post("/rollouts")
    async def enqueue(spec: RolloutSpec) -> Response:
        return as_json((await store.enqueue_many([spec]))[0])

    @r.post("/rollouts/start")
    async def start(body: s.StartRollout) -> Response:
        fields = body.model_dump(exclude={"input", "mode", "worker_id"})
        return as_json(await store.start_rollout(body.input, body.mode, body.worker_id, **fields))

    @r.post("/rollouts/requeue")
    async def requeue(body: s.RequeueRequest) -> Response:
        ids = await store.requeue(body.statuses, body.rollout_ids, body.older_than_s)
        return as_json({"rollout_ids": ids})

    @r.post("/rollouts/wait")
    async def wait(body: s.WaitRequest) -> Response:
        return as_json(await store.wait_for_rollouts(body.rollout_ids, body.timeout))

    @r.get("/rollouts")
    async def query_rollouts(
        status: Annotated[list[RolloutStatus] | None, Query()] = None,
        mode: str | None = None,
        batch_id: str | None = None,
        group_id: str | None = None,
        worker_id: str | None = None,
        search: str | None = None,
        cursor: str | None = None,
        limit: PageLimit = 100,
        order: Literal["asc", "desc"] = "asc",
    ) -> Response:
        page = await store.query_rollouts(
            status=status,
            mode=mode,
            batch_id=batch_id,
            group_id=group_id,
            worker_id=worker_id,
            search=search,
            cursor=cursor,
            limit=limit,
            order=order,
        )
        return as_json(page)

    @r.get("/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str) -> Response:
        return as_json(await store.get_rollout(rollout_id))

    @r.post("/rollouts/{rollout_id}/cancel")
    async def cancel(rollout_id: str) -> Response:
        return as_json(await store.cancel(rollout_id))

    return r
