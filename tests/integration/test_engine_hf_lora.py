"""LoRA adapters pushed as such to the transformers engine (issue 32): it merges each adapter on
the base weights it keeps, in its standby copy, so an adapter serves exactly what the merged
weights serve on a fresh engine, a second adapter replaces the first (never stacks on it), and a
bad adapter changes nothing and names what is wrong.

A tiny random Llama with a peft LoRA on q/v (B drawn large enough to change greedy answers),
built offline; the reference is peft's own ``merge_and_unload``."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from typing import Any

import pytest
from support import require

from rollfleet.engines.base import GenerationRequest, SamplingParams, WeightsDelta
from rollfleet.errors import EngineError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["a", "a longer prompt", "mid"]


def lora_model(seed: int) -> Any:
    """The tiny model of seed 0 wrapped in a peft LoRA (rank 4, q/v) whose B is drawn from
    ``seed``."""
    require(
        all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft")),
        "torch, transformers and peft",
    )
    import torch
    from peft import LoraConfig, get_peft_model

    from rollfleet.engines.tiny import tiny_hf_model

    model = tiny_hf_model(seed=0)[0]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings():  # peft asks transformers 5 for a renamed property
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is dep")
        wrapped = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                parameter.normal_(0.0, 0.5)
    return wrapped


def merged(wrapped: Any) -> Any:
    """peft's merge of ``wrapped`` into a plain model."""
    return copy.deepcopy(wrapped).merge_and_unload()


async def answers(engine: Any) -> list[list[int]]:
    """The engine's greedy tokens for PROMPTS."""
    out = []
    for prompt in PROMPTS:
        request = GenerationRequest(prompt=prompt, params=GREEDY)
        out.append((await engine.generate(request)).completion_token_ids)
    return out


async def served_by(model: Any, device: str = "cpu") -> list[list[int]]:
    """Greedy tokens of a fresh engine serving ``model``."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_tokenizer

    engine = HFEngine(model, tiny_tokenizer(), max_batch=4, device=device)
    await engine.start()
    try:
        return await answers(engine)
    finally:
        await engine.stop()


async def test_engine_hf_lora_adapters_serve_what_merged_weights_serve() -> None:
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model, tiny_tokenizer
    from rollfleet.engines.weights.lora import peft_adapter

    first, second = lora_model(1), lora_model(2)
    engine = HFEngine(tiny_hf_model(seed=0)[0], tiny_tokenizer(), max_batch=4)
    await engine.start()
    try:
        plain = await answers(engine)
        adapter = peft_adapter(first)
        assert adapter is not None and engine.info().adapters
        assert await engine.update_weights(adapter, version=1) == 1
        assert await answers(engine) == await served_by(merged(first)) != plain
        assert await engine.update_weights(peft_adapter(second), version=2) == 2  # type: ignore[arg-type]
        assert await answers(engine) == await served_by(merged(second))
        only_q = [(n, t) for n, t in peft_adapter(first) if "q_proj" in n]  # type: ignore[union-attr]
        from rollfleet.engines.weights.lora import LoraAdapter

        await engine.update_weights(LoraAdapter(only_q, adapter.alpha), version=3)
        reference = merged(first)  # q adapted, v back to the base weights
        base = tiny_hf_model(seed=0)[0].state_dict()
        with_v = {n: t for n, t in base.items() if "v_proj" in n}
        reference.load_state_dict(with_v, strict=False)
        assert await answers(engine) == await served_by(reference)
    finally:
        await engine.stop()


async def test_engine_hf_lora_a_bad_adapter_changes_nothing() -> None:
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model, tiny_tokenizer
    from rollfleet.engines.weights.lora import LoraAdapter, peft_adapter

    adapter = peft_adapter(lora_model(1))
    assert adapter is not None
    engine = HFEngine(tiny_hf_model(seed=0)[0], tiny_tokenizer(), max_batch=4)
    await engine.start()
    try:
        await engine.update_weights(adapter, version=1)
        served = await answers(engine)
        unknown = [(n.replace("q_proj", "x_proj"), t) for n, t in adapter]
        wide = [(n, t.repeat(1, 2) if "lora_A" in n else t) for n, t in adapter]
        one_half = [(n, t) for n, t in adapter if "lora_A" in n]
        for bad, says in (
            (unknown, "x_proj: the served model has no such module"),
            (wide, "do not fit"),
            (one_half, "lora_B.weight is missing"),
        ):
            with pytest.raises(EngineError, match=says):
                await engine.update_weights(LoraAdapter(bad, adapter.alpha), version=2)
        assert engine.version == 1 and await answers(engine) == served
        # plain weights replace what the adapter was applied to: the next adapter goes on them
        pushed = tiny_hf_model(seed=3)[0].state_dict()
        await engine.update_weights(WeightsDelta(pushed.items(), base=1), version=2)
        assert await answers(engine) == await served_by(tiny_hf_model(seed=3)[0])
    finally:
        await engine.stop()


@pytest.mark.gpu
async def test_engine_hf_lora_cuda_adapter_serves_what_merged_weights_serve_on_cpu() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model, tiny_tokenizer
    from rollfleet.engines.weights.lora import peft_adapter

    wrapped = lora_model(1)
    engine = HFEngine(tiny_hf_model(seed=0)[0], tiny_tokenizer(), max_batch=4, device="cuda")
    await engine.start()
    try:
        await engine.update_weights(peft_adapter(wrapped), version=1)  # type: ignore[arg-type]
        assert await answers(engine) == await served_by(merged(wrapped))
    finally:
        await engine.stop()
