"""Double-buffered weight swaps on the transformers engine (a tiny random Llama, no download).

Updates are copied into a standby copy of the model while generation goes on, and the worker
only swaps the two between decode steps. The served weights must be exactly what was pushed
(on top of the right version for a delta), a refused update must leave both copies alone, tied
weights stay tied, and running generations go on under the new model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import require, streaming

from rollfleet.engines.base import GenerationRequest, SamplingParams, WeightsDelta
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.errors import Conflict, EngineError

HAVE = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"))
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LAYER1 = "model.layers.1."


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    require(HAVE, "transformers and torch (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    eng = HFEngine(*tiny_hf_model(seed=0), max_batch=4)
    await eng.start()
    yield eng
    await eng.stop()


def state(seed: int) -> dict[str, Any]:
    from rollfleet.engines.tiny import tiny_hf_model

    return dict(tiny_hf_model(seed=seed)[0].state_dict())


def copy_of(model: Any) -> dict[str, Any]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[n].equal(b[n]) for n in a)


async def greedy(engine: Any, prompt: str = "hello there") -> list[int]:
    result = await engine.generate(GenerationRequest(prompt=prompt, params=GREEDY))
    return list(result.completion_token_ids)


async def fresh_greedy(weights: dict[str, Any], prompt: str = "hello there") -> list[int]:
    """What an engine started on ``weights`` generates."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    model, tokenizer = tiny_hf_model(seed=0)
    model.load_state_dict(weights)
    fresh = HFEngine(model, tokenizer)
    await fresh.start()
    try:
        return await greedy(fresh, prompt)
    finally:
        await fresh.stop()


async def test_a_double_buffered_update_answers_as_a_fresh_engine_on_the_new_weights(
    engine,
) -> None:
    before = await greedy(engine)
    assert await engine.update_weights(state(1).items(), version=1) == 1
    assert engine.standby is not None and engine.standby is not engine.hf_model
    assert same(copy_of(engine.hf_model), state(1))
    after = await greedy(engine)
    assert after != before and after == await fresh_greedy(state(1))
    assert await engine.update_weights(state(2).items(), version=2) == 2  # the standby reused
    assert same(copy_of(engine.hf_model), state(2))
    assert await greedy(engine) == await fresh_greedy(state(2))
    assert engine.last_pause_s is not None and 0 <= engine.last_pause_s < 1


async def test_a_delta_after_a_full_update_applies_over_the_served_weights(engine) -> None:
    """The standby holds seed 0 after the first swap: the second update must bring it up to
    seed 1 before the delta lands, or the tensors not sent would go back to seed 0."""
    await engine.update_weights(state(1).items(), version=1)
    layer = [(n, t) for n, t in state(2).items() if n.startswith(LAYER1)]
    assert await engine.update_weights(WeightsDelta(layer, base=1), version=2) == 2
    merged = {**state(1), **dict(layer)}
    assert same(copy_of(engine.hf_model), merged)
    norm = [("model.norm.weight", merged["model.norm.weight"] + 0.5)]
    assert await engine.update_weights(WeightsDelta(norm, base=2), version=3) == 3
    merged = {**merged, **dict(norm)}
    assert same(copy_of(engine.hf_model), merged)
    assert await greedy(engine) == await fresh_greedy(merged)


async def test_a_refused_update_changes_neither_model(engine) -> None:
    import torch

    await engine.update_weights(state(1).items(), version=1)
    live, standby = copy_of(engine.hf_model), copy_of(engine.standby)
    with pytest.raises(EngineError, match="has shape"):
        await engine.update_weights([*state(2).items(), ("model.norm.weight", torch.zeros(3))])
    with pytest.raises(EngineError, match="unknown tensor 'nope'"):
        await engine.update_weights([*state(2).items(), ("nope", torch.zeros(1))])
    with pytest.raises(EngineError, match="missing tensor"):
        await engine.update_weights(list(state(2).items())[1:], version=2)
    with pytest.raises(Conflict, match="against version 0"):
        await engine.update_weights(WeightsDelta(list(state(2).items()), base=0), version=2)
    assert engine.version == 1
    assert same(copy_of(engine.hf_model), live) and same(copy_of(engine.standby), standby)
    layer = [(n, t) for n, t in state(2).items() if n.startswith(LAYER1)]
    await engine.update_weights(WeightsDelta(layer, base=1), version=2)  # still on top of 1
    assert same(copy_of(engine.hf_model), {**state(1), **dict(layer)})


async def test_tied_weights_stay_tied_in_both_copies() -> None:
    require(HAVE, "transformers and torch (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model
    from rollfleet.engines.weights.push import untied

    def tied(seed: int) -> tuple[Any, Any]:
        model, tokenizer = tiny_hf_model(seed=seed)
        model.lm_head.weight = model.model.embed_tokens.weight
        return model, tokenizer

    engine = HFEngine(*tied(0))
    await engine.start()
    try:
        new = tied(1)[0].state_dict()
        assert await engine.update_weights(untied(new.items()), version=1) == 1  # sent once
        for model in (engine.hf_model, engine.standby):
            assert model.lm_head.weight is model.model.embed_tokens.weight
        assert engine.hf_model.lm_head.weight.data_ptr() != engine.standby.lm_head.weight.data_ptr()
        embed = [("model.embed_tokens.weight", new["model.embed_tokens.weight"] * 2)]
        await engine.update_weights(WeightsDelta(embed, base=1), version=2)
        live = engine.hf_model
        assert live.lm_head.weight is live.model.embed_tokens.weight
        assert live.lm_head.weight.equal(embed[0][1])
        assert same(copy_of(live), {**new, **dict(embed), "lm_head.weight": embed[0][1]})
    finally:
        await engine.stop()


async def test_running_generations_go_on_under_the_swapped_in_model(engine) -> None:
    """The first update (the standby made while the request decodes) lands mid-request: the
    version change shows in the result and the tokens after it are a fresh engine's."""
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    task = await streaming(engine, GenerationRequest(prompt="tell me", params=long), after=5)
    gate = threading.Event()
    engine.inbox.put(gate.wait)  # the worker stops at the next step boundary, mid-request
    swap = asyncio.create_task(engine.update_weights(state(1).items(), version=3))
    for _ in range(3000):  # the standby is filled off the worker, then the swap queues
        if engine.inbox.qsize() >= 1:
            break
        await asyncio.sleep(0.01)
    gate.set()
    result = await asyncio.wait_for(task, 60)
    assert await swap == 3
    (start, v0), (cut, v1) = result.versions
    assert (start, v0, v1) == (0, 0, 3) and 5 <= cut < 60 and len(result.completion_token_ids) == 60
    prompt = result.prompt_token_ids + result.completion_token_ids[:cut]
    rest = SamplingParams(max_tokens=60 - cut, temperature=0, ignore_eos=True)
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    fresh = HFEngine(*tiny_hf_model(seed=1))
    await fresh.start()
    try:
        tail = await fresh.generate(GenerationRequest(prompt=prompt, params=rest))
    finally:
        await fresh.stop()
    assert tail.completion_token_ids == result.completion_token_ids[cut:]


async def test_in_place_updates_keep_one_copy() -> None:
    require(HAVE, "transformers and torch (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    engine = HFEngine(*tiny_hf_model(seed=0), double_buffer=False)
    await engine.start()
    try:
        model = engine.hf_model
        await engine.update_weights(state(1).items(), version=1)
        assert engine.hf_model is model and engine.standby is None
        assert same(copy_of(model), state(1)) and engine.last_pause_s is not None
    finally:
        await engine.stop()


async def test_the_gateway_answer_has_each_replicas_pause(engine) -> None:
    gateway = Gateway()
    gateway.add_replica(engine, "hf-0")
    try:
        answer = await gateway.update_weights(list(state(1).items()), 1)
    finally:
        await gateway.close()
    pause, total = answer["pause_s"]["hf-0"], answer["update_s"]["hf-0"]
    assert 0 <= pause <= total and pause == round(engine.last_pause_s, 6)
