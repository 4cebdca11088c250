"""A push to a gateway whose replica is a remote OpenAI server (which has no way to load
weights) is refused through the route: HTTP 422 with a message that says why, no version."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
from support import require

from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.served.openai import OpenAIEngine
from rollfleet.engines.weights.push import push_weights, weights_url
from rollfleet.engines.weights.wire import encode
from rollfleet.errors import InvalidInput

REFUSAL = "remote-0: openai: a generic OpenAI server cannot load weights"


@pytest.mark.parametrize("transport", ["http", "file"])
async def test_a_push_to_an_openai_remote_replica_is_422_and_changes_no_version(
    transport: str,
) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (rollfleet[hf])")
    import torch

    tensors = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(2, 4))]
    engine = OpenAIEngine("http://127.0.0.1:9", "remote-model")  # never contacted
    gateway = Gateway()
    gateway.add_replica(engine, "remote-0")
    try:
        async with running_gateway(gateway, token="s3cret") as url:
            with pytest.raises(InvalidInput, match=REFUSAL):
                await push_weights(url, tensors, version=1, token="s3cret", transport=transport)
            headers = {"content-type": "application/octet-stream", "authorization": "Bearer s3cret"}
            body = b"".join(bytes(part) for part in encode(tensors))
            async with httpx.AsyncClient() as client:
                reply = await client.put(weights_url(url, 1), content=body, headers=headers)
        assert reply.status_code == 422
        assert reply.json()["error"]["message"].startswith(REFUSAL)
        assert "use the vllm or sglang engine" in reply.json()["error"]["message"]
        assert gateway.weights_version == 0 and engine.version == 0
    finally:
        await gateway.close()
