"""A trivial in-process engine that echoes the prompt back, one "token" per character.

Shipped as a test double and benchmark baseline: it costs almost nothing per token, so
timing the gateway in front of it isolates the gateway's own overhead. An optional
``token_delay_s`` makes generations long enough to abort. Never used to fake a real model
in a test that claims to test one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from rollfleet.engines.base import (
    BaseEngine,
    Delta,
    FinishReason,
    GenerationRequest,
    StreamItem,
    WeightSource,
    message_text,
)


class EchoEngine(BaseEngine):
    """Streams the last user message (or the prompt) back, character by character."""

    name = "echo"

    def __init__(
        self, model: str = "echo", *, token_delay_s: float = 0.0, max_concurrency: int = 8
    ) -> None:
        super().__init__(model)
        self.token_delay_s, self.max_concurrency = token_delay_s, max_concurrency
        self._aborted: dict[str, asyncio.Event] = {}
        self.started = False

    async def start(self) -> None:
        """Nothing to load."""
        self.started = True

    async def stop(self) -> None:
        """Abort everything in flight."""
        await self.abort(None)
        self.started = False

    def _prompt(self, request: GenerationRequest) -> str:
        if request.messages is not None:
            return message_text(request.messages[-1].get("content"))
        if isinstance(request.prompt, str):
            return request.prompt
        return "".join(chr(32 + t % 95) for t in request.prompt or [])

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """Yield one character per step until the echo, ``max_tokens`` or an abort ends it."""
        self.check_images(request)
        text = self._prompt(request)
        prompt_ids = [ord(c) for c in text]
        aborted = self._aborted[request.request_id] = asyncio.Event()
        out: list[int] = []
        reason = FinishReason.STOP
        try:
            for char in text if not request.params.ignore_eos else iter(lambda: "x", None):
                if len(out) >= request.params.max_tokens:
                    reason = FinishReason.LENGTH
                    break
                if self.token_delay_s:
                    try:
                        await asyncio.wait_for(aborted.wait(), self.token_delay_s)
                    except TimeoutError:
                        pass
                if aborted.is_set():
                    reason = FinishReason.ABORT
                    break
                out.append(ord(char))
                yield Delta(char, (ord(char),), (0.0,))
            yield self.result(
                request, "".join(map(chr, out)), prompt_ids, out, [0.0] * len(out), reason
            )
        finally:
            self._aborted.pop(request.request_id, None)

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Abort the named requests (all when None)."""
        ids = (
            list(self._aborted)
            if request_ids is None
            else [r for r in request_ids if r in self._aborted]
        )
        for request_id in ids:
            self._aborted[request_id].set()
        return len(ids)

    @property
    def in_flight(self) -> int:
        """Requests running now."""
        return len(self._aborted)

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Only bumps the version (there are no weights)."""
        return self._next_version(version)
