"""The gateway's OpenAI-compatible HTTP surface: a FastAPI router and a standalone server.

Endpoints (also under ``/r/{rollout_id}/{attempt_id}/…``, the path form of the headers):
``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream with ``stream: true``),
``GET /v1/models``, plus ``POST /v1/rollfleet/abort/{rollout_id}`` and
``GET /v1/rollfleet/replicas``. The rollout and attempt come from the path or from the
``X-Rollfleet-Rollout`` / ``X-Rollfleet-Attempt`` headers. Responses carry token ids the way
vLLM does (``prompt_token_ids``, ``choices[i].token_ids``) so agents can read them too.
Chat messages may hold OpenAI ``image_url`` parts with data URLs; they are decoded and checked
when the body is parsed and go only to replicas that see (:mod:`rollfleet.engines.images`):
anything else is a 400 naming the part or the engine, before a stream starts. How bodies are
read and answers shaped (the OpenAI wire format) is :mod:`rollfleet.engines.gateway.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.gateway.wire import (
    GATEWAY_ERRORS,
    OpenAIErrorRoute,
    Shaper,
    error_response,
    events,
    parse_request,
)
from rollfleet.engines.images import BlobScope
from rollfleet.errors import Conflict, InvalidInput, RollfleetError
from rollfleet.web.capability import caller_check, operator_check
from rollfleet.web.guard import GATEWAY_GUARD, GuardConfig, RequestGuard
from rollfleet.web.jsonbody import check_json_body
from rollfleet.web.serving import uvicorn_options

log = logging.getLogger("rollfleet.engines")
ROLLOUT_HEADER, ATTEMPT_HEADER = "X-Rollfleet-Rollout", "X-Rollfleet-Attempt"


def gateway_router(
    gateway: Gateway, token: str | None = None, blobs: BlobScope | None = None
) -> APIRouter:
    """An APIRouter with the gateway's endpoints (mount it in any FastAPI app); ``blobs`` lets
    chat calls show images the store holds by reference (``rollfleet-blob:<sha256>``).

    With a ``token``, the model routes take it or an attempt capability
    (:mod:`rollfleet.web.capability`): a call made with a capability records to its attempt
    only, and may show only the images its rollout references; abort, weights and replicas take
    the token alone."""

    caller = caller_check(token, "gateway")
    operator = [Depends(operator_check(token, "gateway"))]
    router = APIRouter(
        dependencies=[Depends(check_json_body)],
        tags=["gateway"],
        route_class=OpenAIErrorRoute,
        responses=GATEWAY_ERRORS,
    )

    async def run(
        request: Request, chat: bool, rollout: str | None, attempt: str | None
    ) -> Response:
        try:
            granted = await caller(request)
            rollout = rollout or request.headers.get(ROLLOUT_HEADER)
            attempt = attempt or request.headers.get(ATTEMPT_HEADER)
            if granted is not None:
                rollout, attempt = granted.bind(rollout, attempt)
            source = None if blobs is None else blobs(None if granted is None else rollout)
            body, generation, want = await parse_request(await request.body(), chat, source)
            shaper = Shaper(generation, body, want)
            if body.stream:
                gateway.router.live(vision=bool(generation.images))  # refused before the stream
                return StreamingResponse(
                    events(gateway, generation, shaper, rollout, attempt),
                    media_type="text/event-stream",
                )
            result = await gateway.generate(generation, rollout, attempt)
            return Response(orjson.dumps(shaper.full(result)), media_type="application/json")
        except RollfleetError as exc:
            return error_response(exc)

    for prefix in ("", "/r/{rollout_id}/{attempt_id}"):

        @router.post(prefix + "/v1/chat/completions")
        async def chat(
            request: Request, rollout_id: str | None = None, attempt_id: str | None = None
        ) -> Response:
            """OpenAI chat completions (streaming too)."""
            return await run(request, True, rollout_id, attempt_id)

        @router.post(prefix + "/v1/completions")
        async def complete(
            request: Request, rollout_id: str | None = None, attempt_id: str | None = None
        ) -> Response:
            """OpenAI text completions (streaming too)."""
            return await run(request, False, rollout_id, attempt_id)

        @router.get(prefix + "/v1/models", dependencies=[Depends(caller)])
        async def models() -> dict[str, Any]:
            """The models the replicas serve."""
            return {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "owned_by": "rollfleet",
                        "created": 0,
                        "weights_version": version,
                    }
                    for model, version in sorted(gateway.model_versions().items())
                ],
            }

    @router.post("/v1/rollfleet/abort/{rollout_id}", dependencies=operator)
    async def abort(rollout_id: str) -> dict[str, Any]:
        """Abort a rollout's in-flight calls (they return partial output)."""
        return {"rollout_id": rollout_id, "aborted": await gateway.abort(rollout_id)}

    @router.put("/v1/rollfleet/weights/{version}", dependencies=operator)
    async def weights(version: int, request: Request) -> Response:
        """Install new weights on every replica: the body is a push
        (rollfleet.engines.weights.wire), or the header X-Rollfleet-Weights-File names the
        sealed memfds a client on this host wrote it to, in parts (/proc/<pid>/fd/<fd>, comma
        separated, at most 64); applied once it has all arrived intact; 409 for a version that
        is not newer, or while another push is being received; 422 for one more than 1000
        ahead unless X-Rollfleet-Weights-Jump: 1.
        X-Rollfleet-Weights-Delta: 1 with X-Rollfleet-Weights-Base: N sends only some tensors,
        computed against version N: 409 unless every replica serves N.
        X-Rollfleet-Weights-Lora-Alpha: A makes it a LoRA adapter
        (rollfleet.engines.weights.lora): 422 unless every replica applies adapters. The
        answer has, beside each replica's install times, ``receive_s``: reading and checking
        the push, before any install."""
        from rollfleet.engines.weights.wire import JUMP_HEADER, MAX_STEP

        try:
            if not 0 < version < 2**63:
                raise InvalidInput(f"weights version {version} must be 1 to 2**63 - 1")
            if gateway.weights_version >= version:  # refuse before reading gigabytes
                raise Conflict(
                    f"weights version {version} is not newer than {gateway.weights_version}"
                )
            if (
                version - gateway.weights_version > MAX_STEP
                and request.headers.get(JUMP_HEADER) != "1"
            ):  # a version far ahead would block every later push
                raise InvalidInput(
                    f"weights version {version} is more than {MAX_STEP} past"
                    f" {gateway.weights_version}; send {JUMP_HEADER}: 1 to jump there"
                )
            if gateway.receiving.locked():  # one push in memory at a time
                raise Conflict("another weights push is being received; send again after it")
            async with gateway.receiving:
                return await _receive(version, request)
        except RollfleetError as exc:
            return error_response(exc)

    async def _receive(version: int, request: Request) -> Response:
        """Read one push (body or memfds) and install it (RollfleetError when refused)."""
        from rollfleet.engines.weights.lora import LoraAdapter
        from rollfleet.engines.weights.memfd import mapped_push_memfds
        from rollfleet.engines.weights.wire import FILE_HEADER, decode, delta_base, lora_alpha

        base, alpha = delta_base(request.headers), lora_alpha(request.headers)

        def named(tensors: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            return tensors if alpha is None else LoraAdapter(tensors, alpha)

        if base is not None and gateway.weights_version != base:  # checked again at install
            raise Conflict(
                f"weights delta computed against version {base}, but the gateway serves"
                f" {gateway.weights_version}"
            )
        path = request.headers.get(FILE_HEADER)
        started = time.monotonic()
        if path is None:  # the push is the body
            tensors = await decode(request.stream())
            received = time.monotonic() - started
            answer = await gateway.update_weights(named(tensors), version, base=base)
        else:  # a client on this host wrote it to sealed memfds: engines may serve from them
            with mapped_push_memfds(path) as views:
                tensors = await decode(views, sealed=True)
                received = time.monotonic() - started
                answer = await gateway.update_weights(named(tensors), version, base=base)
                del tensors  # before the mappings close
        answer["receive_s"] = round(received, 6)  # read and checked, before any install
        return Response(orjson.dumps(answer), media_type="application/json")

    @router.get("/v1/rollfleet/replicas", dependencies=operator)
    async def replicas() -> dict[str, Any]:
        """Replicas and their load."""
        return {"replicas": gateway.replicas(), "repins": gateway.router.repins}

    return router


def gateway_app(
    gateway: Gateway,
    token: str | None = None,
    *,
    close_on_shutdown: bool = True,
    guard: GuardConfig = GATEWAY_GUARD,
) -> FastAPI:
    """A standalone FastAPI app serving only the gateway."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_on_shutdown:
            await gateway.close()

    app = FastAPI(title="rollfleet gateway", lifespan=lifespan)
    app.include_router(gateway_router(gateway, token))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one replica is healthy (no token needed)."""
        states = [await r.engine.health() for r in gateway.router.replicas.values()]
        return JSONResponse(
            {"healthy": sum(states), "replicas": len(states)},
            status_code=200 if any(states) else 503,
        )

    @app.exception_handler(RollfleetError)
    async def rollfleet_error(request: Request, exc: RollfleetError) -> JSONResponse:
        return error_response(exc)

    app.add_middleware(RequestGuard, config=guard)
    return app


def _server(
    gateway: Gateway, host: str, port: int, token: str | None, close_on_shutdown: bool
) -> Any:
    import uvicorn

    app = gateway_app(gateway, token, close_on_shutdown=close_on_shutdown)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        **uvicorn_options(GATEWAY_GUARD),
        lifespan="on",
    )
    return uvicorn.Server(config)


async def serve_gateway(
    gateway: Gateway, host: str = "127.0.0.1", port: int = 8100, token: str | None = None
) -> None:
    """Serve the gateway over HTTP until interrupted; the replicas stop with it."""
    log.info("gateway: listening on http://%s:%d/v1", host, port)
    await _server(gateway, host, port, token, close_on_shutdown=True).serve()


@contextlib.asynccontextmanager
async def running_gateway(gateway: Gateway, token: str | None = None) -> AsyncIterator[str]:
    """Serve ``gateway`` on a free local port inside this event loop; yield its base URL.

    The socket listens before the server task starts, so callers can connect at once.
    The replicas are left running (the caller owns them).
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = _server(gateway, "127.0.0.1", port, token, close_on_shutdown=False)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="rollfleet-gateway")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
