"""The engine protocol every inference backend satisfies, and the records it speaks in.

An engine turns a :class:`GenerationRequest` (chat messages or a completion prompt) into a
stream of :class:`Delta` items ending with one :class:`Generation`. Everything else
(``generate``, ``chat``) is built on that stream, so streaming and non-streaming share one
code path. ``abort`` stops named requests between two tokens; each aborted request still
ends with a :class:`Generation` whose ``finish_reason`` is ``abort`` and which carries the
tokens produced so far.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rollfleet.engines.images import ImageInput, cannot_see, request_images
from rollfleet.errors import EngineError

if TYPE_CHECKING:
    from rollfleet.engines.continuation import PriorCall
    from rollfleet.engines.tool_calls import ToolParse

JSON = Any
Message = dict[str, Any]
NamedTensors = Iterable[tuple[str, Any]]
WeightSource = NamedTensors | str | Path
"""What ``update_weights`` accepts: named tensors in memory, or a checkpoint path."""


class WeightsDelta(list[tuple[str, Any]]):
    """Named tensors that replace only some weights: every weight not named keeps its value in
    weights version ``base``, the one the delta was computed against. Engines tell a delta from
    a full update (which must name every weight) by this type."""

    def __init__(self, tensors: Iterable[tuple[str, Any]], base: int) -> None:
        super().__init__(tensors)
        self.base = base


def message_text(content: Any) -> str:
    """Flatten OpenAI message content (a string or a list of parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


class FinishReason(str, enum.Enum):
    """Why a generation ended (OpenAI's words, plus ``abort``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: OpenAI's common knobs."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = True
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One call: chat ``messages`` or a completion ``prompt`` (text or token ids).

    ``images`` are the image parts of ``messages``, decoded and checked once when the request
    is made (:func:`~rollfleet.engines.images.request_images`: ImageRefused for a bad one);
    the messages keep their data URLs, so a remote engine forwards them unchanged."""

    messages: list[Message] | None = None
    prompt: str | list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    model: str | None = None
    images: tuple[ImageInput, ...] = field(default=(), repr=False, compare=False)
    # the earlier call of the same rollout attempt this one may continue token-in (the gateway
    # sets it; engines with a tokenizer of their own use it, others render the messages)
    prior: PriorCall | None = field(default=None, repr=False, compare=False)
    # OpenAI function tools offered to the model, and how it may use them ("auto", "none",
    # "required" or {"type": "function", "function": {"name": ...}}); see engines.tool_calls
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise EngineError("a generation request needs exactly one of messages or prompt")
        if self.tools and self.messages is None:
            raise EngineError("tools go with chat messages, not with a completion prompt")
        if self.messages is not None and not self.images:
            object.__setattr__(self, "images", request_images(self.messages))

    @property
    def is_chat(self) -> bool:
        """True for a chat request."""
        return self.messages is not None


@dataclass(frozen=True)
class Delta:
    """Newly generated text and tokens, streamed before the final :class:`Generation`."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Generation:
    """The finished (or aborted) result of one request."""

    request_id: str
    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    engine: str
    model: str
    weights_version: int
    reported_usage: dict[str, int] | None = None
    version_spans: tuple[tuple[int, int], ...] = ()
    # the text read as tool calls, when the request offered tools (the gateway reads it)
    tool_parse: ToolParse | None = None

    @property
    def versions(self) -> list[tuple[int, int]]:
        """``(first completion token, weights version)`` of each run of tokens one policy made:
        one entry, unless new weights arrived while this request was being generated."""
        return list(self.version_spans) or [(0, self.weights_version)]

    @property
    def aborted(self) -> bool:
        """True when the request was aborted and holds partial output."""
        return self.finish_reason is FinishReason.ABORT

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI-style token counts (the server's own when it reported them)."""
        if self.reported_usage is not None:
            return self.reported_usage
        prompt, completion = len(self.prompt_token_ids), len(self.completion_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


StreamItem = Delta | Generation


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself (for /v1/models, the dashboard and logs)."""

    engine: str
    model: str
    weights_version: int
    max_concurrency: int
    healthy: bool
    base_url: str | None = None
    vision: bool = False
    adapters: bool = False  # applies LoRA adapters pushed as such (rollfleet.engines.weights.lora)


@runtime_checkable
class Engine(Protocol):
    """The one protocol every inference backend satisfies."""

    name: str

    async def start(self) -> None:
        """Load the model or launch the server; return once healthy."""

    async def stop(self) -> None:
        """Abort everything in flight and release the model or server."""

    async def health(self) -> bool:
        """True when the engine can serve a request now."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """Yield deltas, then exactly one final :class:`Generation`."""

    async def generate(self, request: GenerationRequest) -> Generation:
        """Run one request to its end and return the result."""

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Abort the named in-flight requests (all when None); return how many were found."""

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Load new weights (through buckets for tensors); return the new weights version."""

    async def relabel(self, version: int) -> int:
        """Serve the same weights as ``version`` (nothing changed since the last update)."""
        ...

    def info(self) -> EngineInfo:
        """Describe the engine."""

    @property
    def version(self) -> int:
        """The weights version that generations are produced with now."""


class BaseEngine:
    """Shared parts of an engine: ``generate``/``chat`` on top of ``stream``, versioning."""

    name = "base"
    max_concurrency = 1
    vision = False  # True for engines that take image parts
    adapters = False  # True for engines that apply LoRA adapters pushed as such

    def __init__(self, model: str) -> None:
        self.model = model
        self._version = 0

    @property
    def version(self) -> int:
        """The weights version that generations are produced with now."""
        return self._version

    def _next_version(self, version: int | None) -> int:
        """Record and return the version a weight update installs."""
        self._version = self._version + 1 if version is None else int(version)
        return self._version

    async def relabel(self, version: int) -> int:
        """Serve the same weights as ``version`` (a training step that changed nothing):
        tokens generated from now on say ``version``; no weight moves."""
        return self._next_version(version)

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """Yield deltas, then one final Generation (subclasses implement)."""
        raise NotImplementedError

    async def generate(self, request: GenerationRequest) -> Generation:
        """Run one request to its end and return the result."""
        async for item in self.stream(request):
            if isinstance(item, Generation):
                return item
        raise EngineError(f"{self.name}: stream for {request.request_id} ended without a result")

    async def chat(self, messages: list[Message], **params: Any) -> Generation:
        """Convenience: one chat request with keyword sampling parameters."""
        return await self.generate(
            GenerationRequest(messages=messages, params=SamplingParams(**params))
        )

    async def health(self) -> bool:
        """True when the engine can serve a request now (subclasses refine)."""
        return True

    def info(self) -> EngineInfo:
        """Describe the engine."""
        return EngineInfo(
            self.name, self.model, self._version, self.max_concurrency, True, vision=self.vision
        )

    def check_images(self, request: GenerationRequest) -> None:
        """Refuse a request with images when this engine cannot see (ImageRefused, HTTP 400):
        an image is never silently dropped."""
        if request.images and not self.vision:
            raise cannot_see(self.name)

    def result(
        self,
        request: GenerationRequest,
        text: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        logprobs: list[float] | None,
        finish: FinishReason,
        spans: list[tuple[int, int]] | None = None,
    ) -> Generation:
        """Build the final Generation for ``request`` stamped with this engine's identity (and,
        when its tokens came from several weights versions, where each version began)."""
        return Generation(
            request.request_id,
            text,
            prompt_ids,
            completion_ids,
            logprobs,
            finish,
            self.name,
            self.model,
            self._version,
            version_spans=tuple(spans) if spans and len(spans) > 1 else (),
        )
