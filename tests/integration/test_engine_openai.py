"""The OpenAI-server engine over real HTTP, against the gateway serving llama.cpp.

The gateway is an OpenAI-compatible server like vLLM or SGLang, so it stands in as the
remote server here with a real model behind it.
"""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.engines.base import FinishReason, Generation, GenerationRequest, SamplingParams
from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.served.openai import OpenAIEngine
from rollfleet.errors import EngineError

pytestmark = pytest.mark.llamacpp
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
async def remote(llama):
    gateway = Gateway()
    gateway.add_replica(llama)
    async with running_gateway(gateway) as url:
        engine = OpenAIEngine(url + "/v1")
        await engine.start()
        yield engine, gateway
        await engine.stop()


async def wait_until(condition, timeout: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


async def test_engine_openai_learns_the_model_and_is_healthy(remote) -> None:
    engine, _ = remote
    assert engine.model == "SmolLM2-135M-Instruct.Q4_1" and await engine.health()
    assert engine.info().base_url == engine.base_url and not engine.base_url.endswith("/v1")


async def test_engine_openai_chat_carries_tokens_and_logprobs(remote) -> None:
    engine, _ = remote
    result = await engine.chat(QUESTION, max_tokens=12, temperature=0)
    assert "4" in result.text and result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert result.prompt_token_ids and result.completion_token_ids
    assert len(result.logprobs or []) == len(result.completion_token_ids)
    assert result.engine == "openai"


async def test_engine_openai_completion_with_token_prompt(remote) -> None:
    engine, _ = remote
    request = GenerationRequest(
        prompt=[1, 4093, 198], params=SamplingParams(max_tokens=5, ignore_eos=True)
    )
    result = await engine.generate(request)
    assert result.prompt_token_ids == [1, 4093, 198] and len(result.completion_token_ids) == 5
    assert result.finish_reason is FinishReason.LENGTH


async def test_engine_openai_abort_closes_the_stream_and_the_server_stops(remote) -> None:
    engine, gateway = remote
    request = GenerationRequest(
        prompt="Once upon a time", params=SamplingParams(max_tokens=900, ignore_eos=True)
    )
    got_token = asyncio.Event()

    async def run() -> Generation:
        async for item in engine.stream(request):
            got_token.set()
            if isinstance(item, Generation):
                return item
        raise AssertionError("no result")

    task = asyncio.create_task(run())
    await asyncio.wait_for(got_token.wait(), 60)
    assert await asyncio.wait_for(engine.abort([request.request_id]), 1.0) == 1
    result = await asyncio.wait_for(task, 10)
    assert result.aborted and 1 <= len(result.completion_token_ids) < 900
    await wait_until(lambda: gateway.in_flight == 0)  # the server side was aborted too


async def test_engine_openai_server_errors_and_weight_updates_are_engine_errors(remote) -> None:
    engine, _ = remote
    with pytest.raises(EngineError, match="HTTP 422"):
        await engine.generate(GenerationRequest(prompt="x", params=SamplingParams(max_tokens=0)))
    with pytest.raises(EngineError, match="cannot load weights"):
        await engine.update_weights("/some/checkpoint")


async def test_engine_openai_unreachable_server_is_a_clear_error() -> None:
    engine = OpenAIEngine("http://127.0.0.1:9")
    with pytest.raises(EngineError, match="cannot list models at http://127.0.0.1:9"):
        await engine.start()
    await engine.stop()
