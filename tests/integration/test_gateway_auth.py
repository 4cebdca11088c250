"""The gateway's bearer token: the same constant-time check as the control plane's, over real HTTP.

The replica is the echo engine (a real BaseEngine that repeats the prompt): this test is about the
gateway's HTTP surface, not about a model.
"""

from __future__ import annotations

import httpx

from rollfleet.engines.echo import EchoEngine
from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway

BODY = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_gateway_answers_only_the_right_bearer_token() -> None:
    engine = EchoEngine()
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine)
    try:
        async with (
            running_gateway(gateway, token="s3cret") as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            for given in (None, "Bearer wrong", "Bearer s3cre", "s3cret"):
                headers = {} if given is None else {"authorization": given}
                refused = await http.post("/v1/chat/completions", json=BODY, headers=headers)
                assert refused.status_code == 401, given
                assert "gateway: missing or wrong bearer token" in refused.text
            ok = await http.post(
                "/v1/chat/completions", json=BODY, headers={"authorization": "Bearer s3cret"}
            )
            assert ok.status_code == 200
            assert ok.json()["choices"][0]["message"]["content"]
    finally:
        await gateway.close()
