"""The control plane's HTTP API: FastAPI over any Store, JSON errors, bearer-token auth.

Every store method has one route; responses are the model records as JSON. Errors are
``{"error": <class>, "message": …}`` with 404 (unknown id), 409 (illegal transition or fenced
write), 422 (bad payload) and never a 500 for a caller's mistake.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from rollfleet.errors import RollfleetError
from rollfleet.model import AttemptStatus, RolloutStatus, adapter
from rollfleet.server import schemas as s
from rollfleet.store.base import Store
from rollfleet.web.errors import error_body, error_response
from rollfleet.web.serving import bearer_check

log = logging.getLogger("rollfleet.server")


def as_json(value: Any) -> Response:
    """Serialise records, pages, lists of records or plain JSON into a response."""
    if isinstance(value, BaseModel):
        return Response(value.model_dump_json(), media_type="application/json")
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        # one call for the whole list: half the time of one model_dump_json per record
        return Response(adapter(list[type(value[0])]).dump_json(value), media_type="application/json")  # type: ignore[misc]
    return Response(orjson.dumps(value), media_type="application/json")


Handler = Callable[[Any, Request], Awaitable[Response]]


def hot_calls(store: Store) -> dict[str, tuple[type[BaseModel], Handler]]:
    """The calls on the path of every rollout (enqueue, claim, complete), by path: body model and handler.

    They are served twice over: by :class:`LeanRoutes`, ahead of FastAPI, and by ordinary FastAPI
    routes that only document them in the OpenAPI schema.
    """

    async def claim(body: s.ClaimRequest, request: Request) -> Response:
        # a client that hung up during the long-poll gets nothing leased to it; the documents go out
        # as they are: building Rollout records only to serialise them was ~20% of the server's time
        docs = await store.claim_documents(body.worker_id, body.wait_s, body.max_n, abandoned=request.is_disconnected)
        return Response(orjson.dumps(docs), media_type="application/json")

    async def enqueue_many(body: s.EnqueueMany, _request: Request) -> Response:
        return as_json(await store.enqueue_many(body.items))

    async def complete_many(body: s.CompleteMany, _request: Request) -> Response:
        return as_json(await store.complete_many(body.items))

    return {"/rollouts/batch": (s.EnqueueMany, enqueue_many), "/claims": (s.ClaimRequest, claim),
            "/attempts/complete": (s.CompleteMany, complete_many)}


class LeanRoutes:
    """ASGI middleware that serves the hot calls (:func:`hot_calls`) ahead of FastAPI's whole stack.

    FastAPI's per-request machinery (its middlewares, dependency solving, a linear match over
    every route) costs several hundred µs a request on the 2-core CI machine: as much as the
    store's own work for a batch. Auth, body validation and the error shapes stay the same.
    """

    def __init__(self, app: ASGIApp, routes: dict[str, tuple[type[BaseModel], Handler]],
                 check: Callable[[Request], Awaitable[None]]) -> None:
        self.app = app
        self.routes = routes
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a lean route, or pass the request on to FastAPI."""
        entry = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if entry is None:
            await self.app(scope, receive, send)
            return
        model, handler = entry
        request = Request(scope, receive)
        try:
            await self.check(request)
            response = await handler(model.model_validate_json(await request.body()), request)
        except RollfleetError as exc:
            response = error_response(exc)
        except ValidationError as exc:
            response = error_body("InvalidInput", _describe(exc.errors()), 422)
        await response(scope, receive, send)


def store_router(store: Store) -> APIRouter:
    """Routes for every Store operation."""
    r = APIRouter()
    calls = hot_calls(store)

    @r.post("/rollouts")
    async def enqueue(spec: s.RolloutSpec) -> Response:
        return as_json((await store.enqueue_many([spec]))[0])

    @r.post("/rollouts/batch")
    async def enqueue_many(body: s.EnqueueMany, request: Request) -> Response:
        return await calls["/rollouts/batch"][1](body, request)

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
        status: list[RolloutStatus] | None = Query(None), mode: str | None = None, batch_id: str | None = None,
        group_id: str | None = None, worker_id: str | None = None, search: str | None = None,
        cursor: str | None = None, limit: int = Query(100, ge=1, le=1000), order: str = Query("asc"),
    ) -> Response:
        page = await store.query_rollouts(status=status, mode=mode, batch_id=batch_id, group_id=group_id,
                                          worker_id=worker_id, search=search, cursor=cursor, limit=limit,
                                          order=order)
        return as_json(page)

    @r.get("/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str) -> Response:
        return as_json(await store.get_rollout(rollout_id))

    @r.post("/rollouts/{rollout_id}/cancel")
    async def cancel(rollout_id: str) -> Response:
        return as_json(await store.cancel(rollout_id))

    @r.get("/rollouts/{rollout_id}/steps")
    async def query_steps(rollout_id: str, attempt_id: str | None = None, cursor: str | None = None,
                          limit: int = Query(500, ge=1, le=1000)) -> Response:
        await store.get_rollout(rollout_id)  # 404 for an unknown rollout
        return as_json(await store.query_steps(rollout_id, attempt_id, cursor, limit))

    @r.post("/rollouts/steps")
    async def query_steps_many(body: s.StepsQuery) -> Response:
        return as_json(await store.query_steps_many(body.rollout_ids, body.cursor, body.limit))

    @r.post("/claims")
    async def claim(body: s.ClaimRequest, request: Request) -> Response:
        return await calls["/claims"][1](body, request)

    @r.post("/attempts/{attempt_id}/heartbeat")
    async def heartbeat(attempt_id: str) -> Response:
        return as_json(await store.heartbeat(attempt_id))

    @r.post("/attempts/{attempt_id}/steps")
    async def add_steps(attempt_id: str, body: s.AddSteps) -> Response:
        return as_json({"added": await store.add_steps(attempt_id, body.steps)})

    @r.post("/attempts/{attempt_id}/complete")
    async def complete(attempt_id: str, body: s.CompleteRequest) -> Response:
        return as_json(await store.complete(attempt_id, body.status, body.result, body.error))

    @r.post("/attempts/complete")
    async def complete_many(body: s.CompleteMany, request: Request) -> Response:
        return await calls["/attempts/complete"][1](body, request)

    @r.post("/attempts/{attempt_id}/release")
    async def release(attempt_id: str, body: s.ReleaseRequest) -> Response:
        return as_json(await store.release(attempt_id, body.reason))

    @r.get("/attempts")
    async def query_attempts(rollout_id: str | None = None, worker_id: str | None = None,
                             status: list[AttemptStatus] | None = Query(None), cursor: str | None = None,
                             limit: int = Query(100, ge=1, le=1000)) -> Response:
        return as_json(await store.query_attempts(rollout_id, worker_id, status, cursor, limit))

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
    async def query_workers(cursor: str | None = None, limit: int = Query(100, ge=1, le=1000)) -> Response:
        return as_json(await store.query_workers(cursor, limit))

    @r.post("/resources")
    async def add_resources(body: s.AddResources) -> Response:
        return as_json(await store.add_resources(body.values, body.resources_id))

    @r.get("/resources/latest")
    async def latest_resources() -> Response:
        return as_json(await store.get_latest_resources())

    @r.get("/statistics")
    async def statistics() -> Response:
        return as_json(await store.statistics())

    @r.post("/reap")
    async def reap() -> Response:
        return as_json(await store.reap())

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


async def _maybe_await(result: Any) -> Any:
    if hasattr(result, "__await__"):
        return await result
    return result


def _describe(errors: Sequence[Any]) -> str:
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def create_app(
    store: Store, *, token: str | None = None, routers: Sequence[tuple[str, APIRouter]] = (),
    reaper_interval_s: float | None = 1.0, on_startup: Sequence[Callable[[], Any]] = (),
    on_shutdown: Sequence[Callable[[], Any]] = (),
) -> FastAPI:
    """Build the control plane app over ``store``; extra routers mount under their prefixes."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if reaper_interval_s is not None and hasattr(store, "start_reaper"):
            store.start_reaper(reaper_interval_s)
        for fn in on_startup:
            await _maybe_await(fn())
        log.info("control plane started")
        yield
        for fn in on_shutdown:
            await _maybe_await(fn())
        await store.close()
        log.info("control plane stopped")

    app = FastAPI(title="rollfleet", version="0.1.0", lifespan=lifespan,
                  description="Durable rollouts for LLM agents: the store, workers, batches, pools, engines.")
    app.state.store = store
    check = bearer_check(token)
    auth = [Depends(check)]

    @app.exception_handler(RollfleetError)
    async def rollfleet_error(_: Request, exc: RollfleetError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_body("InvalidInput", _describe(exc.errors()), 422)


    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(store_router(store), dependencies=auth)
    app.add_middleware(LeanRoutes, routes=hot_calls(store), check=check)
    for prefix, router in routers:
        app.include_router(router, prefix=prefix, dependencies=auth)
    return app
