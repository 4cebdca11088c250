"""The OpenAI wire format of the gateway: request bodies parsed and checked into
:class:`~rollfleet.engines.base.GenerationRequest`, results shaped as chat or text completions
(whole, or as server-sent event chunks), and errors in OpenAI's shape. The routes that use it are
in :mod:`rollfleet.engines.gateway.app`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollfleet.engines.base import (
    Delta,
    FinishReason,
    Generation,
    GenerationRequest,
    Message,
    SamplingParams,
)
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.images import BlobSource, resolve_references
from rollfleet.engines.tool_calls import ToolStream, forced_name, reads_calls, tool_names
from rollfleet.errors import InvalidInput, RollfleetError
from rollfleet.web.errors import ERROR_RESPONSES


class Body(BaseModel):
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
# tools: OpenAI's own caps on the count and the names; the definitions' JSON as a whole
MAX_TOOLS, MAX_TOOLS_BYTES = 128, 64 * 1024
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionSpec(BaseModel):
    """A function tool: its name, what it does, and its arguments' JSON Schema."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    """The function a named ``tool_choice`` forces."""

    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one tool."""

    type: Literal["function"]
    function: ChosenFunction


class ChatBody(Body):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None

    def tool_fields(self) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
        """The tools and ``tool_choice`` for the engine, checked together (InvalidInput naming
        the field): distinct names, the definitions within MAX_TOOLS_BYTES, a named choice
        among them, and no choice that asks for a call without tools."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()] or None
        choice = self.tool_choice
        wire = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
        names = tool_names(tools)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidInput(f"request body field 'tools': tool {twice[0]!r} is named twice")
        size = len(orjson.dumps(tools)) if tools else 0
        if size > MAX_TOOLS_BYTES:
            raise InvalidInput(
                f"request body field 'tools': {size} bytes of definitions, over the cap of"
                f" {MAX_TOOLS_BYTES}"
            )
        forced = forced_name(wire)
        if forced is not None and forced not in names:
            raise InvalidInput(
                f"request body field 'tool_choice': names {forced!r}, which is not in tools"
            )
        if tools is None:
            if wire not in (None, "auto", "none"):
                raise InvalidInput("request body field 'tool_choice': asks for a call, no tools")
            return None, None
        return tools, wire or "auto"


class CompletionBody(Body):
    """``POST /v1/completions`` (one prompt: text or token ids)."""

    prompt: str | list[int]
    logprobs: int | None = None


def parse_body(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidInput(f"request body field {where!r}: {first['msg']}") from exc


def error_response(exc: RollfleetError) -> JSONResponse:
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


class OpenAIErrorRoute(APIRoute):
    """Answers every error of a gateway route in OpenAI's shape, wherever the router is mounted
    (standalone, or in the control plane under ``rollfleet serve --engine``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except RollfleetError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
                where = ".".join(str(p) for p in first["loc"])
                return error_response(InvalidInput(f"{where}: {first['msg']}"))

        return answer


def token_logprobs(result: Generation | Delta, ids: Any, lps: Any) -> list[dict[str, Any]]:
    return [
        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(ids, lps, strict=False)
    ]


def check_tool_messages(messages: list[Message]) -> None:
    """Assistant ``tool_calls`` in OpenAI's shape (InvalidInput naming the place): a list of
    function calls, each with a name and its arguments (a JSON string, or an object)."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        where = f"request body field 'messages.{i}.tool_calls"
        if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
            raise InvalidInput(f"{where}': a list of at most {MAX_TOOLS} calls")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidInput(f"{where}.{j}.function': needs a name")
            if not isinstance(function.get("arguments", "{}"), str | dict):
                raise InvalidInput(f"{where}.{j}.function.arguments': a JSON string")


def finish_reason(g: Generation) -> str:
    """The answer's finish reason: ``tool_calls`` when calls were read from a finished text."""
    parsed = g.tool_parse
    if parsed is not None and parsed.calls and g.finish_reason is FinishReason.STOP:
        return "tool_calls"
    return g.finish_reason.value


class Shaper:
    """Turns engine output into OpenAI response bodies for one request."""

    def __init__(self, request: GenerationRequest, body: Body, want_logprobs: bool) -> None:
        self.request, self.body, self.want_logprobs = request, body, want_logprobs
        self.chat = request.is_chat
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        # streamed text that may be a tool call waits for the end
        self.tools = ToolStream() if self.chat and reads_calls(request) else None

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
            "finish_reason": finish_reason(g),
            "token_ids": g.completion_token_ids,
        }
        logprobs = self._logprobs(g, g.completion_token_ids, g.logprobs or [])
        if self.chat:
            choice.update(message=self._message(g), logprobs=logprobs)
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

    @staticmethod
    def _message(g: Generation) -> dict[str, Any]:
        parsed = g.tool_parse
        if parsed is None or not parsed.calls:
            return {"role": "assistant", "content": g.text}
        calls = [c.wire() for c in parsed.calls]
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}

    def chunk(self, d: Delta) -> dict[str, Any]:
        """One streamed chunk for a delta (its text held back while it may be a tool call)."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": None,
            "token_ids": list(d.token_ids),
            "logprobs": self._logprobs(d, d.token_ids, d.logprobs),
        }
        text = d.text if self.tools is None else self.tools.feed(d.text)
        choice.update(
            {"delta": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        )
        return self._frame(choice, f"{self.object}.chunk" if self.chat else self.object)

    def _held(self, g: Generation) -> list[dict[str, Any]]:
        """The chunks of what the tool stream held: the rest of the content, then each call
        whole (OpenAI's ``delta.tool_calls[i]``)."""
        if self.tools is None:
            return []
        deltas: list[dict[str, Any]] = []
        rest = self.tools.rest(g.tool_parse)
        if rest:
            deltas.append({"role": "assistant", "content": rest})
        for index, call in enumerate(g.tool_parse.calls if g.tool_parse else ()):
            deltas.append({"role": "assistant", "tool_calls": [{"index": index, **call.wire()}]})
        obj = f"{self.object}.chunk"
        return [
            self._frame({"index": 0, "finish_reason": None, "delta": d, "logprobs": None}, obj)
            for d in deltas
        ]

    def last(self, g: Generation) -> list[dict[str, Any]]:
        """The held chunks, the closing chunk (finish reason), and the usage chunk when asked
        for."""
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish_reason(g),
            "logprobs": None,
        }
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        obj = f"{self.object}.chunk" if self.chat else self.object
        frames = self._held(g) + [
            self._frame(choice, obj) | {"model": g.model, "prompt_token_ids": g.prompt_token_ids}
        ]
        if (self.body.stream_options or {}).get("include_usage"):
            frames.append(self._frame(choice, obj) | {"choices": [], "usage": g.usage})
        return frames

    def _logprobs(self, item: Generation | Delta, ids: Any, lps: Any) -> dict[str, Any] | None:
        if not self.want_logprobs or not lps:
            return None
        entries = token_logprobs(item, ids, lps)
        if self.chat:
            return {"content": entries}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": list(lps),
            "top_logprobs": None,
            "text_offset": [],
        }


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def events(
    gateway: Gateway,
    request: GenerationRequest,
    shaper: Shaper,
    rollout: str | None,
    attempt: str | None,
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(gateway.stream(request, rollout, attempt)) as items:
        try:
            async for item in items:
                if isinstance(item, Generation):
                    for frame in shaper.last(item):
                        yield sse(frame)
                elif item.text or item.token_ids:
                    yield sse(shaper.chunk(item))
        except RollfleetError as exc:
            yield sse({"error": {"message": exc.message, "type": type(exc).__name__}})
    yield b"data: [DONE]\n\n"


async def parse_request(
    raw: bytes, chat: bool, blobs: BlobSource | None
) -> tuple[Body, GenerationRequest, bool]:
    """The parsed body, the engine request and whether logprobs were asked for."""
    if chat:
        chat_body = parse_body(ChatBody, raw)
        want = chat_body.logprobs
        tools, tool_choice = chat_body.tool_fields()
        check_tool_messages(chat_body.messages)
        messages = await resolve_references(chat_body.messages, blobs)
        request = GenerationRequest(
            messages=messages,
            params=chat_body.params(want),
            model=chat_body.model,
            tools=tools,
            tool_choice=tool_choice,
        )
        return chat_body, request, want
    completion = parse_body(CompletionBody, raw)
    want = completion.logprobs is not None
    request = GenerationRequest(
        prompt=completion.prompt, params=completion.params(want), model=completion.model
    )
    return completion, request, want
