"""The llama.cpp engine's continuous-batching loop, run by its scheduler thread.

Each loop iteration it admits waiting requests into free sequence slots, drops aborted ones, and
runs ONE ``llama_decode`` over a batch holding the next token of every running sequence plus
prompt chunks of newly admitted ones; then it samples one token per sequence. So N concurrent
rollouts share every pass over the weights, instead of N model copies competing for the same
cores (see docs/engines/llamacpp.md for the measurement behind this choice).

Abort is checked between two decode steps: an aborted request ends at once with the tokens it
has, ``finish_reason="abort"``.

Prefix cache: a finished sequence leaves its tokens in its KV sequence, and a new request goes to
the free sequence holding the longest prefix of its prompt; only the rest is prefilled. Agents
send the same system prompt every time and each turn's prompt extends the last one, so most of a
prompt is usually there already (llama-server's ``cache_prompt``). A conversation whose sequence
a new one takes is copied to host memory first, and copied back on its next turn
(:mod:`~rollfleet.engines.llamacpp.host_cache`, ``host_cache_mb``, on by default). Two more
options, off by default:
``LlamaCppEngine(cached_seqs=N)`` keeps N more KV sequences than run at once, in the same cells:
with no more sequences than rollouts, a rollout whose turn is away (a tool call, a runner that
died and has not resumed yet) loses its cache to the next new conversation, whose turn then
evicts another, and so on; an idle cache is then dropped, least recently used first, when a
running sequence needs its cells. An idle cache is not free, though: in llama.cpp's unified KV
cache every token decoded attends over every cell in use, masked, the idle ones included (16 idle
conversations of ~230 tokens made 16 running ones decode about half as fast, in a one-off
check). With ``idle_tokens=T``, an idle cache is dropped once T tokens have been decoded without
it.

As in llama-server, the logits of a prompt computed partly from the cache differ from a full
prefill in the last bits (other kernels for other batch shapes), so a near-tie can sample
differently; ``prefix_cache=False`` gives bit-identical replays.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rollfleet.engines.base import Delta, FinishReason, GenerationRequest, SamplingParams
from rollfleet.engines.continuation import continued_prompt
from rollfleet.engines.llamacpp.model import LlamaCppModel, TextDecoder, find_stop, sample
from rollfleet.engines.threaded import STOP, Pending
from rollfleet.errors import EngineError

if TYPE_CHECKING:
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine


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
    cells: int = 0  # the KV cells it may grow into: its prompt and max_tokens, at most a context

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
        self.relabelled(version)
        if self.out:
            self.refilled = 0
        else:
            self.prefilled = 0

    def relabelled(self, version: int) -> None:
        """The same weights under a new version: its tokens from the next on say ``version``."""
        if self.out:
            self.spans.append((len(self.out), version))
        else:
            self.spans[-1] = (0, version)


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


class Scheduler:
    """The continuous-batching loop, run by the engine's scheduler thread."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self.engine = engine
        self.waiting: deque[Pending] = deque()
        self.controls: deque[Callable[[], None]] = deque()
        self.running: dict[int, _Seq] = {}
        # every KV sequence not running, least recently used first: the prefix cache's order
        self.free = list(range(self.llm.seqs))
        self.decoded = 0  # tokens run through llama_decode so far
        self.idle_since: dict[int, int] = {}  # a cached sequence -> ``decoded`` when it finished
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
        prefills again under the new weights (the old model's KV cache went with it, or the
        adapter's change dropped it); after a relabel (the same weights, a new version) each goes
        on from its KV cache, its next tokens under the new version."""
        before, llm = self.engine.version, self.llm
        kv = llm.kv_epoch
        call()
        if self.engine.version == before:
            return
        moved = self.engine.llm is not llm or self.llm.kv_epoch != kv
        for seq in self.running.values():
            if moved:
                seq.swapped(self.engine.version)
            else:
                seq.relabelled(self.engine.version)

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
        while self.waiting and len(self.running) < self.engine.max_concurrency:
            pending = self.waiting.popleft()
            try:
                prompt = self._prompt_ids(pending.request)
            except EngineError as exc:
                pending.finish(exc)
                continue
            slot = self.llm.best_slot(self.free, prompt)
            self.free.remove(slot)
            rng = np.random.default_rng(pending.request.params.seed)
            spans = [(0, self.engine.version)]
            cells = min(len(prompt) + pending.request.params.max_tokens, self.engine.ctx_per_seq)
            seq = _Seq(pending, slot, prompt, rng, spans=spans, cells=cells)
            self.running[slot] = seq
            self._make_room()  # first: a conversation restored from host memory needs its cells
            seq.prefilled = self.llm.reuse(slot, prompt) if self.engine.prefix_cache else 0
            self.engine.reused_tokens += seq.prefilled

    def _drop_stale(self) -> None:
        """Drop the idle caches that the engine's ``idle_tokens`` tokens have been decoded
        without (``free`` is in the order they went idle: the first fresh one ends the search)."""
        limit = self.engine.idle_tokens
        if limit is None:
            return
        for slot in self.free:
            if slot in self.llm.cached:
                if self.decoded - self.idle_since.get(slot, 0) <= limit:
                    return
                self.llm.forget(slot)

    def _make_room(self) -> None:
        """Drop idle sequences' caches, least recently used first, until the running sequences
        have the cells they may grow into (each at most ``ctx_per_seq``, so it always fits)."""
        held = {slot: len(self.llm.cached.get(slot, ())) for slot in self.free}
        used = sum(held.values()) + sum(seq.cells for seq in self.running.values())
        for slot in self.free:
            if used <= self.llm.n_cells:
                return
            if held[slot]:
                self.llm.forget(slot)
                used -= held[slot]

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
        self.decoded += len(entries)
        self._drop_stale()
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
        whole = seq.prefilled == len(seq.prompt) and seq.refilled is None
        if error is None and self.engine.prefix_cache and whole:
            # the KV cache holds the prompt and every generated token but (maybe) the last; an
            # aborted call's too (its rollout may go on from it: a runner that died mid-call)
            self.llm.keep(seq.slot, seq.prompt + seq.out[:-1])
            self.idle_since[seq.slot] = self.decoded
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
