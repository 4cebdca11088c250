"""A call asked again by a later attempt is answered with the tokens already generated
(rollfleet.engines.gateway.repeats), with the shipped echo engine: the replica's ``served`` counts what
the engine generated."""

from __future__ import annotations

import asyncio
import random

from rollfleet.engines.base import Generation, GenerationRequest, SamplingParams
from rollfleet.engines.echo import EchoEngine
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.errors import Conflict
from rollfleet.model import StepIn

SEEDED = SamplingParams(max_tokens=6, temperature=0.7, seed=11, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "name a colour"}]


class Fenced:
    """A recorder that keeps the steps it accepts and refuses every step of ``fenced``
    attempts, as the store refuses a lost attempt's."""

    def __init__(self, *fenced: str) -> None:
        self.fenced = set(fenced)
        self.steps: list[tuple[str, str, StepIn]] = []

    async def __call__(self, rollout_id: str, attempt_id: str, step: StepIn) -> None:
        if attempt_id in self.fenced:
            raise Conflict(f"attempt {attempt_id} no longer owns {rollout_id}")
        self.steps.append((rollout_id, attempt_id, step))


def gateway_with(recorder: Fenced, delay: float = 0.0, reuse: bool = True) -> Gateway:
    """A gateway over one echo replica ``r0``."""
    gateway = Gateway(recorder, rng=random.Random(0), reuse=reuse)
    gateway.add_replica(EchoEngine(token_delay_s=delay, max_concurrency=8), "r0")
    return gateway


def ask(params: SamplingParams = SEEDED, messages: list | None = None) -> GenerationRequest:
    """A chat request."""
    return GenerationRequest(messages=messages or MESSAGES, params=params)


def served(gateway: Gateway) -> int:
    """Calls the engine generated."""
    return gateway.router.replicas["r0"].served


async def lost_then_asked_again(gateway: Gateway) -> tuple[Generation, Generation]:
    """Attempt ``at-1`` loses its call's step (fenced), ``at-2`` asks the same call."""
    first = ask()
    try:
        await gateway.generate(first, "ro-1", "at-1")
    except Conflict:
        pass
    again = await gateway.generate(ask(), "ro-1", "at-2")
    return gateway.repeats.finished[next(iter(gateway.repeats.finished))], again


async def test_engine_repeats_a_lost_attempts_call_asked_again_is_answered_not_generated() -> None:
    recorder = Fenced("at-1")
    gateway = gateway_with(recorder)
    first, again = await lost_then_asked_again(gateway)
    assert served(gateway) == 1
    assert again.completion_token_ids == first.completion_token_ids and again.text == first.text
    assert again.request_id != first.request_id
    [(rollout, attempt, step)] = recorder.steps
    assert (rollout, attempt) == ("ro-1", "at-2")
    assert step.payload["reuses"] == first.request_id
    assert step.payload["request_id"] == again.request_id
    assert step.payload["completion_token_ids"] == first.completion_token_ids
    assert gateway.repeats.answered == 1


async def test_engine_repeats_a_call_asked_while_the_first_still_runs_waits_for_it() -> None:
    recorder = Fenced()
    gateway = gateway_with(recorder, delay=0.02)
    first = asyncio.create_task(gateway.generate(ask(), "ro-1", "at-1"))
    while not gateway.repeats.running:
        await asyncio.sleep(0)
    again = await asyncio.wait_for(gateway.generate(ask(), "ro-1", "at-2"), 10)
    assert (await first).completion_token_ids == again.completion_token_ids
    assert served(gateway) == 1
    assert [s.payload.get("reuses") for _, _, s in recorder.steps] == [
        None,
        (await first).request_id,
    ]


async def test_engine_repeats_streams_the_answer_as_one_delta() -> None:
    gateway = gateway_with(Fenced("at-1"))
    first, _ = await lost_then_asked_again(gateway)
    items = [item async for item in gateway.stream(ask(), "ro-1", "at-3")]
    assert len(items) == 2 and items[0].text == first.text  # type: ignore[union-attr]
    assert isinstance(items[1], Generation) and served(gateway) == 1


async def test_engine_repeats_only_a_determined_call_of_the_same_rollout_is_answered() -> None:
    gateway = gateway_with(Fenced())
    await gateway.generate(ask(), "ro-1", "at-1")
    unseeded = SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True)
    await gateway.generate(ask(unseeded), "ro-1", "at-1")
    await gateway.generate(ask(unseeded), "ro-1", "at-2")  # a new sample is what it asks for
    await gateway.generate(ask(), "ro-2", "at-9")  # another rollout's call is never handed over
    other = [{"role": "user", "content": "name a fruit"}]
    await gateway.generate(ask(messages=other), "ro-1", "at-2")
    await gateway.generate(ask(SamplingParams(max_tokens=7, seed=11)), "ro-1", "at-2")
    await gateway.generate(ask(), None, None)  # no rollout: nothing to answer it from
    assert served(gateway) == 7 and gateway.repeats.answered == 0
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    await gateway.generate(ask(greedy), "ro-1", "at-1")
    await gateway.generate(ask(greedy), "ro-1", "at-2")  # greedy: determined without a seed
    assert served(gateway) == 8 and gateway.repeats.answered == 1


async def test_engine_repeats_new_weights_are_generated_with() -> None:
    gateway = gateway_with(Fenced())
    await gateway.generate(ask(), "ro-1", "at-1")
    await gateway.update_weights([], version=1)
    again = await gateway.generate(ask(), "ro-1", "at-2")
    assert served(gateway) == 2 and again.weights_version == 1


async def test_engine_repeats_an_aborted_call_is_generated_again() -> None:
    gateway = gateway_with(Fenced(), delay=0.05)
    long = SamplingParams(max_tokens=10_000, seed=3, ignore_eos=True)
    first = asyncio.create_task(gateway.generate(ask(long), "ro-1", "at-1"))
    while not gateway.repeats.running:
        await asyncio.sleep(0)
    waiting = asyncio.create_task(gateway.generate(ask(long), "ro-1", "at-2"))
    await asyncio.sleep(0)
    assert await asyncio.wait_for(gateway.abort("ro-1"), 5) >= 1
    assert (await first).aborted
    while not gateway.in_flight:  # the waiting call is generated now: abort it too
        await asyncio.sleep(0.01)
    assert await asyncio.wait_for(gateway.abort("ro-1"), 5) == 1
    assert (await asyncio.wait_for(waiting, 5)).aborted
    assert served(gateway) == 2 and gateway.repeats.answered == 0 and not gateway.repeats.finished


async def test_engine_repeats_off_generates_every_call() -> None:
    gateway = gateway_with(Fenced("at-1"), reuse=False)
    try:
        await gateway.generate(ask(), "ro-1", "at-1")
    except Conflict:
        pass
    await gateway.generate(ask(), "ro-1", "at-2")
    assert served(gateway) == 2 and not gateway.repeats.finished
