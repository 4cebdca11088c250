"""The default CPU engine: llama.cpp with continuous batching on one model and one context.

One scheduler thread owns the llama.cpp context (llama.cpp objects are not thread-safe).
Each loop iteration it admits waiting requests into free sequence slots, drops aborted
ones, and runs ONE ``llama_decode`` over a batch holding the next token of every running
sequence plus prompt chunks of newly admitted ones; then it samples one token per sequence.
So N concurrent rollouts share every pass over the weights, instead of N model copies
competing for the same cores (see docs/engines/llamacpp.md for the measurement behind this choice).

Abort is checked between two decode steps: an aborted request ends at once with the tokens
it has, ``finish_reason="abort"``.

Weight updates are interruptible: the new model is loaded between two decode steps, and every
running sequence prefills its prompt and tokens so far again under it (the old KV cache went with
the old model), then goes on decoding; its result's ``version_spans`` say where the version
changed. ``interruptible=False`` makes a swap wait until the running requests end.

Quantization: a GGUF in a type whose CPU kernels batch badly (Q4_1, Q5_0, Q5_1, the bundled
model's Q4_1 among them) is served from a Q8_0 copy made once and cached
(:func:`~rollfleet.engines.llamacpp.model.batch_friendly`): 8 sequences decode 1.44x faster,
one sequence as fast. ``batch_quant=False`` serves the file as it is.

Prefix cache: a finished sequence leaves its tokens in its slot's KV cache, and a new request goes
to the free slot holding the longest prefix of its prompt; only the rest is prefilled. Agents send
the same system prompt every time and each turn's prompt extends the last one, so most of a
prompt is usually there already (llama-server's ``cache_prompt``). As there, the logits of a
prompt computed partly from the cache differ from a full prefill in the last bits (other kernels
for other batch shapes), so a near-tie can sample differently; ``prefix_cache=False`` gives
bit-identical replays.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollfleet.engines.base import (
    Delta,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    WeightSource,
)
from rollfleet.engines.continuation import continued_prompt
from rollfleet.engines.llamacpp.model import (
    LlamaCppModel,
    TextDecoder,
    batch_friendly,
    bundled_gguf,
    find_stop,
    gguf_cache_dir,
    sample,
)
from rollfleet.engines.threaded import STOP, Pending, ThreadedEngine
from rollfleet.engines.weights.gguf_export import (
    WeightUpdate,
    check_out_type,
    read_base,
    weights_gguf,
)
from rollfleet.engines.weights.lora import LoraAdapter, write_adapter_gguf
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")


@dataclass
class _Seq:
    """One running request inside the scheduler."""

    pending: Pending
    slot: int
    prompt: list[int]
    rng: np.random.Generator
    prefilled: int = 0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    decoder: TextDecoder = field(default_factory=TextDecoder)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first token, weights version)
    refilled: int | None = None  # after a swap: how much of prompt + out the new cache holds

    @property
    def position(self) -> int:
        """Number of tokens already in this sequence's KV cache."""
        return self.prefilled + max(len(self.out) - 1, 0)

    @property
    def decoding(self) -> bool:
        """True when the next step feeds this sequence's last token (no prefill left)."""
        return bool(self.out) and self.refilled is None

    def swapped(self, version: int) -> None:
        """New weights: the KV cache is gone; prefill again, prompt and tokens so far."""
        if self.out:
            self.refilled = 0
            self.spans.append((len(self.out), version))
        else:
            self.prefilled = 0
            self.spans[-1] = (0, version)


class LlamaCppEngine(ThreadedEngine):
    """llama.cpp on CPU with continuous batching; the rollfleet default engine."""

    name = "llamacpp"
    adapters = True

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        slots: int = 8,
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
                self.threads,
                self.n_batch,
                self.verbose,
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
        sched = _Scheduler(self)
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


EOG, STOP_STRING = "eog", "stop string"  # how a sampled token can end a reply


def prompt_ids(llm: Any, request: GenerationRequest) -> list[int]:
    """The prompt ids the engine runs ``request`` with: a chat continued token-in from its
    ``prior`` call where that holds, else rendered by the chat template and tokenized; a text
    prompt tokenized; token ids as they are (``llm``: a LlamaCppModel, or its vocabulary)."""
    if request.messages is not None:
        return continued_prompt(llm, request.prior, request.messages, request.tools) or (
            llm.tokenize(llm.template.render(request.messages, True, request.tools))
        )
    if isinstance(request.prompt, str):
        return list(llm.tokenize(request.prompt))
    return list(request.prompt or [])


def read_token(
    llm: Any, decoder: TextDecoder, token: int, params: SamplingParams
) -> tuple[str, str | None]:
    """What a sampled token does to its reply: ``(the text it adds, why the reply ends)``, the
    end :data:`EOG` for an end-of-generation token (kept as the reply's last token, adding no
    text), :data:`STOP_STRING` when the text now holds a stop string (cut before it), else
    None."""
    if llm.is_eog(token) and not params.ignore_eos:
        return "", EOG
    new_text = decoder.feed(llm.piece(token))
    cut = find_stop(decoder.text, params.stop)
    if cut >= 0:
        decoder.text = decoder.text[:cut]
        return new_text, STOP_STRING
    return new_text, None


class _Scheduler:
    """The continuous-batching loop, run by the engine's scheduler thread."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self.waiting: deque[Pending] = deque()
        self.controls: deque[Callable[[], None]] = deque()
        self.running: dict[int, _Seq] = {}
        self.free = list(range(engine.max_concurrency))[::-1]
        self.stopping = False

    def loop(self) -> None:
        """Step until stopped."""
        while not self.stopping:
            self._take_inbox(block=not (self.running or self.waiting or self.controls))
            self._drop_aborted()
            if self.controls and (self.engine.interruptible or not self.running):
                self._control(self.controls.popleft())
                continue
            if not self.controls:
                self._admit()
            if self.running:
                self._step()

    def _control(self, call: Callable[[], None]) -> None:
        """Run a call for the worker between two steps; after a swap every running sequence
        prefills again under the new weights (the old model's KV cache went with it)."""
        before = self.engine.version
        call()
        if self.engine.version != before:
            for seq in self.running.values():
                seq.swapped(self.engine.version)

    @property
    def llm(self) -> LlamaCppModel:
        """The engine's current model (a weight update swaps it)."""
        assert self.engine.llm is not None
        return self.engine.llm

    def _take_inbox(self, block: bool) -> None:
        inbox = self.engine.inbox
        try:
            item = inbox.get() if block else inbox.get_nowait()
            while True:
                if item is STOP:
                    self.stopping = True
                elif isinstance(item, Pending):
                    self.waiting.append(item)
                else:
                    self.controls.append(item)
                item = inbox.get_nowait()
        except queue.Empty:
            return

    def _drop_aborted(self) -> None:
        for pending in [p for p in self.waiting if p.aborted.is_set()]:
            self.waiting.remove(pending)
            pending.finish(self.engine.result(pending.request, "", [], [], [], FinishReason.ABORT))
        for seq in [s for s in self.running.values() if s.pending.aborted.is_set()]:
            self._finish(seq, FinishReason.ABORT)

    def _admit(self) -> None:
        while self.waiting and self.free:
            pending = self.waiting.popleft()
            try:
                prompt = self._prompt_ids(pending.request)
            except EngineError as exc:
                pending.finish(exc)
                continue
            slot = self.llm.best_slot(self.free, prompt)
            self.free.remove(slot)
            rng = np.random.default_rng(pending.request.params.seed)
            kept = self.llm.reuse(slot, prompt) if self.engine.prefix_cache else 0
            self.engine.reused_tokens += kept
            spans = [(0, self.engine.version)]
            self.running[slot] = _Seq(pending, slot, prompt, rng, prefilled=kept, spans=spans)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        assert self.llm is not None
        ids = prompt_ids(self.llm, request)
        if not ids or len(ids) >= self.engine.ctx_per_seq:
            raise EngineError(
                f"llamacpp: prompt of {len(ids)} tokens does not fit the context of"
                f" {self.engine.ctx_per_seq} tokens per sequence"
            )
        return ids

    def _step(self) -> None:
        entries: list[tuple[int, int, int, bool]] = []
        sampled: list[tuple[_Seq, int]] = []
        budget = self.engine.n_batch
        for seq in self.running.values():  # decoding sequences first: one token each
            if seq.decoding and budget:
                entries.append((seq.out[-1], seq.position, seq.slot, True))
                sampled.append((seq, len(entries) - 1))
                budget -= 1
        for seq in self.running.values():  # then sequences refilling after a swap
            if seq.refilled is not None and budget:
                budget -= self._refill(seq, entries, sampled, budget)
        for seq in self.running.values():  # then prompt chunks, as the budget allows
            if not seq.out and budget:
                chunk = seq.prompt[seq.prefilled : seq.prefilled + budget]
                for k, token in enumerate(chunk):
                    last = seq.prefilled + k == len(seq.prompt) - 1
                    entries.append((token, seq.prefilled + k, seq.slot, last))
                seq.prefilled += len(chunk)
                budget -= len(chunk)
                if seq.prefilled == len(seq.prompt):
                    sampled.append((seq, len(entries) - 1))
        try:
            self.llm.decode(entries)
        except EngineError as exc:
            for seq in list(self.running.values()):
                self._finish(seq, FinishReason.ABORT, error=exc)
            return
        for seq, index in sampled:
            self._advance(seq, index)

    @staticmethod
    def _refill(
        seq: _Seq,
        entries: list[tuple[int, int, int, bool]],
        sampled: list[tuple[_Seq, int]],
        budget: int,
    ) -> int:
        """Add the next chunk of a swapped sequence's prompt and tokens so far; once all are in,
        its next token is sampled from the new weights. Returns the entries added."""
        assert seq.refilled is not None
        tokens = seq.prompt + seq.out
        chunk = tokens[seq.refilled : seq.refilled + budget]
        for k, token in enumerate(chunk):
            at = seq.refilled + k
            entries.append((token, at, seq.slot, at == len(tokens) - 1))
        seq.refilled += len(chunk)
        if seq.refilled == len(tokens):
            seq.refilled = None
            sampled.append((seq, len(entries) - 1))
        return len(chunk)

    def _advance(self, seq: _Seq, index: int) -> None:
        params = seq.pending.request.params
        token, logprob = sample(self.llm.logits(index), params, seq.rng)
        if self.engine.first_token_at is None:
            self.engine.first_token_at = time.monotonic()
        seq.out.append(token)
        seq.logprobs.append(logprob)
        new_text, end = read_token(self.llm, seq.decoder, token, params)
        if end == EOG:  # the stop is an action: kept
            seq.pending.emit(Delta("", (token,), (logprob,)))
            self._finish(seq, FinishReason.STOP)
            return
        if end == STOP_STRING:
            self._finish(seq, FinishReason.STOP)
            return
        seq.pending.emit(Delta(new_text, (token,), (logprob,)))
        room = self.engine.ctx_per_seq - len(seq.prompt) - 1
        if len(seq.out) >= min(params.max_tokens, room):
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: _Seq, reason: FinishReason, error: Exception | None = None) -> None:
        self.running.pop(seq.slot, None)
        done = error is None and reason is not FinishReason.ABORT
        whole = seq.prefilled == len(seq.prompt) and seq.refilled is None
        if done and self.engine.prefix_cache and whole:
            # the KV cache holds the prompt and every generated token but (maybe) the last
            self.llm.keep(seq.slot, seq.prompt + seq.out[:-1])
        else:
            self.llm.forget(seq.slot)
        self.free.append(seq.slot)
        if error is not None:
            seq.pending.finish(error)
            return
        request, text = seq.pending.request, seq.decoder.text
        seq.pending.finish(
            self.engine.result(request, text, seq.prompt, seq.out, seq.logprobs, reason, seq.spans)
        )

    def abort_all(self) -> None:
        """End everything still queued or running (at stop)."""
        for seq in list(self.running.values()):
            self._finish(seq, FinishReason.ABORT)
        for pending in self.waiting:
            pending.finish(self.engine.result(pending.request, "", [], [], [], FinishReason.ABORT))
        self.waiting.clear()
