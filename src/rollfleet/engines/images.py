"""Images in chat requests: OpenAI ``image_url`` parts carrying data URLs, checked and decoded.

A chat message's content may be a list of parts; an image part is ``{"type": "image_url",
"image_url": {"url": "data:image/png;base64,..."}}`` (PNG, JPEG, WebP or GIF).
:func:`request_images` decodes every such part of a conversation once, checks its format by its
first bytes (the declared type must match) and the caps (:data:`MAX_IMAGE_BYTES` decoded per image,
:data:`MAX_IMAGES` per request, and pixels read from the header before any decoding:
:data:`MAX_IMAGE_PIXELS` per image, :data:`MAX_REQUEST_PIXELS` per request), and returns
:class:`ImageInput` records named by their SHA-256. Anything else is an :class:`ImageRefused` (HTTP
400) naming the message and the part. URLs that are not data URLs (``http:``, ``https:``, ``file:``)
are refused: the control plane never fetches a URL or reads a file on a caller's behalf. The one
reference taken is to an image the store holds already, ``rollfleet-blob:<sha256>``
(:func:`resolve_references`, for the gateway of ``rollfleet serve``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollfleet.errors import InvalidInput, NotFound
from rollfleet.store.blobs import PREFIX as BLOB_PREFIX
from rollfleet.store.blobs import Blob

MAX_IMAGE_BYTES = 10 * 1024 * 1024
"""The largest image accepted, decoded (10 MiB)."""
MAX_IMAGES = 32
"""The most images one request may hold (the whole conversation, every turn's)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""The most pixels one image may have, read from its header before anything decodes it (a
few KB of PNG can claim 20000 x 20000: decoded, gigabytes)."""
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS
"""The most pixels all the images of one request may have together."""
FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/webp": "webp", "image/gif": "gif"}
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+/-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)


class ImageRefused(InvalidInput):
    """Raised for an image part that is malformed, too large, not inline, or sent to an engine
    that cannot see (HTTP 400, as OpenAI answers a bad image)."""

    status_code = 400


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request, where it was, and its content hash."""

    sha256: str
    mime: str
    data: bytes = field(repr=False)
    message: int
    part: int
    size: tuple[int, int] = (0, 0)  # (width, height), from the header

    @property
    def where(self) -> str:
        """Where the image sits in the request, for error messages."""
        return f"messages[{self.message}].content[{self.part}]"

    def pil(self) -> Any:
        """The image as an RGB ``PIL.Image`` (ImageRefused when Pillow cannot decode it)."""
        import io

        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(self.data)) as image:
                image.load()
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise ImageRefused(
                f"{self.where}: the {self.mime} image cannot be decoded: {exc}"
            ) from exc


def is_image_part(part: Any) -> bool:
    """True for an OpenAI image content part (``{"type": "image_url", ...}``)."""
    return isinstance(part, dict) and part.get("type") in ("image_url", "image")


def sniff(data: bytes) -> str | None:
    """The image type that ``data`` starts like (``image/png`` …), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def data_url(data: bytes, mime: str | None = None) -> str:
    """``data`` as a base64 data URL (the type sniffed when not given)."""
    kind = mime or sniff(data) or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def image_part(data: bytes, mime: str | None = None) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part holding ``data`` inline."""
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def decode_part(part: dict[str, Any], message: int, index: int) -> ImageInput:
    """Decode and check one image part (ImageRefused naming it when it is not acceptable)."""
    where = f"messages[{message}].content[{index}]"
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ImageRefused(f"{where}: an image_url part needs image_url.url (a data URL)")
    match = _DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "a path"
        raise ImageRefused(
            f"{where}: only inline images are accepted (data:image/png;base64,...); the"
            f" gateway does not fetch URLs or read files ({scheme!r} given)"
        )
    mime = (match.group("mime") or "").lower().replace("image/jpg", "image/jpeg")
    if mime not in FORMATS:
        shown = mime or "(none)"
        raise ImageRefused(f"{where}: image type {shown!r} is not one of {list(FORMATS)}")
    payload = url[match.end() :]
    if len(payload) // 4 * 3 > MAX_IMAGE_BYTES + 3:  # refused before decoding
        raise ImageRefused(f"{where}: the image is over {MAX_IMAGE_BYTES} bytes decoded")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRefused(f"{where}: the data URL is not valid base64: {exc}") from exc
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRefused(f"{where}: the image is {len(data)} bytes, over {MAX_IMAGE_BYTES}")
    found = sniff(data)
    if found != mime:
        raise ImageRefused(
            f"{where}: declared {mime} but the bytes are {found or 'not a known image format'}"
        )
    size = image_size(data, mime)
    if size is None:
        raise ImageRefused(f"{where}: the {mime} image's size cannot be read from its header")
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise ImageRefused(
            f"{where}: the image is {size[0]}x{size[1]} pixels, over {MAX_IMAGE_PIXELS}"
        )
    return ImageInput(hashlib.sha256(data).hexdigest(), mime, data, message, index, size)


def image_size(data: bytes, mime: str) -> tuple[int, int] | None:
    """``(width, height)`` from an image's header, without decoding it (None: unreadable)."""
    if mime == "image/png" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if mime == "image/gif" and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if mime == "image/webp":
        return _webp_size(data)
    if mime == "image/jpeg":
        return _jpeg_size(data)
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    """A WebP's canvas from its first chunk (lossy VP8, lossless VP8L or extended VP8X)."""
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30:
        return (
            int.from_bytes(data[26:28], "little") & 0x3FFF,
            int.from_bytes(data[28:30], "little") & 0x3FFF,
        )
    if chunk == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8X" and len(data) >= 30:
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    return None


_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0..SOF15, not DHT/JPG/DAC


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """A JPEG's size from its first start-of-frame segment."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_FRAMES and i + 9 <= len(data):
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(
                data[i + 5 : i + 7], "big"
            )
        if marker == 0x01 or 0xD0 <= marker <= 0xD9:  # no length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def request_images(messages: list[dict[str, Any]] | None) -> tuple[ImageInput, ...]:
    """Every image part of a conversation, in order, decoded and checked (ImageRefused)."""
    found: list[ImageInput] = []
    for m, message in enumerate(messages or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not is_image_part(part):
                continue
            if len(found) == MAX_IMAGES:
                raise ImageRefused(
                    f"messages[{m}].content[{p}]: more than {MAX_IMAGES} images in one request"
                )
            found.append(decode_part(part, m, p))
            pixels = sum(i.size[0] * i.size[1] for i in found)
            if pixels > MAX_REQUEST_PIXELS:
                raise ImageRefused(
                    f"messages[{m}].content[{p}]: the request's images hold {pixels} pixels"
                    f" up to here, over {MAX_REQUEST_PIXELS}"
                )
    return tuple(found)


BlobSource = Callable[[str], Awaitable[Blob]]
# the images a caller may show: every stored one (None: the operator), or a rollout's own
BlobScope = Callable[[str | None], BlobSource]


async def resolve_references(
    messages: list[dict[str, Any]], blobs: BlobSource | None
) -> list[dict[str, Any]]:
    """The messages with every ``rollfleet-blob:<sha256>`` image url (an image the store holds
    already: an agent sends a screenshot inline once, then by its hash) as a data URL again.
    ImageRefused naming the part when no store is behind this gateway or it holds no such image."""
    refs = [
        (m, p)
        for m, message in enumerate(messages)
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for p, part in enumerate(message["content"])
        if is_image_part(part) and _url(part).startswith(BLOB_PREFIX)
    ]
    if not refs:
        return messages
    if len(refs) > MAX_IMAGES:
        raise ImageRefused(f"more than {MAX_IMAGES} images in one request")
    out = list(messages)
    for m, p in refs:
        where = f"messages[{m}].content[{p}]"
        if blobs is None:
            raise ImageRefused(f"{where}: {BLOB_PREFIX} references need the gateway of a store")
        sha = _url(messages[m]["content"][p])[len(BLOB_PREFIX) :]
        try:
            blob = await blobs(sha)
        except NotFound as exc:
            raise ImageRefused(f"{where}: the store holds no image {sha[:64]!r}") from exc
        content = list(out[m]["content"]) if out[m] is messages[m] else out[m]["content"]
        content[p] = image_part(blob.data, blob.media_type)
        out[m] = {**out[m], "content": content}
    return out


def _url(part: dict[str, Any]) -> str:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    return url if isinstance(url, str) else ""


def cannot_see(engine: str) -> ImageRefused:
    """The refusal of an engine that cannot take images."""
    return ImageRefused(
        f"engine {engine} cannot take images: send them to a vision engine (an HF"
        " vision-language model, llama.cpp with a projector, or an OpenAI-compatible server)"
    )
