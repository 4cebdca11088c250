"""Weights from a trainer to the gateway's engines: a framed, checksummed stream of buckets.

One push is one HTTP request (``PUT /v1/rollfleet/weights/{version}``, body
``application/octet-stream``) whose body is::

    b"RFW1"
    (u32 header length, header JSON, payload)   one per bucket
    u32 0                                        the end

A header is ``{"tensors": [[name, dtype, shape, nbytes], ...], "crc32": int}``; its payload is
the tensors' bytes back to back. Buckets come from :func:`rollfleet.engines.buckets.bucket_tensors`,
so neither side holds more than one bucket beyond the tensors themselves. Nothing is applied
until the end marker arrives and every checksum matched: a trainer killed mid-push, a corrupt
bucket or a refused tensor leaves every engine on its old weights, and the next push starts
afresh (there is no upload state to clean up).

Every size a caller sets is capped (header, bucket, tensor count, total bytes), dtypes are an
allow-list, and each tensor's byte count must equal its shape times its element size.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rollfleet.engines.buckets import bucket_tensors
from rollfleet.errors import InvalidInput

MAGIC = b"RFW1"
MAX_HEADER = 1 << 20  # bytes of one bucket's header
MAX_BUCKET = 4 << 30  # bytes of one bucket's payload
MAX_TENSORS = 1_000_000
MAX_TOTAL = 256 << 30  # bytes of one push
PUSH_BUCKET_BYTES = 64 << 20  # small enough to checksum while the next one is on the wire
DTYPES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """One tensor inside a bucket's payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _raw(tensor: Any) -> memoryview:
    """The bytes of a torch tensor or numpy array, without a copy when it is contiguous."""
    if hasattr(tensor, "detach"):  # torch: bfloat16 has no numpy dtype, so go through uint8
        import torch

        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        view: memoryview = flat.numpy().data
        return view
    import numpy as np

    return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data


def encode(
    tensors: Iterable[tuple[str, Any]], bucket_bytes: int = PUSH_BUCKET_BYTES
) -> Iterator[bytes | memoryview]:
    """The body of a push: the magic, each bucket's header and payload, the end marker."""
    yield MAGIC
    for bucket in bucket_tensors(tensors, bucket_bytes):
        views = [(name, tensor, _raw(tensor)) for name, tensor in bucket.items]
        crc = 0
        for _, _, view in views:
            crc = zlib.crc32(view, crc)
        header = {
            "tensors": [
                [name, _dtype_name(t), list(t.shape), view.nbytes] for name, t, view in views
            ],
            "crc32": crc,
        }
        head = json.dumps(header).encode()
        yield struct.pack("<I", len(head)) + head
        yield from (view for _, _, view in views)
    yield struct.pack("<I", 0)


def parse_header(raw: bytes) -> tuple[list[TensorHeader], int]:
    """A bucket header's tensors and checksum; InvalidInput naming what is wrong."""
    try:
        header = json.loads(raw)
        crc = header["crc32"]
        entries = header["tensors"]
        if not isinstance(crc, int) or not isinstance(entries, list):
            raise TypeError("crc32 must be an integer and tensors a list")
        found = [_tensor_header(entry) for entry in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"weights: unreadable bucket header: {exc}") from exc
    return found, crc


def _tensor_header(entry: Any) -> TensorHeader:
    name, dtype, shape, nbytes = entry
    if not isinstance(name, str) or not 0 < len(name) <= 1024:
        raise TypeError(f"tensor name {name!r} must be a string of 1 to 1024 characters")
    if dtype not in DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > 8:
        raise TypeError(f"tensor {name!r}: shape must be a list of at most 8 sizes")
    if not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
        raise TypeError(f"tensor {name!r}: shape {shape} has a size that is not a count")
    count = 1
    for d in shape:
        count *= d
    if nbytes != count * DTYPES[dtype]:
        raise TypeError(f"tensor {name!r}: {nbytes} bytes do not hold {dtype} of shape {shape}")
    return TensorHeader(name, dtype, tuple(shape), nbytes)


class _Reader:
    """Exact-size reads over an async stream of byte chunks."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.buffer = bytearray()
        self.total = 0

    async def read_into(self, target: memoryview) -> None:
        """Fill ``target`` exactly; InvalidInput if the stream ends first."""
        filled = 0
        while filled < len(target):
            if not self.buffer:
                chunk = await anext(self.chunks, None)
                if chunk is None:
                    raise InvalidInput("weights: the stream ended before its end marker")
                self.total += len(chunk)
                if self.total > MAX_TOTAL + MAX_HEADER:
                    raise InvalidInput(f"weights: a push is at most {MAX_TOTAL} bytes")
                self.buffer += chunk
            take = min(len(self.buffer), len(target) - filled)
            target[filled : filled + take] = self.buffer[:take]
            del self.buffer[:take]
            filled += take

    async def read(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        out = bytearray(n)
        await self.read_into(memoryview(out))
        return bytes(out)

    async def at_end(self) -> bool:
        """True when nothing follows."""
        while not self.buffer:
            chunk = await anext(self.chunks, None)
            if chunk is None:
                return True
            self.buffer += chunk
        return False


async def decode(chunks: AsyncIterator[bytes]) -> list[tuple[str, Any]]:
    """Every named tensor of a push body (torch tensors over the received bytes), once the end
    marker arrived and each bucket's checksum matched; InvalidInput otherwise."""
    import torch

    reader = _Reader(chunks)
    if await reader.read(len(MAGIC)) != MAGIC:
        raise InvalidInput("weights: the body does not start with the RFW1 magic")
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    total = 0
    index = 0
    while True:
        (length,) = struct.unpack("<I", await reader.read(4))
        if length == 0:
            break
        if length > MAX_HEADER:
            raise InvalidInput(f"weights: bucket {index} header: {length} bytes, max {MAX_HEADER}")
        headers, crc = parse_header(await reader.read(length))
        size = sum(h.nbytes for h in headers)
        total += size
        if size > MAX_BUCKET or total > MAX_TOTAL:
            raise InvalidInput(f"weights: bucket {index} of {size} bytes is over the limits")
        if len(out) + len(headers) > MAX_TENSORS:
            raise InvalidInput(f"weights: more than {MAX_TENSORS} tensors")
        payload = bytearray(size)
        await reader.read_into(memoryview(payload))
        if zlib.crc32(payload) != crc:
            raise InvalidInput(f"weights: bucket {index} is corrupt (checksum mismatch)")
        offset = 0
        for h in headers:
            if h.name in seen:
                raise InvalidInput(f"weights: tensor {h.name!r} sent twice")
            seen.add(h.name)
            dtype = getattr(torch, h.dtype)
            if h.nbytes == 0:
                out.append((h.name, torch.empty(h.shape, dtype=dtype)))
                continue
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=h.nbytes, offset=offset)
            out.append((h.name, raw.view(dtype).reshape(h.shape)))
            offset += h.nbytes
        index += 1
    if not await reader.at_end():
        raise InvalidInput("weights: bytes after the end marker")
    return out


def weights_url(base_url: str, version: int) -> str:
    """The push URL of a gateway (base URL with or without ``/v1``)."""
    base = base_url.rstrip("/").removesuffix("/v1")
    return f"{base}/v1/rollfleet/weights/{version}"


async def push_weights(
    target: Any,
    tensors: Iterable[tuple[str, Any]],
    version: int,
    *,
    token: str | None = None,
    bucket_bytes: int = PUSH_BUCKET_BYTES,
    progress: bool = False,
) -> dict[str, Any]:
    """Send named tensors as weights ``version`` to a gateway: a :class:`Gateway` in this
    process, or its URL (one streamed request). Returns the gateway's answer: the version and
    each replica's pause. Raises what the gateway refused with (Conflict for a version that is
    not newer, InvalidInput for a bad tensor or bucket)."""
    from rollfleet.engines.gateway import Gateway

    named = list(tensors)
    if isinstance(target, Gateway):
        return await target.update_weights(named, version)
    return await _push_http(str(target), named, version, token, bucket_bytes, progress)


async def _push_http(
    url: str,
    named: list[tuple[str, Any]],
    version: int,
    token: str | None,
    bucket_bytes: int,
    progress: bool,
) -> dict[str, Any]:
    import httpx
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    from rollfleet.engines.buckets import tensor_nbytes
    from rollfleet.web.errors import error_named

    size = sum(tensor_nbytes(t) for _, t in named)
    bar = Progress(*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(),
                   disable=not progress, transient=True)  # fmt: skip
    task = bar.add_task(f"weights v{version}", total=size)

    async def body() -> AsyncIterator[bytes]:
        for part in encode(named, bucket_bytes):
            yield part if isinstance(part, bytes) else part.tobytes()  # httpx sends bytes only
            bar.advance(task, part.nbytes if isinstance(part, memoryview) else 0)

    headers = {"content-type": "application/octet-stream"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    timeout = httpx.Timeout(connect=30.0, read=None, write=None, pool=None)
    with bar:
        async with httpx.AsyncClient(timeout=timeout) as client:
            reply = await client.put(weights_url(url, version), content=body(), headers=headers)
    answer: dict[str, Any] = reply.json()
    if reply.status_code != 200:
        error = answer.get("error") or {}
        raise error_named(error.get("type"), str(error.get("message") or reply.text))
    return answer


__all__ = ["MAGIC", "decode", "encode", "parse_header", "push_weights", "weights_url"]
