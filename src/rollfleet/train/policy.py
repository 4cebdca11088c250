"""The policy a trainer updates: the bundled SmolLM2 as a trainable transformers model, and one
GRPO step over a batch of experiences (micro-batched, token-weighted, gradient-clipped).

transformers loads the bundled GGUF with its GGUF loader (the ``gguf`` package): the Q4_1 weights
are dequantized to float32, 134.5M parameters, ~25 s on 2 cores. Its ``state_dict`` carries
transformers' Llama names, which is what :func:`rollfleet.engines.weights.push_weights` sends and
every engine takes (llama.cpp writes them back into a GGUF).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.coordinator.experiences import Experience
from rollfleet.errors import InvalidInput
from rollfleet.train.grpo import collate, grpo_loss, token_logprobs


def load_policy(path: str | Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a GGUF (default: the bundled SmolLM2), float32, trainable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollfleet.engines.llamacpp_model import bundled_gguf

    gguf = Path(path) if path else bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.train(), tokenizer


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did."""

    loss: float
    ratio_mean: float
    clipped: float
    approx_kl: float
    grad_norm: float
    action_tokens: int
    seconds: float


def grpo_step(
    model: Any,
    optimizer: Any,
    experiences: Sequence[Experience],
    *,
    micro_batch: int = 4,
    max_grad_norm: float = 1.0,
    pad_id: int = 0,
) -> StepStats:
    """One optimizer step on GRPO's loss over ``experiences``, ``micro_batch`` rows at a time;
    each micro-batch weighs by its share of the action tokens (the loss is a mean per token)."""
    import torch

    if micro_batch < 1:
        raise InvalidInput(f"grpo_step: micro_batch must be at least 1, got {micro_batch}")
    started = time.perf_counter()
    chunks = [
        collate(experiences[i : i + micro_batch], pad_id)
        for i in range(0, len(experiences), micro_batch)
    ]
    total = sum(c.action_tokens for c in chunks)
    if total == 0:
        raise InvalidInput("grpo_step: the experiences hold no action token to train on")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "ratio_mean": 0.0, "clipped": 0.0, "approx_kl": 0.0}
    for batch in chunks:
        share = batch.action_tokens / total
        loss, stats = grpo_loss(token_logprobs(model, batch), batch)
        (loss * share).backward()
        for key in sums:
            sums[key] += getattr(stats, key) * share
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(**sums, grad_norm=float(norm), action_tokens=total,
                     seconds=time.perf_counter() - started)  # fmt: skip
