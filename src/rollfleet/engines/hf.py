"""Hugging Face transformers engine (CPU or GPU), batched, with double-buffered weight updates.

One worker thread owns the model. It takes up to ``max_batch`` waiting requests, left-pads
them into one batch and decodes token by token with the KV cache, checking each row's abort
flag between tokens. Weight updates are copied into a second copy of the model (the standby)
while generation goes on, and the worker swaps the two between two decode steps, so no
generation ever sees half-updated weights and decoding stops only for the swap (and the KV
recompute of running rows). ``double_buffer=False`` copies into the live parameters in place
on the worker instead (half the memory, generation stopped for the whole copy).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import queue
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from rollfleet.engines.base import (
    Delta,
    FinishReason,
    GenerationRequest,
    NamedTensors,
    WeightSource,
    message_text,
)
from rollfleet.engines.buckets import DEFAULT_BUCKET_BYTES
from rollfleet.engines.llamacpp_model import find_stop, sample
from rollfleet.engines.threaded import STOP, Pending, ThreadedEngine
from rollfleet.engines.tiny import tiny_hf_model as tiny_hf_model  # re-exported: its old home
from rollfleet.errors import EngineError, RollfleetError

log = logging.getLogger("rollfleet.engines")


def _cache_of(model: Any, out: Any) -> dict[str, Any]:
    """The KV cache of ``out`` as the keyword ``model`` takes it: transformers 5.2x renamed
    ``past_key_values`` to ``cache`` (on the output too); older releases know only the old name."""
    params = inspect.signature(model.forward).parameters
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


class HFEngine(ThreadedEngine):
    """transformers model served from one worker thread with static batching."""

    name = "hf"

    def __init__(
        self,
        model: str | Any,
        tokenizer: Any | None = None,
        *,
        max_batch: int = 8,
        device: str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        local_files_only: bool = True,
        interruptible: bool = True,
        double_buffer: bool = True,
    ) -> None:
        super().__init__(model if isinstance(model, str) else type(model).__name__)
        self._source, self._tokenizer_source = model, tokenizer
        self.max_concurrency, self.device, self.bucket_bytes = max_batch, device, bucket_bytes
        self.local_files_only = local_files_only
        self.hf_model: Any = None
        self.tokenizer: Any = None
        self.held: list[Any] = []  # inbox items that arrived during a batch (worker thread only)
        self.interruptible = interruptible  # False: a swap waits for the running batch to end
        self.double_buffer = double_buffer  # False: updates copy into the live model in place
        self.standby: Any = None  # the second copy of the model, made on the first update
        self.stale: set[str] = set()  # tensors whose standby values lag the live model's
        self.last_pause_s: float | None = None  # the worker's time in the last update
        self._updating = asyncio.Lock()  # one update at a time: they share the standby

    async def start(self) -> None:
        """Load the model (from a path/name or the given object) and start the worker thread."""
        if self._thread is not None:
            return
        await asyncio.to_thread(self._load)
        self.start_worker()
        log.info(
            "hf: serving %s on %s (max_batch=%d)", self.model, self.device, self.max_concurrency
        )

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            if isinstance(self._source, str):
                self.hf_model = AutoModelForCausalLM.from_pretrained(
                    self._source, local_files_only=self.local_files_only
                )
            else:
                self.hf_model = self._source
            tok = self._tokenizer_source or self._source
            self.tokenizer = (
                AutoTokenizer.from_pretrained(tok, local_files_only=self.local_files_only)
                if isinstance(tok, str)
                else tok
            )
        except (OSError, ValueError) as exc:
            raise EngineError(f"hf: cannot load model {self.model!r}: {exc}") from exc
        self.hf_model.to(self.device).eval()

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Install new tensors (or a safetensors checkpoint) between two decode steps. Running
        requests are not stopped: their KV cache is recomputed under the new weights and they
        go on; each result says where the version changed. Named tensors name every parameter;
        a :class:`~rollfleet.engines.base.WeightsDelta` only those that changed since its base
        version, which must be the one this engine serves (Conflict); a checkpoint is loaded
        as it is. Every tensor is checked before anything changes: a refused update changes
        nothing. ``last_pause_s`` is then how long the worker stopped generating for it.

        With ``double_buffer`` the tensors go into the standby copy while generation goes on
        and the worker only swaps the two models; an update that has started runs to its end
        even if its caller is cancelled (the standby is never left half-written)."""
        from rollfleet.engines.base import WeightsDelta

        tensors = _safetensors(Path(weights)) if isinstance(weights, (str, Path)) else weights
        base = weights.base if isinstance(weights, WeightsDelta) else None
        complete = base is None and not isinstance(weights, (str, Path))
        if self.double_buffer:
            task = asyncio.ensure_future(self._swap_in(tensors, base, complete, version))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen if orphaned
            count, new = await asyncio.shield(task)
        else:
            in_place = partial(self._in_place, tensors, base, complete, version)
            count, new = await self.on_worker(in_place)
        log.info("hf: loaded %d tensors, weights version %d", count, new)
        return new

    def _in_place(
        self, tensors: NamedTensors, base: int | None, complete: bool, version: int | None
    ) -> tuple[int, int]:
        """On the worker: check, then copy into the live model (no step sees half of it)."""
        started = time.perf_counter()
        self._check_base(base)
        count = self._copy(self.hf_model, self._checked(tensors, complete))
        new = self._next_version(version)
        self.last_pause_s = time.perf_counter() - started
        return count, new

    async def _swap_in(
        self, tensors: NamedTensors, base: int | None, complete: bool, version: int | None
    ) -> tuple[int, int]:
        """Check, fill the standby off the worker, then swap the models on the worker."""
        async with self._updating:
            if self._thread is None or not self._thread.is_alive():
                raise EngineError(f"{self.name}: engine is not started")
            self._check_base(base)
            pairs = await asyncio.to_thread(self._checked, tensors, complete)
            if self.standby is None:  # tied parameters stay tied: deepcopy keeps the sharing
                self.standby = await asyncio.to_thread(copy.deepcopy, self.hf_model)
                self.stale = set()
            sent = {name for name, _ in pairs}
            try:
                await asyncio.to_thread(self._fill_standby, pairs)
                new = await self.on_worker(partial(self._swap, base, version, sent))
            except BaseException:
                self.stale |= sent  # the standby may hold some of them: bring it back next time
                raise
            return len(pairs), new

    def _fill_standby(self, pairs: list[tuple[str, Any]]) -> None:
        """Off the worker: bring the tensors the last update changed up to date in the standby
        (from the live model, which only the worker reads), then copy the new ones in."""
        import torch

        live = self.hf_model.state_dict(keep_vars=True)
        standby = self.standby.state_dict(keep_vars=True)
        lagging = self.stale - {name for name, _ in pairs}  # those sent now are overwritten
        with torch.no_grad():
            for name in sorted(lagging):
                standby[name].copy_(live[name])
        self.stale -= lagging
        self._copy(self.standby, pairs)

    def _swap(self, base: int | None, version: int | None, sent: set[str]) -> int:
        """On the worker, between two decode steps: the standby becomes the live model."""
        started = time.perf_counter()
        self._check_base(base)
        new = self._next_version(version)
        self.hf_model, self.standby = self.standby, self.hf_model
        self.stale = sent  # the old live model, now the standby, lacks just these
        self.last_pause_s = time.perf_counter() - started
        return new

    def _check_base(self, base: int | None) -> None:
        from rollfleet.errors import Conflict

        if base is not None and base != self.version:
            raise Conflict(
                f"hf: weights delta computed against version {base},"
                f" this engine serves {self.version}"
            )

    def _checked(self, tensors: NamedTensors, complete: bool = False) -> list[tuple[str, Any]]:
        """Every tensor checked against the live model (name, shape; with ``complete``, that
        every parameter is named), before any is copied: a refused update changes nothing."""
        live = self.hf_model.state_dict(keep_vars=True)
        pairs, sent = [], set()
        for name, tensor in tensors:
            target = live.get(name)
            if target is None:
                raise EngineError(f"hf: update_weights got unknown tensor {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise EngineError(
                    f"hf: tensor {name!r} has shape {tuple(tensor.shape)},"
                    f" the model has {tuple(target.shape)}"
                )
            pairs.append((name, tensor))
            sent.add(name)
        if complete:
            names: dict[int, list[str]] = {}  # tied parameters: one of their names is enough
            for name, param in self.hf_model.named_parameters(remove_duplicate=False):
                names.setdefault(id(param), []).append(name)
            missing = [aliases[0] for aliases in names.values() if sent.isdisjoint(aliases)]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise EngineError(
                    f"hf: missing tensor {missing[0]!r}{more}: a full update names every"
                    " weight (a delta sends only some)"
                )
        return pairs

    @staticmethod
    def _copy(model: Any, pairs: list[tuple[str, Any]]) -> int:
        """Copy checked tensors into ``model``'s parameters and buffers."""
        import torch

        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in pairs:
                target = targets[name]
                target.copy_(torch.as_tensor(tensor).to(target.device, target.dtype))
        return len(pairs)

    # -- worker thread -----------------------------------------------------------------
    def work(self) -> None:
        """The worker thread: collect waiting requests, run them as one batch, repeat."""
        waiting: list[Pending] = []
        while True:
            if self.held:  # what arrived during the last batch, in order
                item = self.held.pop(0)
            else:
                item = self.inbox.get() if not waiting else self._next_nowait()
            if item is STOP:
                break
            if isinstance(item, Pending):
                waiting.append(item)
                continue
            if callable(item):
                item()
                continue
            batch, waiting = waiting[: self.max_concurrency], waiting[self.max_concurrency :]
            try:
                _Batch(self, batch).run()
            except Exception as exc:  # a model error fails its requests, never hangs them
                log.exception("hf: batch failed")
                for pending in batch:
                    pending.finish(EngineError(f"hf: generation failed: {exc!r}"))
        held = [item for item in self.held if isinstance(item, Pending)]
        for pending in waiting + held + self._drain():
            pending.finish(self.result(pending.request, "", [], [], [], FinishReason.ABORT))

    def _next_nowait(self) -> Any:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _drain(self) -> list[Pending]:
        items = []
        while (item := self._next_nowait()) is not None:
            if isinstance(item, Pending):
                items.append(item)
        return items

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids of a request's prompt (chat template applied for messages, whose content
        parts are joined as text: a text model never sees an image, they are refused first)."""
        if request.messages is not None:
            messages = [
                {**m, "content": message_text(m.get("content"))}
                if isinstance(m.get("content"), list)
                else m
                for m in request.messages
            ]
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(request.prompt, str):
            return list(self.tokenizer(request.prompt)["input_ids"])
        return list(request.prompt or [])

    def prepare(self, request: GenerationRequest) -> tuple[list[int], Any]:
        """On the worker: a request's prompt ids and what else its prefill needs (None for
        text; a vision engine's image features)."""
        return self.prompt_ids(request), None

    def prefill_inputs(self, model: Any, ids: Any, extras: list[Any]) -> dict[str, Any]:
        """The model's keyword inputs for a prefill of the padded ``ids`` (one extra per row)."""
        return {"input_ids": ids}


class _Row:
    """One request inside a batch."""

    def __init__(self, pending: Pending, prompt: list[int], extra: Any, version: int) -> None:
        self.pending, self.prompt, self.extra = pending, prompt, extra
        self.spans = [(0, version)]  # (first token, weights version) of each run of tokens
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.done = False
        self.rng = np.random.default_rng(pending.request.params.seed)


class _Batch:
    """Left-padded batch decoding with per-row abort, stop strings and EOS."""

    def __init__(self, engine: HFEngine, pendings: list[Pending]) -> None:
        self.engine = engine
        self.rows: list[_Row] = []
        for pending in pendings:
            if pending.aborted.is_set():
                pending.finish(engine.result(pending.request, "", [], [], [], FinishReason.ABORT))
                continue
            try:
                prompt, extra = engine.prepare(pending.request)
            except RollfleetError as exc:  # a refused image: the caller's own error
                pending.finish(exc)
                continue
            except Exception as exc:  # a bad prompt fails its own request only
                pending.finish(EngineError(f"hf: cannot tokenize the prompt: {exc}"))
                continue
            self.rows.append(_Row(pending, prompt, extra, engine.version))
        eos = engine.hf_model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}

    def run(self) -> None:
        """Decode until every row has finished or been aborted."""
        import torch

        if not self.rows:
            return
        model, device = self.engine.hf_model, self.engine.device
        width = max(len(r.prompt) for r in self.rows)
        ids = torch.zeros((len(self.rows), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(self.rows):
            ids[i, width - len(row.prompt) :] = torch.tensor(row.prompt)
            mask[i, width - len(row.prompt) :] = 1
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        limit = max(r.pending.request.params.max_tokens for r in self.rows)
        extras = [row.extra for row in self.rows]
        with torch.inference_mode():
            inputs = self.engine.prefill_inputs(model, ids, extras)
            out = model(**inputs, attention_mask=mask, position_ids=position, use_cache=True)
            for _ in range(limit):
                tokens = self._sample(out.logits[:, -1, :].float().cpu().numpy())
                if all(r.done for r in self.rows):
                    return
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                position = position[:, -1:] + 1
                out = model(
                    input_ids=torch.tensor(tokens, device=device)[:, None],
                    attention_mask=mask,
                    position_ids=position,
                    use_cache=True,
                    **_cache_of(model, out),
                )
                if self.engine.interruptible and self._run_controls():  # the cache is stale
                    model = self.engine.hf_model  # a double-buffered swap replaced it
                    out, mask, position = self._recompute()
        for row in self.rows:
            if not row.done:
                self._finish(row, FinishReason.LENGTH)

    def _run_controls(self) -> bool:
        """Run the calls queued for the worker (weight swaps) between two steps; requests that
        arrived are held for the next batch. True when the weights version changed."""
        before = self.engine.version
        while (item := self.engine._next_nowait()) is not None:
            if callable(item):
                item()
            else:
                self.engine.held.append(item)  # a request, or STOP: after this batch
        if self.engine.version == before:
            return False
        for row in self.rows:
            if not row.done:
                row.spans.append((len(row.out), self.engine.version))
        return True

    def _recompute(self) -> tuple[Any, Any, Any]:
        """Prefill every row's prompt and tokens so far under the current weights (the KV cache
        must be the new model's); the next token is sampled from the returned logits."""
        import torch

        model, device = self.engine.hf_model, self.engine.device
        seqs = [row.prompt + row.out for row in self.rows]
        width = max(len(seq) for seq in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq) :] = torch.tensor(seq)
            mask[i, width - len(seq) :] = 1
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = self.engine.prefill_inputs(model, ids, [row.extra for row in self.rows])
        out = model(**inputs, attention_mask=mask, position_ids=position, use_cache=True)
        return out, mask, position

    def _sample(self, logits: np.ndarray) -> list[int]:
        tokens = []
        for row, row_logits in zip(self.rows, logits, strict=False):
            token = 0
            if not row.done:
                token = self._advance(row, row_logits)
            tokens.append(token)
        return tokens

    def _advance(self, row: _Row, logits: np.ndarray) -> int:
        params = row.pending.request.params
        if row.pending.aborted.is_set():
            self._finish(row, FinishReason.ABORT)
            return 0
        token, logprob = sample(logits, params, row.rng)
        if token in self.eos and not params.ignore_eos:
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

    def _finish(self, row: _Row, reason: FinishReason) -> None:
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


def _safetensors(path: Path) -> NamedTensors:
    """Stream the tensors of a safetensors file or of every one in a directory."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise EngineError(f"hf: no safetensors checkpoint at {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
