"""The transformers engine's decoding: one running batch that requests join and leave.

Rows are left-padded into one KV cache and decoded a token at a time. Between two decode
steps the worker runs queued calls (weight swaps), drops the rows that finished (with the
padding no remaining row needs) and admits waiting requests up to ``max_batch``: a newcomer's
prompt is prefilled on its own and its cache left-padded and stacked onto the batch's. So a
request never waits for the longest generation ahead of it, as it did under static batching;
in an RL step the rollouts of a group arrive a few milliseconds apart, and the first used to
run alone while the others queued behind it.

After a weight swap every row's cache is recomputed under the new weights (from its prompt
and the tokens it has so far); a relabel (a step that changed no weight) keeps them. Caches
other than transformers' plain per-layer dynamic cache (sliding windows, static caches, older
releases' tuples) are recomputed instead of spliced when a request joins: slower, same tokens.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rollfleet.engines.base import Delta, FinishReason
from rollfleet.engines.llamacpp.model import find_stop, sample
from rollfleet.engines.threaded import Pending
from rollfleet.errors import EngineError, RollfleetError

if TYPE_CHECKING:
    from rollfleet.engines.hf.engine import HFEngine

log = logging.getLogger("rollfleet.engines")


def forward_keywords(model: Any) -> tuple[str, bool]:
    """The keyword ``model.forward`` takes its KV cache by (transformers 5.2x renamed
    ``past_key_values`` to ``cache``; older releases know only the old name), and whether it
    can compute the logits of the last position alone (``logits_to_keep``)."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def output_cache(out: Any) -> Any:
    """The KV cache a forward pass returned (``cache`` on 5.2x outputs, else the old name)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


class Row:
    """One request inside the running batch."""

    def __init__(self, pending: Pending, prompt: list[int], extra: Any, version: int) -> None:
        self.pending, self.prompt, self.extra = pending, prompt, extra
        self.spans = [(0, version)]  # (first token, weights version) of each run of tokens
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.done = False
        self.rng = np.random.default_rng(pending.request.params.seed)


@dataclass
class State:
    """The batch's tensors between two steps: each row's next-token logits, the KV cache,
    the attention mask over the cached positions and each row's last position."""

    logits: Any  # (rows, vocab)
    cache: Any
    mask: Any  # (rows, cached positions): 0 on left padding
    position: Any  # (rows, 1)


def _layers(cache: Any) -> list[Any] | None:
    """The cache's per-layer key/value holders when rows can be spliced in and out (plain
    dynamic layers); None for any other kind."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return list(layers)


def select_rows(state: State, keep: list[int]) -> State:
    """``state`` with only the rows at ``keep``, and without the leading positions that are
    padding in all of them (a dynamic cache only: the caller checked)."""
    import torch

    index = torch.tensor(keep, device=state.mask.device)
    mask = state.mask.index_select(0, index)
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else 0
    for layer in _layers(state.cache) or []:
        layer.keys = layer.keys.index_select(0, index)[..., start:, :]
        layer.values = layer.values.index_select(0, index)[..., start:, :]
    return State(
        state.logits.index_select(0, index),
        state.cache,
        mask[:, start:],
        state.position.index_select(0, index),
    )


def stack_rows(first: State, second: State) -> State:
    """One state holding the rows of both, each left-padded to the longer cache."""
    import torch
    import torch.nn.functional as F

    width = max(first.mask.shape[1], second.mask.shape[1])

    def padded(tensor: Any, dim_from_end: int) -> Any:
        missing = width - tensor.shape[-dim_from_end]
        if not missing:
            return tensor
        return F.pad(tensor, (0, 0) * (dim_from_end - 1) + (missing, 0))

    for mine, theirs in zip(_layers(first.cache) or [], _layers(second.cache) or [], strict=True):
        mine.keys = torch.cat([padded(mine.keys, 2), padded(theirs.keys, 2)])
        mine.values = torch.cat([padded(mine.values, 2), padded(theirs.values, 2)])
    return State(
        torch.cat([first.logits, second.logits]),
        first.cache,
        torch.cat([padded(first.mask, 1), padded(second.mask, 1)]),
        torch.cat([first.position, second.position]),
    )


class DecodeBatch:
    """Left-padded batch decoding with per-row abort, stop strings and EOS, which waiting
    requests join between two steps and finished rows leave."""

    def __init__(self, engine: HFEngine, pendings: list[Pending]) -> None:
        self.engine = engine
        self.cache_keyword, self.last_logits_only = forward_keywords(engine.hf_model)
        self.rows = self.admit(pendings)
        self.eos = engine.end_ids()

    def admit(self, pendings: list[Pending]) -> list[Row]:
        """Rows for ``pendings``; one aborted, refused or asking for no tokens ends at once."""
        rows = []
        for pending in pendings:
            if pending.aborted.is_set():
                pending.finish(
                    self.engine.result(pending.request, "", [], [], [], FinishReason.ABORT)
                )
                continue
            try:
                prompt, extra = self.engine.prepare(pending.request)
            except RollfleetError as exc:  # a refused image: the caller's own error
                pending.finish(exc)
                continue
            except Exception as exc:  # a bad prompt fails its own request only
                pending.finish(EngineError(f"hf: cannot tokenize the prompt: {exc}"))
                continue
            row = Row(pending, prompt, extra, self.engine.version)
            if pending.request.params.max_tokens <= 0:
                self._finish(row, FinishReason.LENGTH)
                continue
            rows.append(row)
        return rows

    def run(self) -> None:
        """Decode until no row is left and no waiting request fits."""
        import torch

        with torch.inference_mode():
            state = self._prefill(self.rows) if self.rows else None
            while state is not None:
                tokens = self._sample(state.logits.float().cpu().numpy())
                swapped, joined = self._between_steps()
                keep = [i for i, row in enumerate(self.rows) if not row.done]
                live = [self.rows[i] for i in keep]
                if swapped or (joined and _layers(state.cache) is None):
                    self.rows = live + joined  # recompute every cache under the live weights
                    state = self._prefill(self.rows) if self.rows else None
                    continue
                if live and len(keep) < len(self.rows) and _layers(state.cache) is not None:
                    state = select_rows(state, keep)
                    tokens = [tokens[i] for i in keep]
                elif not live:
                    state = None
                else:
                    live = self.rows  # an unsplicable cache keeps its finished rows to the end
                self.rows = live
                if state is not None:
                    state = self._decode(state, tokens)
                if joined:
                    fresh = self._prefill(joined)
                    state = fresh if state is None else stack_rows(state, fresh)
                    self.rows = self.rows + joined

    def fail(self, error: BaseException) -> None:
        """End every row still running with ``error`` (the model raised)."""
        for row in self.rows:
            row.pending.finish(error)

    def _between_steps(self) -> tuple[bool, list[Row]]:
        """Run the queued calls (weight swaps, when the engine is interruptible) and take in
        the waiting requests that fit, in order. A call that must wait for the batch's end, or
        a stop, holds back everything behind it. Returns (weights changed, joined rows): a
        relabel (a new version of the same weights) marks where the version changed in each
        running row but keeps their caches."""
        engine = self.engine
        before, epoch = engine.version, engine.weights_epoch
        while (item := engine.next_nowait()) is not None:
            engine.held.append(item)
        room = engine.max_concurrency - sum(not row.done for row in self.rows)
        pendings: list[Pending] = []
        kept: list[Any] = []
        barrier = False
        for item in engine.held:
            if not barrier and isinstance(item, Pending) and len(pendings) < room:
                pendings.append(item)
            elif not barrier and callable(item) and engine.interruptible:
                item()
            else:
                barrier = barrier or not isinstance(item, Pending)
                kept.append(item)
        engine.held = kept
        if engine.version != before:
            for row in self.rows:
                if not row.done:
                    row.spans.append((len(row.out), engine.version))
        return engine.weights_epoch != epoch, self.admit(pendings)

    def _prefill(self, rows: list[Row]) -> State:
        """Prefill each row's prompt and tokens so far under the live weights, left-padded."""
        import torch

        model, device = self.engine.hf_model, self.engine.device
        seqs = [row.prompt + row.out for row in rows]
        width = max(len(seq) for seq in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq) :] = torch.tensor(seq)
            mask[i, width - len(seq) :] = 1
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = self.engine.prefill_inputs(model, ids, [row.extra for row in rows])
        if self.last_logits_only:
            inputs["logits_to_keep"] = 1  # not (rows, width, vocab) floats for one column
        out = model(**inputs, attention_mask=mask, position_ids=position, use_cache=True)
        return State(out.logits[:, -1, :], output_cache(out), mask, position[:, -1:])

    def _decode(self, state: State, tokens: list[int]) -> State:
        """One decode step: feed each row's sampled token."""
        import torch

        model, device = self.engine.hf_model, self.engine.device
        mask = torch.cat([state.mask, torch.ones_like(state.mask[:, :1])], dim=1)
        position = state.position + 1
        out = model(
            input_ids=torch.tensor(tokens, device=device)[:, None],
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            **{self.cache_keyword: state.cache},
        )
        return State(out.logits[:, -1, :], output_cache(out), mask, position)

    def _sample(self, logits: np.ndarray) -> list[int]:
        tokens = []
        for row, row_logits in zip(self.rows, logits, strict=True):
            token = 0
            if not row.done:
                token = self._advance(row, row_logits)
            tokens.append(token)
        return tokens

    def _advance(self, row: Row, logits: np.ndarray) -> int:
        params = row.pending.request.params
        if row.pending.aborted.is_set():
            self._finish(row, FinishReason.ABORT)
            return 0
        token, logprob = sample(logits, params, row.rng)
        if token in self.eos and not params.ignore_eos:  # the stop is an action: kept, trained
            row.out.append(token)
            row.logprobs.append(logprob)
            row.pending.emit(Delta("", (token,), (logprob,)))
            self._finish(row, FinishReason.STOP)
            return token
        row.out.append(token)
        row.logprobs.append(logprob)
        text = self.engine.tokenizer.decode(row.out, skip_special_tokens=True)
        new, row.text = text[len(row.text) :], text
        cut = find_stop(row.text, params.stop)
        if cut >= 0:
            row.text = row.text[:cut]
            self._finish(row, FinishReason.STOP)
        else:
            row.pending.emit(Delta(new, (token,), (logprob,)))
            if len(row.out) >= params.max_tokens:
                self._finish(row, FinishReason.LENGTH)
        return token

    def _finish(self, row: Row, reason: FinishReason) -> None:
        row.done = True
        row.pending.finish(
            self.engine.result(
                row.pending.request,
                row.text,
                row.prompt,
                row.out,
                row.logprobs,
                reason,
                row.spans,
            )
        )
