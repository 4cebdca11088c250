"""LoRA adapters as weights: under LoRA a trainer sends the adapter (a few MB), not the merged
model, and an engine that can apply an adapter at run time (llama.cpp) takes it as it is.

An adapter push is named tensors like any other (:class:`LoraAdapter`): for each adapted
module, transformers' name plus ``.lora_A.weight`` (``rank x in``) and ``.lora_B.weight``
(``out x rank``), and the adapter's ``alpha``; the module computes ``W x + alpha / rank * B A x``,
as peft's LoRA does. An adapter replaces the previous one whole (it is relative to the base
model the engine loaded, never to the last push), so it needs no base version.

For llama.cpp the adapter becomes a GGUF adapter file (``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, tensors ``blk.N.attn_q.weight.lora_a`` and
``.lora_b``), loaded with ``llama_adapter_lora_init`` and set with ``llama_set_adapters_lora``;
the rows of ``B`` for ``q_proj`` and ``k_proj`` are put in llama.cpp's rotary layout as the
weights themselves are (:func:`~rollfleet.engines.weights.gguf_export.permute_rotary`). Every pair
is checked against the served model before anything is written: an unknown module, a shape that
is not the module's, ranks that differ, a missing half or a value that is not finite is an
:class:`~rollfleet.errors.EngineError` naming the tensor, and the served adapter stays.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rollfleet.engines.weights.gguf_export import (
    BaseGGUF,
    _float32,
    _gguf,
    finish,
    gguf_name,
    permute_rotary,
)
from rollfleet.errors import EngineError

_HALF = re.compile(r"(.+)\.lora_([AB])\.weight")
MAX_RANK = 1024


class LoraAdapter(list[tuple[str, Any]]):
    """Named LoRA tensors (``<module>.lora_A.weight``, ``<module>.lora_B.weight``) and their
    ``alpha``: what engines that take adapters apply on their base model."""

    def __init__(self, tensors: Iterable[tuple[str, Any]], alpha: float) -> None:
        super().__init__(tensors)
        if not math.isfinite(alpha) or alpha <= 0:
            raise EngineError(f"lora: alpha must be a positive number, got {alpha}")
        self.alpha = float(alpha)


def pairs(adapter: LoraAdapter) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``module -> (A, B)`` as float32 arrays; EngineError naming a tensor that is not a LoRA
    half, a module with one half only, or ranks that differ."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in adapter:
        found = _HALF.fullmatch(name)
        if found is None:
            raise EngineError(f"lora: {name!r} is not a LoRA tensor (<module>.lora_A.weight or B)")
        array = _float32(name, tensor)
        if array.ndim != 2 or not np.isfinite(array).all():
            raise EngineError(f"lora: {name!r} must be a finite 2-D matrix")
        halves.setdefault(found.group(1), {})[found.group(2)] = array
    if not halves:
        raise EngineError("lora: an adapter with no tensor")
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    ranks = set()
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            missing = ({"A", "B"} - set(half)).pop()
            raise EngineError(f"lora: {module}.lora_{missing}.weight is missing")
        a, b = half["A"], half["B"]
        if a.shape[0] != b.shape[1] or not 1 <= a.shape[0] <= MAX_RANK:
            raise EngineError(
                f"lora: {module}: rank {a.shape[0]} in lora_A but {b.shape[1]} in lora_B"
            )
        ranks.add(a.shape[0])
        out[module] = (a, b)
    if len(ranks) > 1:
        raise EngineError(f"lora: the adapter mixes ranks {sorted(ranks)}")
    return out


def write_adapter_gguf(base: BaseGGUF, adapter: LoraAdapter, target: Path) -> int:
    """Write ``adapter`` as a llama.cpp GGUF adapter for the model ``base`` describes; its
    rank. EngineError naming the tensor when it does not fit that model (nothing written)."""
    planned = []
    for module, (a, b) in pairs(adapter).items():
        name = gguf_name(f"{module}.weight")
        shape = base.shapes.get(name or "")
        if name is None or shape is None or len(shape) != 2:
            raise EngineError(f"lora: {module}: the served model has no such matrix to adapt")
        if a.shape[1] != shape[1] or b.shape[0] != shape[0]:
            raise EngineError(
                f"lora: {module}: lora_A {a.shape} and lora_B {b.shape} do not fit its"
                f" {shape[0]}x{shape[1]} weight"
            )
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = base.n_head if name.endswith("attn_q.weight") else base.n_head_kv
            b = permute_rotary(b, heads)
        planned.append((name, a, b))
    gguf = _gguf()
    writer = gguf.GGUFWriter(target, base.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", adapter.alpha)
    for name, a, b in planned:
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))
    finish(writer)
    return int(planned[0][1].shape[0])


def peft_adapter(model: Any) -> LoraAdapter | None:
    """A peft model's active LoRA adapter as a :class:`LoraAdapter` (transformers' module
    names), or None when ``model`` has no LoRA layer or its layers differ in rank or scale."""
    from peft.tuners.lora import LoraLayer

    tensors: list[tuple[str, Any]] = []
    alphas = set()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        layer: Any = module
        for key in layer.active_adapters:
            rank = layer.r[key]
            alphas.add((rank, layer.scaling[key] * rank))
            plain = name.removeprefix("base_model.model.")
            tensors.append((f"{plain}.lora_A.weight", layer.lora_A[key].weight.detach()))
            tensors.append((f"{plain}.lora_B.weight", layer.lora_B[key].weight.detach()))
    if not tensors or len(alphas) != 1:
        return None
    return LoraAdapter(tensors, alpha=alphas.pop()[1])
