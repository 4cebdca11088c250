"""Any OpenAI-compatible server over HTTP: vLLM, SGLang, llama.cpp server, Ollama, OpenAI.

Requests always stream from the server (SSE), even when the caller wants one result, so an
abort can stop reading at once: the read task is cancelled, the connection closes, and the
servers we know (vLLM, SGLang, llama.cpp) abort a request whose client went away. The
tokens already received come back marked ``abort``. Reads have no timeout: a long
generation is never cut by a client-side default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from rollfleet.engines.base import (
    BaseEngine,
    Delta,
    EngineInfo,
    FinishReason,
    Generation,
    GenerationRequest,
    StreamItem,
    WeightSource,
)
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")
NO_READ_TIMEOUT = httpx.Timeout(connect=30.0, read=None, write=60.0, pool=None)
_END, _ABORTED = object(), object()


@dataclass
class _Accumulated:
    """What the chunks of one streamed answer add up to."""

    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, int] | None = None

    def add(self, chunk: dict[str, Any], chat: bool) -> Delta | None:
        """Fold one SSE chunk in; return the delta it carries, if any."""
        self.prompt_ids.extend(chunk.get("prompt_token_ids") or [])
        if chunk.get("usage"):
            self.usage = {k: int(v) for k, v in chunk["usage"].items() if isinstance(v, int)}
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        self.prompt_ids.extend(choice.get("prompt_token_ids") or [])
        self.finish = choice.get("finish_reason") or self.finish
        text = (
            (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
        )
        ids = tuple(choice.get("token_ids") or ())
        lps = tuple(_logprobs(choice.get("logprobs"), chat))
        self.text += text
        self.out_ids.extend(ids)
        self.logprobs.extend(lps)
        return Delta(text, ids, lps) if text or ids else None


def _logprobs(block: Any, chat: bool) -> list[float]:
    """Log-probabilities from a chunk's ``logprobs`` block (chat or completions shape)."""
    if not block:
        return []
    if chat:
        return [float(e["logprob"]) for e in block.get("content") or [] if "logprob" in e]
    return [float(x) for x in block.get("token_logprobs") or [] if x is not None]


class OpenAIEngine(BaseEngine):
    """Talks to an OpenAI-compatible server at ``base_url`` (without the ``/v1``). Image parts
    are forwarded unchanged (``vision``: whether the served model sees is the server's to say)."""

    name = "openai"
    vision = True

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_concurrency: int = 64,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(model or "")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key, self.max_concurrency = api_key, max_concurrency
        self.extra_body = dict(extra_body or {})
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Open the HTTP client and learn the served model name if none was given."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=NO_READ_TIMEOUT, headers=headers
        )
        if not self.model:
            self.model = await self._first_model()
        log.info("%s: using %s at %s", self.name, self.model, self.base_url)

    async def _first_model(self) -> str:
        try:
            response = await self.client.get("/v1/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise EngineError(
                f"{self.name}: cannot list models at {self.base_url}/v1/models: {exc}"
            ) from exc

    @property
    def client(self) -> httpx.AsyncClient:
        """The open HTTP client."""
        if self._client is None:
            raise EngineError(f"{self.name}: engine is not started")
        return self._client

    async def stop(self) -> None:
        """Abort what is in flight and close the HTTP client."""
        await self.abort(None)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def health(self) -> bool:
        """True when the server lists its models."""
        try:
            return (await self.client.get("/v1/models", timeout=5.0)).status_code == 200
        except (httpx.HTTPError, EngineError):
            return False

    def info(self) -> EngineInfo:
        """Describe the engine."""
        return EngineInfo(
            self.name,
            self.model,
            self.version,
            self.max_concurrency,
            self._client is not None,
            self.base_url,
            vision=self.vision,
        )

    @property
    def in_flight(self) -> int:
        """Requests being read now."""
        return len(self._tasks)

    def body(self, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body sent to the server for ``request``."""
        p = request.params
        body: dict[str, Any] = {
            "model": request.model or self.model,
            "stream": True,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stream_options": {"include_usage": True},
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if p.ignore_eos:
            body["ignore_eos"] = True
        if request.is_chat:
            body.update(messages=request.messages, logprobs=p.logprobs)
        else:
            body["prompt"] = request.prompt
            if p.logprobs:
                body["logprobs"] = 1
        return {**body, **self.extra_body}

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """Stream ``request`` from the server; an abort ends it with the partial result."""
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        task = asyncio.create_task(self._pump(request, chunks), name=f"read-{request.request_id}")
        self._tasks[request.request_id] = task
        acc = _Accumulated()
        try:
            while (item := await chunks.get()) not in (_END, _ABORTED):
                if isinstance(item, BaseException):
                    raise EngineError(
                        f"{self.name}: request to {self.base_url} failed: {item}"
                    ) from item
                if delta := acc.add(item, request.is_chat):
                    yield delta
            yield self._result(request, acc, item is _ABORTED)
        finally:
            self._tasks.pop(request.request_id, None)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _pump(self, request: GenerationRequest, chunks: asyncio.Queue[Any]) -> None:
        path = "/v1/chat/completions" if request.is_chat else "/v1/completions"
        try:
            async with self.client.stream("POST", path, json=self.body(request)) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", "replace")[:500]
                    raise EngineError(f"HTTP {response.status_code} from {path}: {detail}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunks.put_nowait(orjson.loads(data))
            chunks.put_nowait(_END)
        except asyncio.CancelledError:
            chunks.put_nowait(_ABORTED)
            raise
        except (httpx.HTTPError, orjson.JSONDecodeError, EngineError) as exc:
            chunks.put_nowait(exc)

    def _result(self, request: GenerationRequest, acc: _Accumulated, aborted: bool) -> Generation:
        reason = FinishReason.ABORT if aborted else _finish_reason(acc.finish)
        usage = None if acc.out_ids and acc.prompt_ids else acc.usage
        return Generation(
            request.request_id,
            acc.text,
            acc.prompt_ids,
            acc.out_ids,
            acc.logprobs or None,
            reason,
            self.name,
            self.model,
            self.version,
            usage,
        )

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Stop reading the named requests (closing their connections); return how many."""
        ids = (
            list(self._tasks)
            if request_ids is None
            else [r for r in request_ids if r in self._tasks]
        )
        for request_id in ids:
            self._tasks[request_id].cancel()
        return len(ids)

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """A generic OpenAI server has no weight-update endpoint."""
        raise EngineError(
            f"{self.name}: a generic OpenAI server cannot load weights; use the"
            " vllm or sglang engine, or restart the server with new weights"
        )

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to a server endpoint; EngineError on failure."""
        try:
            response = await self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.name}: POST {path} failed: {exc}") from exc
        if response.status_code >= 400:
            raise EngineError(
                f"{self.name}: POST {path} answered {response.status_code}: {response.text[:500]}"
            )
        return response.json() if response.content else None


def _finish_reason(value: str | None) -> FinishReason:
    if value == "length":
        return FinishReason.LENGTH
    if value == "abort":
        return FinishReason.ABORT
    return FinishReason.STOP
