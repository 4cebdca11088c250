"""Image bombs: a few KB of image whose header claims more pixels than the gateway will decode are
refused from the header, naming the part, before anything is decoded (the HTTP 400 through the
real gateway is a row of test_gateway_images.py)."""

from __future__ import annotations

import io
import struct
import zlib

import pytest

from rollfleet.engines.images import (
    MAX_IMAGE_PIXELS,
    MAX_REQUEST_PIXELS,
    ImageRefused,
    image_part,
    request_images,
)


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` grey pixels, then one small IDAT (what
    an 11 KB bomb sends: rows of zeros compress to nothing)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\0" * (width + 1) * 4)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    )


def gif_claiming(width: int, height: int) -> bytes:
    """A GIF header whose logical screen is ``width`` x ``height``."""
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\0\0\0;"


def ask(*images: bytes) -> list[dict]:
    content = [{"type": "text", "text": "look"}, *(image_part(i) for i in images)]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("make", [png_claiming, gif_claiming], ids=["png", "gif"])
def test_a_header_claiming_too_many_pixels_is_refused_before_decoding(make) -> None:
    bomb = make(20000, 20000)
    assert len(bomb) < 20_000
    with pytest.raises(
        ImageRefused, match=r"messages\[0\]\.content\[1\]: the image is 20000x20000"
    ):
        request_images(ask(bomb))


def test_images_under_the_cap_each_but_over_it_together_are_refused_at_the_part() -> None:
    side = int(MAX_IMAGE_PIXELS**0.5)
    fine = png_claiming(side, side)
    assert len(request_images(ask(fine, fine))) == 2  # exactly the request's cap
    assert 2 * side * side == MAX_REQUEST_PIXELS
    with pytest.raises(ImageRefused, match=r"messages\[0\]\.content\[3\]: the request's images"):
        request_images(ask(fine, fine, png_claiming(4, 4)))


def test_a_real_image_reads_its_size_from_every_format() -> None:
    from PIL import Image

    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        buffer = io.BytesIO()
        Image.new("RGB", (37, 21), (1, 2, 3)).save(buffer, fmt)
        (found,) = request_images(ask(buffer.getvalue()))
        assert found.size == (37, 21), fmt


def test_a_header_too_short_to_give_a_size_is_refused() -> None:
    with pytest.raises(ImageRefused, match="size cannot be read from its header"):
        request_images(ask(b"\xff\xd8\xff\xe0" + b"\0" * 20))
