"""The alternative llama.cpp design, kept for measurement: several model instances (slots).

Each slot is its own :class:`LlamaCppEngine` with one sequence and its own thread; a request
goes to the slot with the fewest requests. This is what "run N ``Llama`` objects in threads"
amounts to. ``bench/engines.py`` runs it side by side with the batched default; on CPU the
batched engine wins because N slots read the weights N times per token and fight over the
same cores (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from rollfleet.engines.base import (
    BaseEngine,
    EngineInfo,
    GenerationRequest,
    StreamItem,
    WeightSource,
)
from rollfleet.engines.llamacpp.engine import LlamaCppEngine
from rollfleet.engines.llamacpp.model import bundled_gguf


class LlamaCppSlotsEngine(BaseEngine):
    """N independent single-sequence llama.cpp instances, least-busy dispatch."""

    name = "llamacpp-slots"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        slots: int = 4,
        ctx_per_seq: int = 2048,
        threads: int | None = None,
        seqs_per_slot: int = 1,
    ) -> None:
        path = Path(model_path) if model_path else bundled_gguf()
        super().__init__(path.stem)
        cores = threads or max(1, len(os.sched_getaffinity(0)))
        per_slot = max(1, cores // slots)
        self.max_concurrency = slots * seqs_per_slot
        self.slots = [
            LlamaCppEngine(path, slots=seqs_per_slot, ctx_per_seq=ctx_per_seq, threads=per_slot)
            for _ in range(slots)
        ]
        self._owner: dict[str, LlamaCppEngine] = {}

    async def start(self) -> None:
        """Load every slot."""
        await asyncio.gather(*(slot.start() for slot in self.slots))

    async def stop(self) -> None:
        """Stop every slot."""
        await asyncio.gather(*(slot.stop() for slot in self.slots))

    async def health(self) -> bool:
        """True when every slot is healthy."""
        return all(await asyncio.gather(*(slot.health() for slot in self.slots)))

    def info(self) -> EngineInfo:
        """Describe the engine."""
        return EngineInfo(self.name, self.model, self.version, self.max_concurrency, True)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """Run ``request`` on the least busy slot."""
        self.check_images(request)
        slot = min(self.slots, key=lambda s: s.in_flight)
        self._owner[request.request_id] = slot
        try:
            async for item in slot.stream(request):
                yield item
        finally:
            self._owner.pop(request.request_id, None)

    @property
    def in_flight(self) -> int:
        """Requests queued or running across the slots."""
        return sum(slot.in_flight for slot in self.slots)

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Abort on whichever slot holds each request."""
        if request_ids is None:
            return sum(await asyncio.gather(*(slot.abort(None) for slot in self.slots)))
        counts = [await self._owner[r].abort([r]) for r in request_ids if r in self._owner]
        return sum(counts)

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Reload every slot: the first takes ``weights`` (a GGUF path, or tensors it exports as
        one), the others load the file the first now serves."""
        first, *rest = self.slots
        await first.update_weights(weights, version)
        for slot in rest:
            await slot.update_weights(first.path, version)
        return self._next_version(version)
