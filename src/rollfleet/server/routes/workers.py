"""Workers: register, update status, heartbeat with their attempts, query."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from rollfleet.server import schemas as s
from rollfleet.server.routes.common import PageLimit, as_json
from rollfleet.store.base import Store


def routes(store: Store, r: APIRouter) -> APIRouter:
    """The worker routes over ``store``, declared on ``r``."""

    @r.post("/workers")
    async def register_worker(body: s.RegisterWorker) -> Response:
        return as_json(await store.register_worker(body.worker_id, body.metadata, body.lease_s))

    @r.patch("/workers/{worker_id}")
    async def update_worker(worker_id: str, body: s.UpdateWorker) -> Response:
        return as_json(await store.update_worker(worker_id, body.status))

    @r.post("/workers/{worker_id}/heartbeat")
    async def heartbeat_many(worker_id: str, body: s.HeartbeatMany) -> Response:
        return as_json(await store.heartbeat_many(body.attempt_ids, worker_id))

    @r.get("/workers")
    async def query_workers(cursor: str | None = None, limit: PageLimit = 100) -> Response:
        return as_json(await store.query_workers(cursor, limit))

    return r
