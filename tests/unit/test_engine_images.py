"""Image parts in chat requests: decoded once, checked by their bytes, capped, refused clearly."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest

from rollfleet.engines.base import GenerationRequest
from rollfleet.engines.echo import EchoEngine
from rollfleet.engines.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    ImageRefused,
    image_part,
    request_images,
)


def encoded(kind: str, color: tuple[int, int, int] = (200, 30, 40)) -> bytes:
    """A small real image in ``kind`` (PNG, JPEG, WEBP, GIF), encoded by Pillow."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (12, 9), color).save(buffer, kind)
    return buffer.getvalue()


def user(*parts: dict) -> list[dict]:
    return [{"role": "system", "content": "look"}, {"role": "user", "content": list(parts)}]


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "GIF"])
def test_engine_images_every_accepted_format_decodes_with_its_hash_and_place(kind: str) -> None:
    data = encoded(kind)
    request = GenerationRequest(messages=user({"type": "text", "text": "hi"}, image_part(data)))
    (image,) = request.images
    assert (image.data, image.sha256) == (data, hashlib.sha256(data).hexdigest())
    assert (image.message, image.part, image.mime) == (1, 1, f"image/{kind.lower()}")
    assert image.pil().size == (12, 9)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://example.com/cat.png", "does not fetch URLs or read files ('https' given)"),
        ("http://127.0.0.1:8300/v1/models", "does not fetch URLs"),
        ("file:///etc/passwd", "('file' given)"),
        ("/etc/passwd", "only inline images"),
        ("data:image/png;base64,!!!not-base64", "not valid base64"),
        ("data:image/tiff;base64,AAAA", "'image/tiff' is not one of"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a....").decode(), "are image/gif"),
        ("data:image/jpeg;base64," + base64.b64encode(b"hello").decode(), "not a known image"),
    ],
)
def test_engine_images_refusals_are_400_naming_message_and_part(url: str, words: str) -> None:
    part = {"type": "image_url", "image_url": {"url": url}}
    with pytest.raises(ImageRefused) as refused:
        GenerationRequest(messages=user({"type": "text", "text": "hi"}, part))
    assert refused.value.status_code == 400
    assert refused.value.message.startswith("messages[1].content[1]: ")
    assert words in refused.value.message


def test_engine_images_caps_size_before_decoding_and_count_per_request() -> None:
    huge = "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES // 3 * 4 + 8)
    with pytest.raises(ImageRefused, match=rf"content\[0\]: the image is over {MAX_IMAGE_BYTES}"):
        request_images(user({"type": "image_url", "image_url": {"url": huge}}))
    many = user(*[image_part(encoded("PNG", (i, 0, 0))) for i in range(MAX_IMAGES + 1)])
    with pytest.raises(ImageRefused, match=rf"content\[{MAX_IMAGES}\]: more than {MAX_IMAGES}"):
        request_images(many)
    assert len(request_images(many[:1] + [{"role": "user", "content": many[1]["content"][:-1]}]))


def test_engine_images_a_corrupt_image_with_a_good_header_is_refused_when_decoded() -> None:
    data = encoded("PNG")[:40]  # the PNG signature and part of its header, then nothing
    (image,) = request_images(user(image_part(data)))
    with pytest.raises(
        ImageRefused, match=r"messages\[1\].content\[0\]: the image/png image cannot"
    ):
        image.pil()


async def test_engine_images_an_engine_that_cannot_see_refuses_instead_of_dropping() -> None:
    engine = EchoEngine()
    await engine.start()
    assert engine.info().vision is False
    request = GenerationRequest(
        messages=user({"type": "text", "text": "hi"}, image_part(encoded("PNG")))
    )
    with pytest.raises(ImageRefused, match="engine echo cannot take images"):
        await engine.generate(request)
    text_only = GenerationRequest(messages=user({"type": "text", "text": "hi"}))
    assert (await engine.generate(text_only)).text == "hi"
