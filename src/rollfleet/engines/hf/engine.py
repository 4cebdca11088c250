"""Hugging Face transformers engine (CPU or GPU), batched, with double-buffered weight updates.

One worker thread owns the model. It decodes one left-padded batch token by token with the KV
cache (:mod:`rollfleet.engines.hf.batch`), checking each row's abort flag between tokens;
waiting requests join the batch between two steps, up to ``max_batch`` rows, and finished
rows leave it. Weight updates are copied into a second copy of the model (the standby)
while generation goes on, and the worker swaps the two between two decode steps, so no
generation ever sees half-updated weights and decoding stops only for the swap (and the KV
recompute of running rows). A same-host push's tensors (over its sealed memfd's mapping,
which nobody can change) are not copied: the standby's parameters become them, and after the
swap the old model's take them too, so both serve one copy and the version before is freed.
``double_buffer=False`` copies into the live parameters in place on the worker instead (half
the memory, generation stopped for the whole copy).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rollfleet.engines.base import (
    FinishReason,
    GenerationRequest,
    Message,
    NamedTensors,
    WeightSource,
)
from rollfleet.engines.continuation import continued_prompt
from rollfleet.engines.hf.batch import DecodeBatch
from rollfleet.engines.threaded import STOP, Pending, ThreadedEngine
from rollfleet.engines.tool_calls import knows_tools, template_messages
from rollfleet.engines.weights.buckets import DEFAULT_BUCKET_BYTES
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")


class HFEngine(ThreadedEngine):
    """transformers model served from one worker thread, with continuous batching."""

    name = "hf"
    adapters = True  # applied by merging on the standby copy (rollfleet.engines.weights.lora)

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
        # ids of the parameters and buffers (of either copy) that serve a sealed push's tensors
        # as they are, in memory that is not the engine's: never written, replaced instead
        self.kept: set[int] = set()
        self.last_pause_s: float | None = None  # the worker's time in the last update
        self.weights_epoch = 0  # counts the updates that moved weights (a relabel moves none)
        self._updating = asyncio.Lock()  # one update at a time: they share the standby
        # LoRA: the weights an adapter is applied to, of the modules it adapts (kept from the
        # first adapter on, until a push of plain weights replaces them)
        self.lora_base: dict[str, Any] = {}

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
        from rollfleet.engines.weights.lora import LoraAdapter

        if isinstance(weights, LoraAdapter):
            weights = await asyncio.to_thread(self._merged, weights)
        elif isinstance(weights, (str, Path)):
            self.lora_base = {}  # a checkpoint replaces what adapters were applied to
        elif self.lora_base:  # so do the tensors a push of plain weights names
            weights = weights if isinstance(weights, list) else list(weights)  # a delta is one
            for name, _ in weights:
                self.lora_base.pop(name, None)
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

    def _merged(self, adapter: Any) -> Any:
        """The weights that serve ``adapter``, as a delta of the modules it (or the last one)
        adapts: each ``W + alpha / rank * B A`` on the kept base weights, and the base itself
        for a module the last adapter adapted and this one does not. EngineError naming the
        tensor that does not fit (nothing changes)."""
        import torch

        from rollfleet.engines.base import WeightsDelta
        from rollfleet.engines.weights.lora import pairs

        live = self.hf_model.state_dict(keep_vars=True)
        merged: dict[str, Any] = {}
        for module, (a, b) in pairs(adapter).items():
            name = f"{module}.weight"
            if name not in live:
                raise EngineError(f"hf: lora: {module}: the served model has no such module")
            base = self.lora_base.get(name, live[name])
            if tuple(base.shape) != (b.shape[0], a.shape[1]):
                raise EngineError(
                    f"hf: lora: {module}: lora_A {a.shape} and lora_B {b.shape} do not fit its"
                    f" {tuple(base.shape)[0]}x{tuple(base.shape)[1]} weight"
                )
            scale = adapter.alpha / a.shape[0]
            update = torch.from_numpy(b) @ torch.from_numpy(a) * scale
            merged[name] = (base.detach().float().cpu() + update).to(base.dtype)
        for name in set(self.lora_base) - set(merged):
            merged[name] = self.lora_base[name]
        for name in merged:
            if name not in self.lora_base:
                self.lora_base[name] = live[name].detach().clone()
        return WeightsDelta(sorted(merged.items()), self.version)

    def _in_place(
        self, tensors: NamedTensors, base: int | None, complete: bool, version: int | None
    ) -> tuple[int, int]:
        """On the worker: check, then copy into the live model (no step sees half of it)."""
        started = time.perf_counter()
        self._check_base(base)
        count = self._copy(self.hf_model, self._checked(tensors, complete))
        new = self._next_version(version)
        self.weights_epoch += 1
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
            self._share_kept()
            return len(pairs), new

    def _fill_standby(self, pairs: list[tuple[str, Any]]) -> None:
        """Off the worker: bring the tensors the last update changed up to date in the standby
        (from the live model, which only the worker reads), then put the new ones in."""
        import torch

        from rollfleet.engines.weights.wire import is_sealed

        live = self.hf_model.state_dict(keep_vars=True)
        standby = self.standby.state_dict(keep_vars=True)
        lagging = self.stale - {name for name, _ in pairs}  # those sent now are overwritten
        with torch.no_grad():
            for name in sorted(lagging):
                self._put(standby[name], live[name], id(live[name]) in self.kept)
            self.stale -= lagging
            for name, tensor in pairs:
                self._put(standby[name], tensor, is_sealed(tensor))

    def _put(self, target: Any, tensor: Any, keep: bool) -> None:
        """``tensor`` into ``target``, a standby parameter or buffer. With ``keep`` (a sealed
        push's tensor, which nobody can change, or a live one that serves one) and when it fits
        (device, dtype, aligned), the standby serves it as it is: no copy. Otherwise it is
        copied into the standby's own memory (new memory where the standby kept a tensor: that
        one is never written)."""
        import torch

        source = torch.as_tensor(tensor).detach()
        fits = source.device == target.device and source.dtype == target.dtype
        if keep and fits and source.data_ptr() % source.element_size() == 0:
            target.data = source
            self.kept.add(id(target))
        elif id(target) in self.kept:
            target.data = source.to(target.device, target.dtype, copy=True)
            self.kept.discard(id(target))
        else:
            target.copy_(source.to(target.device, target.dtype))

    def _share_kept(self) -> None:
        """After a swap: the standby's tensors that lag a kept live one take it too (both
        only read it), so the memory of the version before goes now, not at the next update.
        It is freed in a thread: unmapping and freeing a push's pages takes a while (~0.06 s
        for 538 MB here), which the update need not wait for."""
        live = self.hf_model.state_dict(keep_vars=True)
        standby = self.standby.state_dict(keep_vars=True)
        shared = {name for name in self.stale if id(live[name]) in self.kept}
        old = [standby[name].data for name in shared]  # the last references to it, maybe
        for name in shared:
            self._put(standby[name], live[name], keep=True)
        self.stale -= shared
        threading.Thread(target=old.clear, name="rollfleet-hf-free", daemon=True).start()

    def _swap(self, base: int | None, version: int | None, sent: set[str]) -> int:
        """On the worker, between two decode steps: the standby becomes the live model."""
        started = time.perf_counter()
        self._check_base(base)
        new = self._next_version(version)
        self.hf_model, self.standby = self.standby, self.hf_model
        self.weights_epoch += 1
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
        """The worker thread: start a batch with the waiting requests, which decodes until no
        row is left (requests that arrive meanwhile join it between two steps), repeat."""
        while True:
            item = self.held.pop(0) if self.held else self.inbox.get()
            if item is STOP:
                break
            if callable(item):
                item()
                continue
            waiting = [item]
            while len(waiting) < self.max_concurrency and isinstance(self.peek(), Pending):
                waiting.append(self.held.pop(0))
            batch = DecodeBatch(self, waiting)
            try:
                batch.run()
            except Exception as exc:  # a model error fails its requests, never hangs them
                log.exception("hf: batch failed")
                batch.fail(EngineError(f"hf: generation failed: {exc!r}"))
        held = [item for item in self.held if isinstance(item, Pending)]
        for pending in held + self._drain():
            pending.finish(self.result(pending.request, "", [], [], [], FinishReason.ABORT))

    def peek(self) -> Any:
        """On the worker: the next held item (the inbox's next one moved to the held list
        first), or None when nothing waits."""
        if not self.held and (item := self.next_nowait()) is not None:
            self.held.append(item)
        return self.held[0] if self.held else None

    def next_nowait(self) -> Any:
        """On the worker: the inbox's next item, or None when it is empty."""
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _drain(self) -> list[Pending]:
        items = []
        while (item := self.next_nowait()) is not None:
            if isinstance(item, Pending):
                items.append(item)
        return items

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids of a request's prompt (chat template applied for messages, whose content
        parts are joined as text: a text model never sees an image, they are refused first)."""
        if request.messages is not None:
            continued = continued_prompt(self, request.prior, request.messages, request.tools)
            return continued or self.fragment_ids(
                self.render(request.messages, True, request.tools)
            )
        if isinstance(request.prompt, str):
            return list(self.tokenizer(request.prompt)["input_ids"])
        return list(request.prompt or [])

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the tokenizer's chat template renders it (content parts joined
        as text), with the ``tools`` offered: ``tools=`` for a template that knows tools, else
        the built-in Hermes section (:mod:`~rollfleet.engines.tool_calls`)."""
        native = knows_tools(self.tokenizer.chat_template)
        extra = {"tools": tools} if tools and native else {}
        return str(
            self.tokenizer.apply_chat_template(
                template_messages(messages, tools, native),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        )

    def fragment_ids(self, text: str) -> list[int]:
        """Token ids of rendered text (special tokens parsed, nothing added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def token_text(self, token: int) -> str:
        """A token's text as the template writes it (``<|im_end|>`` for that token)."""
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def end_ids(self) -> set[int]:
        """The model's end-of-generation token ids (from its generation config)."""
        eos = self.hf_model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}

    def is_end(self, token: int) -> bool:
        """True for the model's end-of-generation tokens."""
        return token in self.end_ids()

    def prepare(self, request: GenerationRequest) -> tuple[list[int], Any]:
        """On the worker: a request's prompt ids and what else its prefill needs (None for
        text; a vision engine's image features)."""
        return self.prompt_ids(request), None

    def prefill_inputs(self, model: Any, ids: Any, extras: list[Any]) -> dict[str, Any]:
        """The model's keyword inputs for a prefill of the padded ``ids`` (one extra per row)."""
        return {"input_ids": ids}


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
