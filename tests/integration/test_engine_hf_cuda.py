"""The transformers engine on a real GPU, against the same engine on CPU.

Marked ``gpu``: skips where torch sees no CUDA device (allowed under ROLLFLEET_REQUIRE_ALL, like
the vLLM and SGLang serving tests). Imports nothing but the engine, so it also runs on a GPU
machine that holds only torch and transformers besides rollfleet's own code.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from rollfleet.engines.base import GenerationRequest, SamplingParams

HAVE = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"))
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["a", "a much longer prompt than the first one", "mid length"]

pytestmark = pytest.mark.gpu


def cuda() -> bool:
    """Whether torch sees a CUDA device."""
    if not HAVE:
        return False
    import torch

    return bool(torch.cuda.is_available())


async def answers(device: str, seed: int, pushed: int | None = None) -> list[tuple[list, list]]:
    """Greedy tokens and logprobs for PROMPTS, batched, from an engine on ``device`` serving the
    tiny model of ``seed`` (then, if ``pushed``, the weights of that seed pushed to it)."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    engine = HFEngine(*tiny_hf_model(seed=seed), max_batch=4, device=device)
    await engine.start()
    try:
        if pushed is not None:
            weights = tiny_hf_model(seed=pushed)[0].state_dict().items()
            assert await engine.update_weights(weights, version=1) == 1
        results = await asyncio.gather(
            *(engine.generate(GenerationRequest(prompt=p, params=GREEDY)) for p in PROMPTS)
        )
    finally:
        await engine.stop()
    return [(r.completion_token_ids, r.logprobs or []) for r in results]


def assert_same(gpu: list[tuple[list, list]], cpu: list[tuple[list, list]]) -> None:
    """The same greedy tokens, and logprobs within float32 noise."""
    assert [ids for ids, _ in gpu] == [ids for ids, _ in cpu]
    for (_, a), (_, b) in zip(gpu, cpu, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3


async def test_engine_hf_cuda_batched_greedy_matches_cpu() -> None:
    if not cuda():
        pytest.skip("no CUDA device")
    assert_same(await answers("cuda", seed=0), await answers("cpu", seed=0))


async def test_engine_hf_cuda_weight_push_serves_what_a_fresh_cpu_engine_serves() -> None:
    if not cuda():
        pytest.skip("no CUDA device")
    pushed = await answers("cuda", seed=0, pushed=1)
    assert_same(pushed, await answers("cpu", seed=1))
    assert [ids for ids, _ in pushed] != [ids for ids, _ in await answers("cpu", seed=0)]
