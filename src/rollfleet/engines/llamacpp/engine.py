"""The default CPU engine: llama.cpp with continuous batching on one model and one context.

One scheduler thread owns the llama.cpp context (llama.cpp objects are not thread-safe) and runs
the batching loop of :mod:`~rollfleet.engines.llamacpp.scheduler`: every running sequence shares
each pass over the weights, and a prefix cache keeps finished conversations for their next turn.

Weight updates are interruptible: the new model is loaded between two decode steps, and every
running sequence prefills its prompt and tokens so far again under it (the old KV cache went with
the old model), then goes on decoding; its result's ``version_spans`` say where the version
changed. ``interruptible=False`` makes a swap wait until the running requests end.

Quantization: a GGUF in a type whose CPU kernels batch badly (Q4_1, Q5_0, Q5_1, the bundled
model's Q4_1 among them) is served from a Q8_0 copy made once and cached
(:func:`~rollfleet.engines.llamacpp.model.batch_friendly`): 8 sequences decode 1.44x faster,
one sequence as fast. ``batch_quant=False`` serves the file as it is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from rollfleet.engines.base import WeightSource
from rollfleet.engines.llamacpp.model import (
    LlamaCppModel,
    batch_friendly,
    bundled_gguf,
    gguf_cache_dir,
)
from rollfleet.engines.llamacpp.scheduler import Scheduler
from rollfleet.engines.threaded import ThreadedEngine
from rollfleet.engines.weights.gguf_export import (
    WeightUpdate,
    check_out_type,
    read_base,
    weights_gguf,
)
from rollfleet.engines.weights.lora import LoraAdapter, write_adapter_gguf
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")


class LlamaCppEngine(ThreadedEngine):
    """llama.cpp on CPU with continuous batching; the rollfleet default engine."""

    name = "llamacpp"
    adapters = True

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        slots: int = 8,
        cached_seqs: int = 0,
        idle_tokens: int | None = None,
        host_cache_mb: int = 512,
        ctx_per_seq: int = 2048,
        threads: int | None = None,
        n_batch: int = 512,
        prefix_cache: bool = True,
        batch_quant: bool = True,
        export_type: str = "f16",
        cache_dir: str | Path | None = None,
        interruptible: bool = True,
        verbose: bool = False,
    ) -> None:
        self.path = Path(model_path) if model_path else bundled_gguf()
        self.prefix_cache, self.batch_quant = prefix_cache, batch_quant
        self.interruptible = interruptible  # False: a swap waits for running requests to end
        self.export_type = check_out_type(export_type)  # of tensor updates: f16 or q8_0
        self.cache_dir = Path(cache_dir or gguf_cache_dir())
        self._exported: Path | None = None  # the GGUF written for the last tensor update
        self.last_update: WeightUpdate | None = None
        super().__init__(self.path.stem)
        self.max_concurrency = slots
        # the prefix cache's options (rollfleet.engines.llamacpp.scheduler): KV sequences beyond
        # the running ones (in the same cells), and tokens decoded before an idle cache is dropped
        self.cached_seqs, self.idle_tokens = cached_seqs, idle_tokens
        # conversations dropped from the cells, kept in host memory (.host_cache); 0: none kept
        self.host_cache_mb = max(0, host_cache_mb)
        self.ctx_per_seq, self.n_batch, self.verbose = ctx_per_seq, n_batch, verbose
        self.threads = threads or max(1, len(os.sched_getaffinity(0)))
        self.llm: LlamaCppModel | None = None
        self.served = self.path  # the file loaded: ``path`` or its batch-friendly copy
        self.reused_tokens = 0  # prompt tokens found in the prefix cache, not prefilled again
        self.first_token_at: float | None = None  # time.monotonic() of the first token sampled

    async def start(self) -> None:
        """Load the model and start the scheduler thread."""
        if self._thread is not None:
            return
        self.llm = await asyncio.to_thread(self._load, self.path)
        self.start_worker()
        log.info(
            "llamacpp: serving %s (slots=%d, ctx/seq=%d, threads=%d)",
            self.model_file,
            self.max_concurrency,
            self.ctx_per_seq,
            self.threads,
        )

    @property
    def model_file(self) -> str:
        """The GGUF's name, and the copy actually served when it is a converted one."""
        if self.served == self.path:
            return self.path.name
        return f"{self.path.name} (served as Q8_0)"

    def _load(self, path: Path) -> LlamaCppModel:
        self.served = batch_friendly(path, self.cache_dir) if self.batch_quant else path
        try:
            return LlamaCppModel(
                self.served,
                self.max_concurrency,
                self.ctx_per_seq,
                self.cached_seqs,
                self.threads,
                self.n_batch,
                self.verbose,
                self.host_cache_mb << 20,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise EngineError(f"llamacpp: cannot load {path}: {exc}") from exc

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Serve new weights: a GGUF path, or named tensors (transformers Llama names, torch or
        numpy) written as a GGUF first (:mod:`~rollfleet.engines.weights.gguf_export`) while
        generation goes on; then the model is swapped between two decode steps and running
        requests go on: their KV cache is prefilled again under the new weights and each result
        says where the version changed (``interruptible=False``: the swap waits for them to
        finish).

        Bad tensors raise EngineError naming the tensor, and the old weights keep serving.
        Measured for SmolLM2-135M's state_dict on 2 shared cores: export 1.0-2.3 s (f16 or q8_0;
        the first 4 s), generation slowed meanwhile; generation stopped 0.34-0.39 s for the swap,
        0.43-0.48 s between two tokens (docs/engines/llamacpp.md, "Weights into llama.cpp").
        """
        if isinstance(weights, LoraAdapter):
            return await self._update_adapter(weights, version)
        started = time.perf_counter()
        path, exported = await weights_gguf(
            weights, self.path, self.cache_dir / "weights", self.export_type, self.model
        )
        asked = time.perf_counter()

        def swap() -> tuple[float, int]:  # on the scheduler thread, between two decode steps
            begun = time.perf_counter()
            try:
                new = self._load(path)
            except EngineError:
                if exported:
                    path.unlink(missing_ok=True)
                raise
            assert self.llm is not None
            self.llm.close()
            self.llm, self.path, previous = new, path, self._exported
            self._exported = path if exported or path == previous else None
            if previous is not None and previous != path:
                previous.unlink(missing_ok=True)  # our previous export, served no more
            return begun, self._next_version(version)  # before the next token is sampled

        begun, new = await self.on_worker(swap)
        done = time.perf_counter()
        self.last_update = WeightUpdate(path, asked - started, begun - asked, done - begun)
        log.info("llamacpp: weights version %d from %s (%s)", new, path, self.last_update)
        return new

    async def _update_adapter(self, adapter: LoraAdapter, version: int | None) -> int:
        """Apply a LoRA adapter to the base model (:mod:`~rollfleet.engines.weights.lora`):
        written as a GGUF adapter while generation goes on, set between two decode steps, running
        requests prefilled again under it. It replaces the adapter served before; an engine
        serving pushed weights refuses it (they are not the base the adapter was trained on)."""
        if self._exported is not None:
            raise EngineError(
                f"llamacpp: a LoRA adapter applies to the base model, but this engine serves "
                f"pushed weights (version {self.version}); push merged weights instead"
            )
        started = time.perf_counter()
        target = self.cache_dir / "adapters" / f"{self.model}-{os.getpid()}-{id(adapter)}.gguf"
        target.parent.mkdir(parents=True, exist_ok=True)
        base = await asyncio.to_thread(read_base, self.served)
        try:
            await asyncio.to_thread(write_adapter_gguf, base, adapter, target)
        except Exception:
            target.unlink(missing_ok=True)
            raise
        asked = time.perf_counter()

        def swap() -> tuple[float, int]:  # on the scheduler thread, between two decode steps
            begun = time.perf_counter()
            assert self.llm is not None
            try:
                self.llm.set_adapter(target)
            finally:
                target.unlink(missing_ok=True)  # llama.cpp read it whole
            return begun, self._next_version(version)

        begun, new = await self.on_worker(swap)
        done = time.perf_counter()
        self.last_update = WeightUpdate(target, asked - started, begun - asked, done - begun)
        log.info("llamacpp: weights version %d: LoRA adapter (%s)", new, self.last_update)
        return new

    def work(self) -> None:
        """The scheduler thread: run the batching loop, fail requests loudly on a crash."""
        assert self.llm is not None
        sched = Scheduler(self)
        try:
            sched.loop()
        except Exception as exc:  # a scheduler bug must fail requests, never hang them
            log.exception("llamacpp: scheduler crashed")
            self.registry.fail(EngineError(f"llamacpp: scheduler crashed: {exc!r}"))
            raise
        finally:
            sched.abort_all()
            if self.llm is not None:
                self.llm.close()
                self.llm = None
