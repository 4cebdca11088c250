"""Images through the real gateway over HTTP: OpenAI image_url parts reach the engines that see
(a tiny random VLM built from a config, and a stub OpenAI server standing in for a remote paid
API), are refused with a 400 naming the part when malformed, remote or too many, and with a 400
naming the engine when no replica can see; never a 500, never silently dropped."""

from __future__ import annotations

import importlib.util
import io
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from support import require

from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.images import MAX_IMAGES, image_part
from rollfleet.model import StepIn


def png(shade: int, size: tuple[int, int] = (80, 60)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (shade, 120, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def ask(*parts: dict, stream: bool = False, **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is on the screen?"}, *parts]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


@pytest.fixture
async def mixed() -> AsyncIterator[tuple[httpx.AsyncClient, list[StepIn]]]:
    """A gateway over HTTP with a text-only HF replica and a tiny random VLM replica."""
    have = importlib.util.find_spec("transformers") and importlib.util.find_spec("PIL")
    require(bool(have), "transformers, torch and Pillow (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.hf.vision import HFVisionEngine
    from rollfleet.engines.tiny import tiny_hf_model, tiny_vlm

    recorded: list[StepIn] = []

    async def record(rollout_id: str, attempt_id: str, step: StepIn) -> None:
        recorded.append(step)

    gateway = Gateway(record)
    for engine, name in (
        (HFEngine(*tiny_hf_model()), "text-0"),
        (HFVisionEngine(*tiny_vlm()), "vlm-0"),
    ):
        await engine.start()
        gateway.add_replica(engine, name)
    try:
        async with running_gateway(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            yield client, recorded
    finally:
        await gateway.close()


async def test_gateway_images_go_to_the_replica_that_sees_with_tokens_and_logprobs(mixed) -> None:
    client, recorded = mixed
    for i in range(4):  # least-loaded routing would send some to the text replica
        body = ask(image_part(png(10 * i)), logprobs=True)
        answer = await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"X-Rollfleet-Rollout": f"ro-{i}", "X-Rollfleet-Attempt": "at-1"},
        )
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["rollfleet"]["engine"] == "hf-vision"
        assert len(got["choices"][0]["token_ids"]) == 6
        assert len(got["choices"][0]["logprobs"]["content"]) == 6
        assert len(got["prompt_token_ids"]) > 20  # the image's tiles and global view
    assert [step.payload["replica"] for step in recorded] == ["vlm-0"] * 4
    text = await client.post("/v1/chat/completions", json=ask())
    assert text.status_code == 200


async def test_gateway_images_stream_from_the_vision_replica(mixed) -> None:
    client, _ = mixed
    async with client.stream(
        "POST", "/v1/chat/completions", json=ask(image_part(png(3)), stream=True)
    ) as answer:
        assert answer.status_code == 200
        lines = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    frames = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(len(f["choices"][0].get("token_ids") or []) for f in frames if f["choices"]) == 6


@pytest.mark.parametrize(
    ("parts", "words"),
    [
        (
            [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
            "messages[0].content[1]: only inline images are accepted",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
            "does not fetch URLs or read files ('file' given)",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
            "messages[0].content[1]: the data URL is not valid base64",
        ),
        (
            [image_part(png(1))] * (MAX_IMAGES + 1),
            f"messages[0].content[{MAX_IMAGES + 1}]: more than {MAX_IMAGES} images",
        ),
        (
            [image_part(png(1)[:16] + (20000).to_bytes(4, "big") * 2 + png(1)[24:])],
            "messages[0].content[1]: the image is 20000x20000 pixels",  # a bomb, never decoded
        ),
        (
            [image_part(png(1)[:60])],  # a PNG cut short: its header passes, Pillow cannot decode
            "messages[0].content[1]: the image/png image cannot be decoded",
        ),
    ],
)
async def test_gateway_images_bad_ones_are_400_naming_the_part(mixed, parts, words) -> None:
    client, _ = mixed
    answer = await client.post("/v1/chat/completions", json=ask(*parts))
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]["message"]
    assert answer.json()["error"]["type"] == "ImageRefused"


@pytest.fixture
async def text_only() -> AsyncIterator[httpx.AsyncClient]:
    require(bool(importlib.util.find_spec("transformers")), "transformers and torch")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    gateway = Gateway()
    engine = HFEngine(*tiny_hf_model())
    await engine.start()
    gateway.add_replica(engine)
    try:
        async with running_gateway(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            yield client
    finally:
        await gateway.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_gateway_images_to_an_engine_that_cannot_see_are_a_400(text_only, stream) -> None:
    answer = await text_only.post(
        "/v1/chat/completions", json=ask(image_part(png(9)), stream=stream)
    )
    assert answer.status_code == 400, answer.text
    assert "engine hf cannot take images" in answer.json()["error"]["message"]
    plain = await text_only.post("/v1/chat/completions", json=ask(stream=stream))
    assert plain.status_code == 200
    if not stream:  # text parts alone are the text itself, not a Python repr of the parts
        same = ask()
        same["messages"][0]["content"] = "What is on the screen?"
        as_string = await text_only.post("/v1/chat/completions", json=same)
        assert plain.json()["prompt_token_ids"] == as_string.json()["prompt_token_ids"]


class _StubOpenAI(BaseHTTPRequestHandler):
    """A fake of a remote paid OpenAI-compatible API: records each body, answers one chunk."""

    bodies: list[dict[str, Any]] = []

    def do_GET(self) -> None:  # noqa: N802
        self._send(b'{"data": [{"id": "stub-vlm"}]}', "application/json")

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.bodies.append(json.loads(raw))
        chunk = {
            "choices": [{"index": 0, "delta": {"content": "a red box"}, "finish_reason": "stop"}]
        }
        self._send(
            b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n", "text/event-stream"
        )

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub_remote() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubOpenAI)
    _StubOpenAI.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _StubOpenAI.bodies
    finally:
        server.shutdown()
        server.server_close()


async def test_gateway_images_forwarded_unchanged_to_a_fake_remote_openai_api(stub_remote) -> None:
    from rollfleet.engines.served.openai import OpenAIEngine

    remote, bodies = stub_remote
    engine = OpenAIEngine(remote)
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine)
    body = ask(image_part(png(7)), {"type": "text", "text": "and this one"}, image_part(png(8)))
    try:
        async with running_gateway(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            answer = await client.post("/v1/chat/completions", json=body)
            refused = await client.post(
                "/v1/chat/completions",
                json=ask({"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}),
            )
    finally:
        await gateway.close()
    assert (
        answer.status_code == 200
        and answer.json()["choices"][0]["message"]["content"] == "a red box"
    )
    assert len(bodies) == 1 and bodies[0]["messages"] == body["messages"]  # byte for byte
    assert refused.status_code == 400  # the gateway refused it; the remote never saw it
