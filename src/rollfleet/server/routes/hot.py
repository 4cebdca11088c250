"""The calls on the path of every rollout (enqueue many, claim, complete one or many, complete and
claim), declared once.

Each :class:`HotRoute` is served twice over from the same record: by :class:`LeanRoutes`, an ASGI
middleware ahead of FastAPI's whole stack, and by an ordinary FastAPI route that documents it in
the OpenAPI schema (and serves it when the router is mounted without the middleware).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from rollfleet.errors import RollfleetError
from rollfleet.server import schemas as s
from rollfleet.server.routes.common import as_json, describe
from rollfleet.store.base import Store
from rollfleet.web.errors import error_body, error_response
from rollfleet.web.jsonbody import strict_json

B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class HotRoute(Generic[B]):
    """One POST call served ahead of FastAPI: its path, its body's model, and its handler."""

    path: str
    name: str
    model: type[B]
    handler: Callable[[B, Request], Awaitable[Response]]


def hot_routes(store: Store) -> list[HotRoute[Any]]:
    """The hot calls over ``store``."""

    async def enqueue_many(body: s.EnqueueMany, _request: Request) -> Response:
        return as_json(await store.enqueue_many(body.items))

    async def claim(body: s.ClaimRequest, request: Request) -> Response:
        # a client that hung up during the long-poll gets nothing leased to it; the documents go out
        # as they are: building Rollout records only to serialise them was ~20% of the server's time
        docs = await store.claim_documents(
            body.worker_id, body.wait_s, body.max_n, abandoned=request.is_disconnected
        )
        return Response(orjson.dumps(docs), media_type="application/json")

    async def complete(body: s.CompleteRequest, request: Request) -> Response:
        attempt_id = request.path_params["attempt_id"]
        return as_json(await store.complete(attempt_id, body.status, body.result, body.error))

    async def complete_many(body: s.CompleteMany, _request: Request) -> Response:
        return as_json(await store.complete_many(body.items))

    async def complete_and_claim(body: s.CompleteAndClaim, _request: Request) -> Response:
        found = await store.complete_and_claim_documents(body.items, body.worker_id, body.max_n)
        return Response(orjson.dumps(found), media_type="application/json")

    return [
        HotRoute("/rollouts/batch", "enqueue_many", s.EnqueueMany, enqueue_many),
        HotRoute("/claims", "claim", s.ClaimRequest, claim),
        HotRoute("/attempts/complete", "complete_many", s.CompleteMany, complete_many),
        HotRoute("/attempts/{attempt_id}/complete", "complete", s.CompleteRequest, complete),
        HotRoute(
            "/attempts/complete-and-claim",
            "complete_and_claim",
            s.CompleteAndClaim,
            complete_and_claim,
        ),
    ]


def add_documenting_route(router: APIRouter, route: HotRoute[Any]) -> None:
    """Declare ``route`` on ``router`` as a FastAPI POST route taking its model as the body."""

    async def endpoint(body: BaseModel, request: Request) -> Response:
        return await route.handler(body, request)

    # FastAPI reads the body's type from the signature: give it this route's model
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                "body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=route.model
            ),
            inspect.Parameter(
                "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request
            ),
        ],
        return_annotation=Response,
    )
    endpoint.__name__ = route.name
    router.add_api_route(route.path, endpoint, methods=["POST"], name=route.name)


class LeanRoutes:
    """ASGI middleware serving the hot calls (:func:`hot_routes`) ahead of FastAPI's whole stack.

    FastAPI's per-request machinery (its middlewares, dependency solving, a linear match over
    every route) costs several hundred µs a request on the 2-core CI machine: as much as the
    store's own work for a batch. Auth, body validation and the error shapes stay the same.
    """

    def __init__(
        self,
        app: ASGIApp,
        routes: Sequence[HotRoute[Any]],
        check: Callable[[Request], Awaitable[None]],
    ) -> None:
        self.app = app
        self.routes = {route.path: route for route in routes if "{" not in route.path}
        # "/attempts/{attempt_id}/complete" -> ("/attempts/", "attempt_id", "/complete", route)
        self.patterns = [
            (head, name, tail, route)
            for route in routes
            if "{" in route.path
            for head, rest in [route.path.split("{", 1)]
            for name, tail in [rest.split("}", 1)]
        ]
        self.check = check

    def match(self, path: str) -> tuple[HotRoute[Any] | None, dict[str, str]]:
        """The lean route serving ``path`` and its path parameter, or None."""
        route = self.routes.get(path)
        if route is not None:
            return route, {}
        for head, name, tail, route in self.patterns:
            if path.startswith(head) and path.endswith(tail):
                value = path[len(head) : len(path) - len(tail)]
                if value and "/" not in value:
                    return route, {name: value}
        return None, {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a lean route, or pass the request on to FastAPI."""
        route, params = (
            self.match(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else (None, {})
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request({**scope, "path_params": params} if params else scope, receive)
        try:
            await self.check(request)
            raw = await request.body()
            strict_json(raw)  # what the store could not keep is a 422 here, not a 500 later
            body = route.model.model_validate_json(raw)
            response = await route.handler(body, request)
        except RollfleetError as exc:
            response = error_response(exc)
        except ValidationError as exc:
            response = error_body("InvalidInput", describe(exc.errors()), 422)
        await response(scope, receive, send)
