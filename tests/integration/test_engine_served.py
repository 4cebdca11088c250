"""vLLM and SGLang engines: launch logic everywhere, real servers only where a GPU is present.

The launch path (argv, health URL, a start-up that fails or times out) runs here for real,
without a GPU. Serving tests are marked ``gpu`` and skip without a GPU and the engine's
package: the only engine tests allowed to skip under ROLLFLEET_REQUIRE_ALL.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from support import free_port

from rollfleet.engines.base import FinishReason, GenerationRequest, SamplingParams
from rollfleet.engines.served.sglang import SGLangEngine
from rollfleet.engines.served.vllm import VLLMEngine
from rollfleet.errors import EngineError

ENGINES = {"vllm": VLLMEngine, "sglang": SGLangEngine}
MODULES = {"vllm": "vllm", "sglang": "sglang"}


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_engine_served_command_lines() -> None:
    vllm = VLLMEngine("org/model", port=8123, extra_args=["--max-model-len", "4096"])
    assert vllm.server.argv == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "org/model",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-model-len",
        "4096",
    ]
    assert vllm.server.health_url == "http://127.0.0.1:8123/health"
    assert vllm.server.env["VLLM_SERVER_DEV_MODE"] == "1"
    sglang = SGLangEngine("org/model", port=8124)
    assert sglang.server.argv[1:4] == ["-m", "sglang.launch_server", "--model-path"]
    body = sglang.body(GenerationRequest(prompt="x", request_id="req-1"))
    assert body["rid"] == "req-1" and body["stream"] is True


@pytest.mark.parametrize("kind", sorted(ENGINES))
async def test_engine_served_launch_failure_is_reported(kind: str) -> None:
    if importlib.util.find_spec(MODULES[kind]):
        pytest.skip(f"{kind} is installed: the failure path is exercised by the gpu tests")
    engine = ENGINES[kind]("org/model", port=free_port(), startup_timeout_s=120)
    with pytest.raises(EngineError, match=rf"{kind}: server exited with code \d+[\s\S]*{kind}"):
        await engine.start()
    assert not engine.server.running


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(ENGINES))
async def test_engine_served_gpu_serves_and_aborts(kind: str) -> None:
    if not has_gpu() or not importlib.util.find_spec(MODULES[kind]):
        pytest.skip(f"needs a GPU and {kind} installed")
    model = os.environ.get("ROLLFLEET_TEST_GPU_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    engine = ENGINES[kind](model, port=free_port(), startup_timeout_s=900)
    await engine.start()
    try:
        assert await engine.health()
        result = await engine.chat([{"role": "user", "content": "2+2?"}], max_tokens=8)
        assert result.completion_token_ids or result.text
        request = GenerationRequest(
            prompt="Once", params=SamplingParams(max_tokens=4000, ignore_eos=True)
        )
        stream = engine.stream(request)
        await stream.__anext__()
        assert await engine.abort([request.request_id]) == 1
        final = [item async for item in stream][-1]
        assert final.finish_reason is FinishReason.ABORT
    finally:
        await engine.stop()
