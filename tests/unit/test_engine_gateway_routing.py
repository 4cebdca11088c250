"""Gateway routing and recording, with the shipped echo engine (no model, no I/O)."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollfleet.engines.base import FinishReason, Generation, GenerationRequest, SamplingParams
from rollfleet.engines.echo import EchoEngine
from rollfleet.engines.gateway.gateway import Gateway, Router
from rollfleet.errors import EngineError, NotFound
from rollfleet.model import StepIn


class Recorded:
    """In-memory recorder: what the control plane's add_steps would receive."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str, StepIn]] = []

    async def __call__(self, rollout_id: str, attempt_id: str, step: StepIn) -> None:
        self.steps.append((rollout_id, attempt_id, step))


def echo_gateway(
    replicas: int = 2, capacity: int = 2, delay: float = 0.0, recorder: Recorded | None = None
) -> Gateway:
    gateway = Gateway(recorder, rng=random.Random(0))
    for i in range(replicas):
        gateway.add_replica(EchoEngine(token_delay_s=delay, max_concurrency=capacity), f"r{i}")
    return gateway


def test_engine_gateway_router_prefers_the_least_loaded_replica() -> None:
    gateway = echo_gateway(3)
    router = gateway.router
    router.replicas["r0"].in_flight, router.replicas["r1"].in_flight = 2, 1
    assert router.pick(None).replica_id == "r2"


def test_engine_gateway_router_breaks_ties_at_random() -> None:
    router = echo_gateway(3).router
    assert {router.pick(None).replica_id for _ in range(60)} == {"r0", "r1", "r2"}


def test_engine_gateway_router_sticks_while_the_replica_has_room() -> None:
    router = echo_gateway(2, capacity=4).router
    first = router.pick("ro-1")
    first.in_flight = 3  # busier than the other, but not full
    assert router.pick("ro-1") is first
    assert router.repins == 0


def test_engine_gateway_router_repins_when_the_sticky_replica_is_full() -> None:
    router = echo_gateway(2, capacity=2).router
    first = router.pick("ro-1")
    first.in_flight = 2
    second = router.pick("ro-1")
    assert second is not first and router.repins == 1
    assert router.sticky["ro-1"] == second.replica_id
    second.in_flight = 2  # now everyone is full: stay put rather than bounce
    assert router.pick("ro-1") is second


def test_engine_gateway_router_without_replicas_says_so() -> None:
    with pytest.raises(EngineError, match="no engine replica"):
        Router().pick("ro-1")


async def test_engine_gateway_records_each_call_as_an_llm_step() -> None:
    recorded = Recorded()
    gateway = echo_gateway(recorder=recorded)
    request = GenerationRequest(messages=[{"role": "user", "content": "hello"}])
    result = await gateway.generate(request, "ro-1", "at-1")
    assert result.text == "hello" and result.finish_reason is FinishReason.STOP
    ((rollout, attempt, step),) = recorded.steps
    assert (rollout, attempt, step.kind) == ("ro-1", "at-1", "llm")
    p = step.payload
    assert p["messages"] == request.messages and p["completion_token_ids"] == [
        ord(c) for c in "hello"
    ]
    assert p["prompt_token_ids"] and p["logprobs"] == [0.0] * 5 and p["finish_reason"] == "stop"
    assert p["engine"] == "echo" and p["weights_version"] == 0 and p["latency_s"] >= 0
    assert p["usage"]["completion_tokens"] == 5 and p["replica"] in {"r0", "r1"}


async def test_engine_gateway_does_not_record_calls_without_a_rollout() -> None:
    recorded = Recorded()
    await echo_gateway(recorder=recorded).generate(GenerationRequest(prompt="x"))
    assert recorded.steps == []


async def test_engine_gateway_abort_stops_only_that_rollouts_calls() -> None:
    recorded = Recorded()
    gateway = echo_gateway(capacity=8, delay=0.05, recorder=recorded)
    long = SamplingParams(max_tokens=10_000, ignore_eos=True)
    started = asyncio.Event()

    async def call(rollout: str) -> Generation:
        out = None
        async for item in gateway.stream(GenerationRequest(prompt="x", params=long), rollout, "at"):
            started.set()
            out = item
        assert isinstance(out, Generation)
        return out

    victims = [asyncio.create_task(call("ro-a")) for _ in range(3)]
    bystander = asyncio.create_task(call("ro-b"))
    await asyncio.wait_for(started.wait(), 10)
    assert await asyncio.wait_for(gateway.abort("ro-a"), 5) == 3
    results = await asyncio.wait_for(asyncio.gather(*victims), 5)
    assert all(r.aborted and len(r.completion_token_ids) < 10_000 for r in results)
    assert not bystander.done()
    assert await gateway.abort("ro-b") == 1
    assert (await asyncio.wait_for(bystander, 5)).aborted
    assert [s.payload["finish_reason"] for _, _, s in recorded.steps] == ["abort"] * 4


async def test_engine_gateway_replicas_can_be_added_and_removed_at_run_time() -> None:
    gateway = echo_gateway(1)
    extra = EchoEngine(model="other")
    await extra.start()
    rid = gateway.add_replica(extra)
    assert gateway.models() == ["echo", "other"]
    with pytest.raises(EngineError, match="already exists"):
        gateway.add_replica(extra, rid)
    assert await gateway.remove_replica(rid) is extra and not extra.started
    assert [r["replica_id"] for r in gateway.replicas()] == ["r0"]
    with pytest.raises(NotFound):
        await gateway.remove_replica(rid)
    await gateway.close()
    with pytest.raises(EngineError, match="no engine replica"):
        await gateway.generate(GenerationRequest(prompt="x"))


async def test_engine_gateway_a_refused_recording_fails_the_call() -> None:
    from rollfleet.errors import Conflict

    async def fenced(rollout_id: str, attempt_id: str, step: StepIn) -> None:
        raise Conflict(f"attempt {attempt_id} is no longer current")

    gateway = Gateway(fenced)
    gateway.add_replica(EchoEngine())
    with pytest.raises(Conflict, match="at-old is no longer current"):
        await gateway.generate(GenerationRequest(prompt="x"), "ro-1", "at-old")
    assert gateway.in_flight == 0 and gateway.router.replicas["echo-1"].in_flight == 0


async def test_engine_gateway_an_aborted_call_of_a_fenced_attempt_still_returns_its_partial_output() -> (
    None
):
    from rollfleet.errors import Conflict

    refused: list[str] = []

    async def fenced(rollout_id: str, attempt_id: str, step: StepIn) -> None:
        refused.append(step.payload["finish_reason"])  # cancelled in the store before the abort
        raise Conflict(f"attempt {attempt_id} is cancelled")

    gateway = Gateway(fenced)
    gateway.add_replica(EchoEngine(token_delay_s=0.01))
    long = SamplingParams(max_tokens=10_000, ignore_eos=True)
    items = gateway.stream(GenerationRequest(prompt="x", params=long), "ro-1", "at-cancelled")
    assert not isinstance(await anext(items), Generation)  # generating now
    aborting = asyncio.create_task(gateway.abort("ro-1"))
    rest = [item async for item in items]
    assert await aborting == 1 and refused == ["abort"]
    result = rest[-1]
    assert (
        isinstance(result, Generation)
        and result.aborted
        and 1 <= len(result.completion_token_ids) < 10_000
    )
    assert gateway.in_flight == 0
