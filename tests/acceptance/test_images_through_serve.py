"""Images through the whole system (issue 20): `rollfleet serve --engine hf --model tiny-vlm` (a tiny
random VLM built from a config: no VLM weights can be downloaded here) answers a chat call that shows
an image on behalf of a rollout, then one that shows it by reference to the store; the recorded
steps keep the image once, by content; a text-only engine refuses images with a 400 naming itself,
never dropping them."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

import httpx
import pytest
from support import ServeProcess

from rollfleet.client import HttpStore
from rollfleet.store.blobs import PREFIX, image_refs

pytestmark = pytest.mark.timeout(240)


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (10, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


def ask(image: bytes) -> dict:  # type: ignore[type-arg]
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {
        "model": "any",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is on the screen?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }


async def test_a_tiny_random_vlm_built_from_a_config_sees_an_image_and_the_step_keeps_it_once(
    tmp_path: Path,
) -> None:
    server = ServeProcess(
        f"sqlite:///{tmp_path}/v.db", "--engine", "hf", "--model", "tiny-vlm"
    ).start(timeout=180)
    store = HttpStore(server.url)
    try:
        await store.enqueue_rollout({"task": "look"}, rollout_id="sees")
        attempt = (await store.claim("w"))[0].attempt.attempt_id
        image = png()
        sha = hashlib.sha256(image).hexdigest()
        async with httpx.AsyncClient(timeout=120) as http:
            path = f"{server.url}/r/sees/{attempt}/v1/chat/completions"
            first = await http.post(path, json=ask(image))  # inline, once
            by_ref = ask(image)  # then by its hash: the store holds it now
            by_ref["messages"][0]["content"][1]["image_url"]["url"] = PREFIX + sha
            second = await http.post(path, json=by_ref)
            for answer in (first, second):
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] >= 1
            by_ref["messages"][0]["content"][1]["image_url"]["url"] = PREFIX + "0" * 64
            unknown = await http.post(path, json=by_ref)
            assert unknown.status_code == 400 and "messages[0].content[1]" in unknown.text, (
                unknown.text
            )
        steps = (await store.query_steps("sees")).items
        assert [s.kind for s in steps] == ["llm", "llm"]
        assert all(image_refs(s.payload) == [sha] for s in steps) and "base64" not in str(
            steps[0].payload
        )
        assert (await store.get_blob(sha)).data == image
    finally:
        await store.close()
        server.kill()


def test_a_text_only_engine_refuses_images_by_name(tmp_path: Path) -> None:
    server = ServeProcess(f"sqlite:///{tmp_path}/t.db", "--engine", "hf", "--model", "tiny").start(
        timeout=180
    )
    try:
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=ask(png()), timeout=120)
        assert answer.status_code == 400 and "cannot take images" in answer.text, answer.text
    finally:
        server.kill()


def test_a_projector_is_only_for_llamacpp() -> None:
    from rollfleet.engines.factory import make_engine
    from rollfleet.errors import InvalidInput

    with pytest.raises(
        InvalidInput, match="--mmproj is a llama.cpp projector; engine 'hf' takes none"
    ):
        make_engine("hf", model="tiny", mmproj="/tmp/mmproj.gguf")


async def test_a_reference_needs_a_store_behind_the_gateway() -> None:
    from rollfleet.engines.images import ImageRefused, resolve_references

    shown = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": PREFIX + "a" * 64}}],
        }
    ]
    with pytest.raises(
        ImageRefused, match=r"messages\[0\]\.content\[0\]: rollfleet-blob: references need"
    ):
        await resolve_references(shown, None)
    plain = [{"role": "user", "content": "no images"}]
    assert await resolve_references(plain, None) is plain
