"""The gateway's OpenAI-compatible HTTP surface: a FastAPI router and a standalone server.

Endpoints (also under ``/r/{rollout_id}/{attempt_id}/…``, the path form of the headers):
``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream with ``stream: true``),
``GET /v1/models``, plus ``POST /v1/rollfleet/abort/{rollout_id}`` and
``GET /v1/rollfleet/replicas``. The rollout and attempt come from the path or from the
``X-Rollfleet-Rollout`` / ``X-Rollfleet-Attempt`` headers. Responses carry token ids the way
vLLM does (``prompt_token_ids``, ``choices[i].token_ids``) so agents can read them too.
Chat messages may hold OpenAI ``image_url`` parts with data URLs; they are decoded and checked
when the body is parsed and go only to replicas that see (:mod:`rollfleet.engines.images`):
anything else is a 400 naming the part or the engine, before a stream starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollfleet.engines.base import Delta, Generation, GenerationRequest, SamplingParams
from rollfleet.engines.gateway import Gateway
from rollfleet.engines.images import BlobSource, resolve_references
from rollfleet.errors import Conflict, InvalidInput, RollfleetError
from rollfleet.web.errors import ERROR_RESPONSES
from rollfleet.web.guard import GATEWAY_GUARD, GuardConfig, RequestGuard
from rollfleet.web.jsonbody import check_json_body
from rollfleet.web.serving import bearer_check, uvicorn_options

log = logging.getLogger("rollfleet.engines")
ROLLOUT_HEADER, ATTEMPT_HEADER = "X-Rollfleet-Rollout", "X-Rollfleet-Attempt"


class _Body(BaseModel):
    """Fields shared by chat and completion requests; unknown OpenAI fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False

    def params(self, logprobs: bool) -> SamplingParams:
        """Sampling parameters for the engine."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or 256,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
        )


M = TypeVar("M", bound=BaseModel)


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False


class CompletionBody(_Body):
    """``POST /v1/completions`` (one prompt: text or token ids)."""

    prompt: str | list[int]
    logprobs: int | None = None


def _parse(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidInput(f"request body field {where!r}: {first['msg']}") from exc


def _error(exc: RollfleetError) -> JSONResponse:
    kind = type(exc).__name__
    return JSONResponse(
        {"error": {"message": exc.message, "type": kind, "code": kind}}, status_code=exc.status_code
    )


class OpenAIErrorDetail(BaseModel):
    """What went wrong, as OpenAI's API says it."""

    message: str
    type: str
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """The gateway's error answers: OpenAI's shape, so that OpenAI clients read them."""

    error: OpenAIErrorDetail


# the gateway's own errors are OpenAI-shaped; the request guard's refusals are the API's shape
GATEWAY_ERRORS: dict[int | str, dict[str, Any]] = {
    **{code: ERROR_RESPONSES[code] for code in (403, 413, 415, 421)},
    **{
        code: {"model": OpenAIErrorBody, "description": ERROR_RESPONSES[code]["description"]}
        for code in (400, 401, 404, 409, 422, 503)
    },
}


class _OpenAIErrors(APIRoute):
    """Answers every error of a gateway route in OpenAI's shape, wherever the router is mounted
    (standalone, or in the control plane under ``rollfleet serve --engine``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except RollfleetError as exc:
                return _error(exc)
            except RequestValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
                where = ".".join(str(p) for p in first["loc"])
                return _error(InvalidInput(f"{where}: {first['msg']}"))

        return answer


def _token_logprobs(result: Generation | Delta, ids: Any, lps: Any) -> list[dict[str, Any]]:
    return [
        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(ids, lps, strict=False)
    ]


class _Shaper:
    """Turns engine output into OpenAI response bodies for one request."""

    def __init__(self, request: GenerationRequest, body: _Body, want_logprobs: bool) -> None:
        self.request, self.body, self.want_logprobs = request, body, want_logprobs
        self.chat = request.is_chat
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _frame(self, choice: dict[str, Any], obj: str) -> dict[str, Any]:
        return {
            "id": self.request.request_id,
            "object": obj,
            "created": self.created,
            "model": self.body.model or "",
            "choices": [choice],
        }

    def full(self, g: Generation) -> dict[str, Any]:
        """The non-streaming response."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": g.finish_reason.value,
            "token_ids": g.completion_token_ids,
        }
        logprobs = self._logprobs(g, g.completion_token_ids, g.logprobs or [])
        if self.chat:
            choice.update(message={"role": "assistant", "content": g.text}, logprobs=logprobs)
        else:
            choice.update(text=g.text, logprobs=logprobs)
        body = self._frame(choice, self.object)
        body.update(
            model=g.model,
            usage=g.usage,
            prompt_token_ids=g.prompt_token_ids,
            rollfleet={
                "engine": g.engine,
                "weights_version": g.weights_version,
                "weights_versions": [list(span) for span in g.versions],
            },
        )
        return body

    def chunk(self, d: Delta) -> dict[str, Any]:
        """One streamed chunk for a delta."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": None,
            "token_ids": list(d.token_ids),
            "logprobs": self._logprobs(d, d.token_ids, d.logprobs),
        }
        choice.update(
            {"delta": {"role": "assistant", "content": d.text}} if self.chat else {"text": d.text}
        )
        return self._frame(choice, f"{self.object}.chunk" if self.chat else self.object)

    def last(self, g: Generation) -> list[dict[str, Any]]:
        """The closing chunk (finish reason), and the usage chunk when asked for."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": g.finish_reason.value,
            "logprobs": None,
        }
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        obj = f"{self.object}.chunk" if self.chat else self.object
        frames = [
            self._frame(choice, obj) | {"model": g.model, "prompt_token_ids": g.prompt_token_ids}
        ]
        if (self.body.stream_options or {}).get("include_usage"):
            frames.append(self._frame(choice, obj) | {"choices": [], "usage": g.usage})
        return frames

    def _logprobs(self, item: Generation | Delta, ids: Any, lps: Any) -> dict[str, Any] | None:
        if not self.want_logprobs or not lps:
            return None
        entries = _token_logprobs(item, ids, lps)
        if self.chat:
            return {"content": entries}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": list(lps),
            "top_logprobs": None,
            "text_offset": [],
        }


def _sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _events(
    gateway: Gateway,
    request: GenerationRequest,
    shaper: _Shaper,
    rollout: str | None,
    attempt: str | None,
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(gateway.stream(request, rollout, attempt)) as items:
        try:
            async for item in items:
                if isinstance(item, Generation):
                    for frame in shaper.last(item):
                        yield _sse(frame)
                elif item.text or item.token_ids:
                    yield _sse(shaper.chunk(item))
        except RollfleetError as exc:
            yield _sse({"error": {"message": exc.message, "type": type(exc).__name__}})
    yield b"data: [DONE]\n\n"


async def _request(
    raw: bytes, chat: bool, blobs: BlobSource | None
) -> tuple[_Body, GenerationRequest, bool]:
    """The parsed body, the engine request and whether logprobs were asked for."""
    if chat:
        chat_body = _parse(ChatBody, raw)
        want = chat_body.logprobs
        messages = await resolve_references(chat_body.messages, blobs)
        request = GenerationRequest(
            messages=messages, params=chat_body.params(want), model=chat_body.model
        )
        return chat_body, request, want
    completion = _parse(CompletionBody, raw)
    want = completion.logprobs is not None
    request = GenerationRequest(
        prompt=completion.prompt, params=completion.params(want), model=completion.model
    )
    return completion, request, want


def gateway_router(
    gateway: Gateway, token: str | None = None, blobs: BlobSource | None = None
) -> APIRouter:
    """An APIRouter with the gateway's endpoints (mount it in any FastAPI app); ``blobs`` lets
    chat calls show images the store holds by reference (``rollfleet-blob:<sha256>``)."""

    checks = [Depends(bearer_check(token, "gateway")), Depends(check_json_body)]
    router = APIRouter(
        dependencies=checks, tags=["gateway"], route_class=_OpenAIErrors, responses=GATEWAY_ERRORS
    )

    async def run(raw: bytes, chat: bool, rollout: str | None, attempt: str | None) -> Response:
        try:
            body, request, want = await _request(raw, chat, blobs)
            shaper = _Shaper(request, body, want)
            if body.stream:
                gateway.router.live(vision=bool(request.images))  # refused before the stream
                return StreamingResponse(
                    _events(gateway, request, shaper, rollout, attempt),
                    media_type="text/event-stream",
                )
            result = await gateway.generate(request, rollout, attempt)
            return Response(orjson.dumps(shaper.full(result)), media_type="application/json")
        except RollfleetError as exc:
            return _error(exc)

    def ids(
        request: Request, rollout: str | None, attempt: str | None
    ) -> tuple[str | None, str | None]:
        return (
            rollout or request.headers.get(ROLLOUT_HEADER),
            attempt or request.headers.get(ATTEMPT_HEADER),
        )

    for prefix in ("", "/r/{rollout_id}/{attempt_id}"):

        @router.post(prefix + "/v1/chat/completions")
        async def chat(
            request: Request, rollout_id: str | None = None, attempt_id: str | None = None
        ) -> Response:
            """OpenAI chat completions (streaming too)."""
            return await run(await request.body(), True, *ids(request, rollout_id, attempt_id))

        @router.post(prefix + "/v1/completions")
        async def complete(
            request: Request, rollout_id: str | None = None, attempt_id: str | None = None
        ) -> Response:
            """OpenAI text completions (streaming too)."""
            return await run(await request.body(), False, *ids(request, rollout_id, attempt_id))

        @router.get(prefix + "/v1/models")
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

    @router.post("/v1/rollfleet/abort/{rollout_id}")
    async def abort(rollout_id: str) -> dict[str, Any]:
        """Abort a rollout's in-flight calls (they return partial output)."""
        return {"rollout_id": rollout_id, "aborted": await gateway.abort(rollout_id)}

    @router.put("/v1/rollfleet/weights/{version}")
    async def weights(version: int, request: Request) -> Response:
        """Install new weights on every replica: the body is a push (rollfleet.engines.weights),
        or the header X-Rollfleet-Weights-File names one a client on this host wrote to shared
        memory; applied once it has all arrived intact; 409 for a version that is not newer, or
        while another push is being received; 422 for one more than 1000 ahead unless
        X-Rollfleet-Weights-Jump: 1. X-Rollfleet-Weights-Delta: 1 with X-Rollfleet-Weights-Base:
        N sends only some tensors, computed against version N: 409 unless every replica serves
        N."""
        from rollfleet.engines.weights_wire import JUMP_HEADER, MAX_STEP

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
            return _error(exc)

    async def _receive(version: int, request: Request) -> Response:
        """Read one push (body or push file) and install it (RollfleetError when refused)."""
        from rollfleet.engines.weights_wire import FILE_HEADER, decode, delta_base, mapped_push_file

        base = delta_base(request.headers)
        if base is not None and gateway.weights_version != base:  # checked again at install
            raise Conflict(
                f"weights delta computed against version {base}, but the gateway serves"
                f" {gateway.weights_version}"
            )
        path = request.headers.get(FILE_HEADER)
        if path is None:  # the push is the body
            tensors = await decode(request.stream())
            answer = await gateway.update_weights(tensors, version, base=base)
        else:  # a client on this host wrote it to shared memory
            with mapped_push_file(path) as view:
                tensors = await decode(view)
                answer = await gateway.update_weights(tensors, version, base=base)
                del tensors  # before the mapping closes
        return Response(orjson.dumps(answer), media_type="application/json")

    @router.get("/v1/rollfleet/replicas")
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
        return _error(exc)

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
