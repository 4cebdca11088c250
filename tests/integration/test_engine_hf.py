"""The transformers engine on CPU with a small random Llama built from a config (no download)."""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest
from support import require, streaming

from rollfleet.engines.base import FinishReason, Generation, GenerationRequest, SamplingParams
from rollfleet.errors import EngineError

HAVE = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"))
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def engine():
    require(HAVE, "transformers and torch (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    eng = HFEngine(*tiny_hf_model(seed=0), max_batch=4)
    await eng.start()
    yield eng
    await eng.stop()


async def greedy(engine) -> Generation:
    return await engine.generate(GenerationRequest(messages=PROMPT, params=GREEDY))


async def test_engine_hf_starts_healthy_and_generates(engine) -> None:
    assert await engine.health() and engine.info().engine == "hf"
    result = await greedy(engine)
    assert len(result.completion_token_ids) == 12 and result.finish_reason is FinishReason.LENGTH
    assert result.prompt_token_ids[:1] == engine.tokenizer.convert_tokens_to_ids(["<|im_start|>"])
    assert len(result.logprobs or []) == 12 and all(lp <= 0 for lp in result.logprobs or [])
    assert result.text == engine.tokenizer.decode(
        result.completion_token_ids, skip_special_tokens=True
    )


async def test_engine_hf_batched_rows_match_solo_runs(engine) -> None:
    prompts = ["a", "a much longer prompt than the first", "mid length one"]
    solo = [await engine.generate(GenerationRequest(prompt=p, params=GREEDY)) for p in prompts]
    batched = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt=p, params=GREEDY)) for p in prompts)
    )
    assert [r.completion_token_ids for r in batched] == [r.completion_token_ids for r in solo]


async def test_engine_hf_requests_join_a_running_generation_and_match_their_solo_runs(
    engine,
) -> None:
    """Continuous batching: a request that arrives while a long generation runs starts at the
    next step and ends long before it; rows joining with longer and shorter prompts than the
    running one's cache, and leaving again, change no row's greedy tokens."""
    prompts = ["x", "a prompt far longer than the running generation's cache when it joins", "y"]
    solo = [await engine.generate(GenerationRequest(prompt=p, params=GREEDY)) for p in prompts]
    long = GenerationRequest(
        prompt="go", params=SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    )
    long_solo = await engine.generate(long)
    running = await streaming(engine, long, after=5)
    joined = []
    for prompt in prompts:  # one after another: each joins a batch the one before has left
        joined.append(await engine.generate(GenerationRequest(prompt=prompt, params=GREEDY)))
        assert not running.done(), "a request waited for the running generation to end"
    both = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt=p, params=GREEDY)) for p in prompts)
    )
    assert not running.done()
    assert [r.completion_token_ids for r in joined] == [r.completion_token_ids for r in solo]
    assert [r.completion_token_ids for r in both] == [r.completion_token_ids for r in solo]
    assert (await running).completion_token_ids == long_solo.completion_token_ids


async def test_engine_hf_requests_beyond_max_batch_wait_for_a_free_row(engine) -> None:
    """With every row taken, a request waits for one to free up, then joins (max_batch=4)."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [GenerationRequest(prompt=f"row {i}", params=params) for i in range(7)]
    solo = [await engine.generate(r) for r in requests]
    together = await asyncio.gather(*(engine.generate(r) for r in requests))
    assert [r.completion_token_ids for r in together] == [r.completion_token_ids for r in solo]


async def test_engine_hf_weight_update_changes_the_generated_tokens(engine) -> None:
    from rollfleet.engines.tiny import tiny_hf_model

    before = await greedy(engine)
    other, _ = tiny_hf_model(seed=1)
    version = await engine.update_weights(other.state_dict().items(), version=7)
    after = await greedy(engine)
    assert version == 7 and engine.version == 7 and after.weights_version == 7
    assert after.completion_token_ids != before.completion_token_ids
    name = "model.embed_tokens.weight"
    assert engine.hf_model.state_dict()[name].equal(other.state_dict()[name])


async def test_engine_hf_weight_update_from_a_safetensors_checkpoint(engine, tmp_path) -> None:
    from safetensors.torch import save_file

    from rollfleet.engines.tiny import tiny_hf_model

    before = await greedy(engine)
    other, _ = tiny_hf_model(seed=2)
    state = {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert await engine.update_weights(tmp_path) == 1
    assert (await greedy(engine)).completion_token_ids != before.completion_token_ids


async def test_engine_hf_weight_update_refuses_unknown_or_misshaped_tensors(engine) -> None:
    import torch

    with pytest.raises(EngineError, match="unknown tensor 'nope'"):
        await engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(EngineError, match="has shape"):
        await engine.update_weights([("model.norm.weight", torch.zeros(3))])
    assert engine.version == 0 and (await greedy(engine)).completion_token_ids


async def test_engine_hf_abort_returns_partial_tokens(engine) -> None:
    long = SamplingParams(max_tokens=5000, ignore_eos=True)
    started = [asyncio.Event() for _ in range(4)]

    async def run(i: int) -> Generation:
        async for item in engine.stream(GenerationRequest(prompt=f"p{i}", params=long)):
            started[i].set()
            if isinstance(item, Generation):
                return item
        raise AssertionError("no result")

    tasks = [asyncio.create_task(run(i)) for i in range(4)]  # later ones join the batch
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    assert await asyncio.wait_for(engine.abort(None), 1.0) == 4
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 10):
        assert result.aborted and 1 <= len(result.completion_token_ids) < 5000


async def test_engine_hf_new_weights_mid_generation_continue_it_under_the_new_policy(
    engine,
) -> None:
    """The swap lands between two decode steps of a running request: nothing is thrown away,
    the KV cache is recomputed, and the tokens after the swap are exactly what a fresh engine
    with the new weights generates from the prompt and the tokens before it."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    task = await streaming(engine, GenerationRequest(prompt="tell me", params=long), after=5)
    gate = threading.Event()
    engine.inbox.put(gate.wait)  # the worker stops at the next step boundary, mid-request

    async def queued(n: int) -> None:
        while engine.inbox.qsize() < n:
            await asyncio.sleep(0.01)

    new = tiny_hf_model(seed=1)
    swap = asyncio.create_task(engine.update_weights(new[0].state_dict().items(), version=3))
    await asyncio.wait_for(queued(1), 30)  # the gate was taken; the swap waits behind it
    gate.set()
    result = await asyncio.wait_for(task, 60)
    assert await swap == 3
    (start, v0), (cut, v1) = result.versions
    assert (start, v0, v1) == (0, 0, 3) and 5 <= cut < 60 and len(result.completion_token_ids) == 60
    fresh = HFEngine(*new, max_batch=4)
    await fresh.start()
    try:
        tail = await fresh.generate(
            GenerationRequest(
                prompt=result.prompt_token_ids + result.completion_token_ids[:cut],
                params=SamplingParams(max_tokens=60 - cut, temperature=0, ignore_eos=True),
            )
        )
    finally:
        await fresh.stop()
    assert tail.completion_token_ids == result.completion_token_ids[cut:]


async def test_engine_hf_weight_update_before_start_is_refused_not_left_waiting() -> None:
    require(HAVE, "transformers and torch (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    model, tokenizer = tiny_hf_model(seed=0)
    engine = HFEngine(model, tokenizer)
    with pytest.raises(EngineError, match="not started"):
        await asyncio.wait_for(engine.update_weights(model.state_dict().items(), version=1), 10)
    assert engine.version == 0


async def test_engine_hf_relabel_mid_generation_keeps_the_caches_and_the_tokens(
    engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that changed no weight relabels them: the running request says where the new
    label began, its cache is not computed again (one prefill in all), and its tokens are those
    of a run never relabelled."""
    from rollfleet.engines.hf import batch

    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = await engine.generate(GenerationRequest(prompt="tell me", params=long))
    prefills = []
    real = batch.DecodeBatch._prefill

    def counted(self, rows):  # type: ignore[no-untyped-def]
        prefills.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(batch.DecodeBatch, "_prefill", counted)
    task = await streaming(engine, GenerationRequest(prompt="tell me", params=long), after=5)
    gate = threading.Event()
    engine.inbox.put(gate.wait)  # the worker stops at the next step boundary, mid-request
    label = asyncio.create_task(engine.relabel(7))

    async def queued() -> None:
        while engine.inbox.qsize() < 1:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(queued(), 30)  # the gate was taken; the relabel waits behind it
    gate.set()
    result = await asyncio.wait_for(task, 60)
    assert await label == 7 and prefills == [1]
    assert result.completion_token_ids == plain.completion_token_ids
    (start, v0), (cut, v1) = result.versions
    assert (start, v0, v1) == (0, 0, 7) and 5 <= cut < 40
