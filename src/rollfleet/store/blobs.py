"""Images in trajectories, stored once by content.

A step's payload may carry images as data URLs (an OpenAI ``image_url`` part: a screenshot the
agent showed the model). Every LLM call of a multi-turn conversation resends the whole
conversation, so storing them inline would store the first screenshot once per turn, as base64.
Instead ``add_steps`` swaps each ``data:image/…;base64,…`` string for ``rollfleet-blob:<sha256>``
and keeps the bytes once in the ``blobs`` table; ``inline_images`` swaps them back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PREFIX = "rollfleet-blob:"
MARKER = "data:image/"  # cheap test on a serialized payload before walking it
MAX_BLOB_BYTES = 16 << 20  # one image, decoded; a larger one stays inline (request caps bound it)
_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]{1,40});base64,(.*)", re.S)
_REF = re.compile(rf"{PREFIX}([0-9a-f]{{64}})")


@dataclass(frozen=True)
class Blob:
    """One stored image: its bytes, their sha256 and media type."""

    sha256: str
    media_type: str
    data: bytes


def _decode(url: str) -> Blob | None:
    """The blob a data URL holds; None for a string that is not a valid image data URL (it is
    stored as the text it is: a model's reply that looks like one must not fail its recording)."""
    match = _DATA_URL.fullmatch(url)
    if match is None:
        return None
    try:
        data = base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(data) > MAX_BLOB_BYTES:
        return None
    return Blob(hashlib.sha256(data).hexdigest(), match.group(1), data)


def extract_images(value: Any, found: dict[str, Blob]) -> Any:
    """``value`` with every image data URL replaced by its reference; the blobs go in ``found``."""
    if isinstance(value, str):
        if not value.startswith(MARKER):
            return value
        blob = _decode(value)
        if blob is None:
            return value
        found.setdefault(blob.sha256, blob)
        return PREFIX + blob.sha256
    if isinstance(value, dict):
        return {k: extract_images(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [extract_images(v, found) for v in value]
    return value


def image_refs(value: Any) -> list[str]:
    """The sha256 of every image referenced in ``value``, in order of appearance, each once."""
    seen: dict[str, None] = {}

    def walk(v: Any) -> None:
        if isinstance(v, str):
            match = _REF.fullmatch(v)
            if match:
                seen.setdefault(match.group(1), None)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, list):
            for item in v:
                walk(item)

    walk(value)
    return list(seen)


def inline_images(value: Any, get: Callable[[str], Blob]) -> Any:
    """``value`` with every reference replaced by its data URL again (what the model was sent)."""
    if isinstance(value, str):
        match = _REF.fullmatch(value)
        if match is None:
            return value
        blob = get(match.group(1))
        return f"data:{blob.media_type};base64,{base64.b64encode(blob.data).decode()}"
    if isinstance(value, dict):
        return {k: inline_images(v, get) for k, v in value.items()}
    if isinstance(value, list):
        return [inline_images(v, get) for v in value]
    return value
