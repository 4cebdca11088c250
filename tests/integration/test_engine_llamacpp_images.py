"""llama.cpp and images: without a projector the engine cannot see and refuses images (a 400
through the gateway, never dropped); with one, the projector file is checked before anything
loads. No projector (mmproj) file exists here, so the vision generation path is not run."""

from __future__ import annotations

import io

import httpx
import pytest

from rollfleet.engines.base import GenerationRequest
from rollfleet.engines.factory import make_engine
from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.images import ImageRefused, image_part
from rollfleet.errors import EngineError


def tiny_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buffer, "PNG")
    return buffer.getvalue()


def test_engine_llamacpp_images_a_missing_or_invalid_projector_is_a_clear_error(tmp_path) -> None:
    from rollfleet.engines.llamacpp.vision import LlamaCppVisionEngine

    missing = tmp_path / "mmproj-missing.gguf"
    with pytest.raises(EngineError, match=f"projector \\(mmproj\\) file {missing} does not exist"):
        make_engine("llamacpp", mmproj=str(missing))
    not_gguf = tmp_path / "mmproj.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a projector")
    with pytest.raises(EngineError, match=f"{not_gguf} is not a GGUF projector"):
        LlamaCppVisionEngine(None, not_gguf)
    with pytest.raises(EngineError, match="does not exist"):
        LlamaCppVisionEngine(None, tmp_path)  # a directory is not a file


@pytest.mark.llamacpp
async def test_engine_llamacpp_images_without_a_projector_are_refused_not_dropped(llama) -> None:
    question = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What colour?"}, image_part(tiny_png())],
        }
    ]
    assert llama.info().vision is False
    with pytest.raises(ImageRefused, match="engine llamacpp cannot take images"):
        await llama.generate(GenerationRequest(messages=question))
    gateway = Gateway()
    gateway.add_replica(llama)
    async with running_gateway(gateway) as url, httpx.AsyncClient(base_url=url) as client:
        answer = await client.post(
            "/v1/chat/completions", json={"messages": question, "max_tokens": 4}
        )
    assert answer.status_code == 400
    assert "engine llamacpp cannot take images" in answer.json()["error"]["message"]
