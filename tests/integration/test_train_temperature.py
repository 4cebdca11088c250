"""On-policy means a ratio of 1 at any temperature: completions sampled at temperature 0.5 by the
transformers engine (a tiny random Llama, CPU) become experiences, and the first GRPO step of a
Policy holding the same weights sees an importance ratio within 1e-3 of 1. Rows that claim
temperature 1 (the loss without the temperature) are off by more, so the check can fail."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
from support import require

from rollfleet.coordinator.experiences import Experience

pytestmark = pytest.mark.timeout(300)
HAVE = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"))
TEMPERATURE = 0.5
SHARPEN = 5.0  # a random model's logits are nearly flat: scaled up, the temperature matters more
QUESTIONS = ["hello there", "what is 2 + 2?", "name a colour", "count to three"]


def tiny_sharp() -> tuple[Any, Any]:
    """The tiny random Llama and its tokenizer, its output layer scaled by SHARPEN."""
    import torch

    from rollfleet.engines.tiny import tiny_hf_model

    model, tokenizer = tiny_hf_model(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return model, tokenizer


def experience(
    index: int, prompt: list[int], completion: list[int], logprobs: list[float], temperature: float
) -> Experience:
    """One sampled completion as a training row (advantage +1 or -1)."""
    n = len(prompt)
    sign = 1.0 if index % 2 else -1.0
    return Experience(
        rollout_id=f"r{index}",
        batch_id="b",
        group_id="g",
        turn=0,
        tokens=prompt + completion,
        prompt_length=n,
        logprobs=[0.0] * n + logprobs,
        action_mask=[0] * n + [1] * len(completion),
        reward=sign,
        advantage=sign,
        policy_version=0,
        staleness=0,
        temperature=temperature,
    )


def first_ratio(model: Any, rows: list[Experience]) -> float:
    """The ratio_mean of the first step of a full fine-tuning Policy on a copy of ``model``."""
    from rollfleet.train.policy import Policy

    stats = Policy(copy.deepcopy(model), lr=1e-3, lora_rank=None).step(rows)
    assert stats is not None and stats.action_tokens > 0
    return stats.ratio_mean


async def test_on_policy_rows_sampled_at_temperature_half_have_ratio_one() -> None:
    require(HAVE, "transformers and torch (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine

    model, tokenizer = tiny_sharp()
    weights = copy.deepcopy(model)  # the trainer's copy, before the engine owns the model
    engine = HFEngine(model, tokenizer, max_batch=4)
    await engine.start()
    try:
        sampled = [
            await engine.chat(
                [{"role": "user", "content": q}],
                max_tokens=16,
                temperature=TEMPERATURE,
                seed=i,
                logprobs=True,
            )
            for i, q in enumerate(QUESTIONS)
        ]
    finally:
        await engine.stop()
    for g in sampled:  # whether or not a stop on EOS keeps the EOS, every token has its logprob
        assert g.completion_token_ids and len(g.logprobs or []) == len(g.completion_token_ids)

    def rows(temperature: float) -> list[Experience]:
        return [
            experience(
                i,
                list(g.prompt_token_ids),
                list(g.completion_token_ids),
                list(g.logprobs or []),
                temperature,
            )
            for i, g in enumerate(sampled)
        ]

    on_policy = first_ratio(weights, rows(TEMPERATURE))
    assert on_policy == pytest.approx(1.0, abs=1e-3)
    without = first_ratio(weights, rows(1.0))  # the loss at temperature 1: biased
    assert abs(without - 1.0) > 1e-3, without
