"""The official ``openai`` client, unmodified, against the gateway over real HTTP.

The replica is the real llama.cpp engine with the bundled model (and one test uses the hf
engine), so this covers each engine's HTTP endpoints end to end.
"""

from __future__ import annotations

import importlib.util

import httpx
import pytest
from support import require

from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.client import llm_client
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.model import StepIn

pytestmark = pytest.mark.llamacpp
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


class Recorded:
    """In-memory recorder standing in for the store's add_steps."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str, StepIn]] = []

    async def __call__(self, rollout_id: str, attempt_id: str, step: StepIn) -> None:
        self.steps.append((rollout_id, attempt_id, step))


@pytest.fixture
async def served(llama):
    recorded = Recorded()
    gateway = Gateway(recorded)
    gateway.add_replica(llama, "llama-0")
    async with running_gateway(gateway) as url:
        yield url, recorded, gateway


async def test_gateway_openai_lists_models(served) -> None:
    url, _, _ = served
    async with llm_client(url, "ro-1", "at-1") as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]


async def test_gateway_openai_clients_share_one_pool_that_outlives_them(served) -> None:
    """Each rollout's client rides the runner's pool: one closing its client (``async with``)
    leaves the pool open for the next, and both calls are recorded under their own ids."""
    from rollfleet.engines.gateway.client import SharedPool

    url, recorded, _ = served
    pool = SharedPool()
    try:
        for rollout in ("ro-a", "ro-b"):
            async with llm_client(url, rollout, f"at-{rollout}", http_client=pool) as client:
                await client.chat.completions.create(model="any", messages=QUESTION, max_tokens=4)
        assert not pool.is_closed
        assert [(r, a) for r, a, _ in recorded.steps] == [("ro-a", "at-ro-a"), ("ro-b", "at-ro-b")]
    finally:
        await pool.shut()
    assert pool.is_closed


async def test_gateway_openai_chat_is_answered_and_recorded(served) -> None:
    url, recorded, _ = served
    async with llm_client(url, "ro-1", "at-1") as client:
        reply = await client.chat.completions.create(
            model="any", messages=QUESTION, max_tokens=16, temperature=0, logprobs=True
        )
        choice = reply.choices[0]
        assert "4" in choice.message.content and choice.finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens == len(choice.logprobs.content) > 0
        ((rollout, attempt, step),) = recorded.steps
        p = step.payload
        assert (rollout, attempt, step.kind) == ("ro-1", "at-1", "llm")
        assert p["text"] == choice.message.content and p["messages"] == QUESTION
        assert p["completion_token_ids"] == choice.model_extra["token_ids"]
        assert p["prompt_token_ids"] == reply.model_extra["prompt_token_ids"]
        assert p["logprobs"] == [e.logprob for e in choice.logprobs.content]
        assert p["engine"] == "llamacpp" and p["weights_version"] == 0 and p["latency_s"] > 0


async def test_gateway_openai_chat_streams(served) -> None:
    url, recorded, _ = served
    async with llm_client(url, "ro-2", "at-2") as client:
        stream = await client.chat.completions.create(
            model="any",
            messages=QUESTION,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        ((_, _, step),) = recorded.steps
        assert text == step.payload["text"] and "4" in text
        assert finish == step.payload["finish_reason"]
        assert usage is not None and usage.completion_tokens == len(
            step.payload["completion_token_ids"]
        )


async def test_gateway_openai_completions_plain_and_streamed(served) -> None:
    url, recorded, _ = served
    async with llm_client(url, "ro-3", "at-3") as client:
        plain = await client.completions.create(
            model="any", prompt="The sky is", max_tokens=8, temperature=0, logprobs=1
        )
        assert plain.choices[0].text and len(plain.choices[0].logprobs.token_logprobs) <= 8
        stream = await client.completions.create(
            model="any", prompt="The sky is", max_tokens=8, temperature=0, stream=True
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(pieces) == plain.choices[0].text
        assert [s.payload["prompt"] for _, _, s in recorded.steps] == ["The sky is"] * 2


async def test_gateway_openai_path_prefix_names_the_rollout(served) -> None:
    import openai

    url, recorded, _ = served
    base = f"{url}/r/ro-path/at-path/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0) as client:
        await client.chat.completions.create(model="any", messages=QUESTION, max_tokens=2)
        assert [(r, a) for r, a, _ in recorded.steps] == [("ro-path", "at-path")]


async def test_gateway_openai_abort_endpoint_ends_a_stream_with_partial_output(served) -> None:
    url, recorded, gateway = served
    async with llm_client(url, "ro-long", "at-long") as client:
        stream = await client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Tell me a very long story."}],
            max_tokens=900,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finish, pieces = None, 0
        async for chunk in stream:
            if pieces == 0 and chunk.choices and chunk.choices[0].delta.content:
                async with httpx.AsyncClient() as http:
                    reply = await http.post(f"{url}/v1/rollfleet/abort/ro-long", timeout=10)
                assert reply.json() == {"rollout_id": "ro-long", "aborted": 1}
            pieces += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "abort" and gateway.in_flight == 0
        ((_, _, step),) = recorded.steps
        assert step.payload["finish_reason"] == "abort"
        assert 1 <= len(step.payload["completion_token_ids"]) < 900


async def test_gateway_openai_bad_requests_get_openai_errors(served) -> None:
    import openai

    url, _, _ = served
    async with llm_client(url, "ro-4", "at-4") as client:
        with pytest.raises(openai.UnprocessableEntityError, match="'n'"):
            await client.chat.completions.create(model="any", messages=QUESTION, n=2)
        with pytest.raises(openai.UnprocessableEntityError, match="messages"):
            await client.chat.completions.create(model="any", messages=[])


async def test_gateway_openai_token_is_enforced(llama) -> None:
    import openai

    gateway = Gateway()
    gateway.add_replica(llama)
    async with running_gateway(gateway, token="s3cret") as url:
        async with llm_client(url, "ro", "at") as anonymous:
            with pytest.raises(openai.AuthenticationError):
                await anonymous.models.list()
        async with llm_client(url, "ro", "at", token="s3cret") as client:
            assert (await client.models.list()).data


async def test_gateway_openai_serves_the_hf_engine() -> None:
    require(bool(importlib.util.find_spec("transformers")), "transformers (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    engine = HFEngine(*tiny_hf_model())
    await engine.start()
    recorded = Recorded()
    gateway = Gateway(recorded)
    gateway.add_replica(engine)
    try:
        async with running_gateway(gateway) as url:
            async with llm_client(url, "ro-hf", "at-hf") as client:
                reply = await client.chat.completions.create(
                    model="tiny", messages=QUESTION, max_tokens=6, temperature=0
                )
                assert reply.choices[0].finish_reason in ("stop", "length")
                assert recorded.steps[0][2].payload["engine"] == "hf"
    finally:
        await gateway.close()
