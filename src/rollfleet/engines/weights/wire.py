"""The weights push format: a framed, checksummed stream of buckets.

One push is one HTTP request (``PUT /v1/rollfleet/weights/{version}``, body
``application/octet-stream``) whose body is::

    b"RFW2"
    (u32 header length, header JSON, payload)   one per bucket
    u32 0                                        the end

A header is ``{"tensors": [[name, dtype, shape, nbytes], ...], "xxh3_64": int}``: the payload's
XXH3-64 (a checksum at memory speed, ~20 GB/s, where zlib's CRC-32 ran at 1-4 GB/s), then trailing
spaces, if any; its payload is the tensors' bytes back to back. The older ``RFW1`` format (a
CRC-32) is refused, naming it. Buckets come from
:func:`rollfleet.engines.weights.buckets.bucket_tensors`, so neither side holds more than one
bucket beyond the tensors themselves. Nothing is applied until the end marker arrives and every
checksum matched: a trainer killed mid-push, a corrupt bucket or a refused tensor leaves every
engine on its old weights, and the next push starts afresh (there is no upload state to clean
up). On the same host the same bytes go to a sealed memfd and only its ``/proc/<pid>/fd/<fd>``
path travels (:mod:`rollfleet.engines.weights.memfd`).

Every size a caller sets is capped (header, bucket, tensor count, total bytes), dtypes are an
allow-list, and each tensor's byte count must equal its shape times its element size.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from rollfleet.engines.weights.buckets import bucket_tensors
from rollfleet.errors import InvalidInput

MAGIC = b"RFW2"
OLD_MAGICS = {b"RFW1": "RFW1 (CRC-32 checksums)"}
CHECKSUM = "xxh3_64"  # the header field: the payload's XXH3-64
SEALED = "rollfleet_sealed"  # the attribute that marks a tensor over a sealed push memfd
MAX_HEADER = 1 << 20  # bytes of one bucket's header
MAX_BUCKET = 4 << 30  # bytes of one bucket's payload
MAX_TENSORS = 1_000_000
MAX_TOTAL = 256 << 30  # bytes of one push
PUSH_BUCKET_BYTES = 64 << 20  # small enough to checksum while the next one is on the wire
FILE_HEADER = "x-rollfleet-weights-file"
DELTA_HEADER = "x-rollfleet-weights-delta"
JUMP_HEADER = "x-rollfleet-weights-jump"  # "1": the version may advance by more than MAX_STEP
MAX_STEP = 1000  # how far one push may move the version without JUMP_HEADER
BASE_HEADER = "x-rollfleet-weights-base"
LORA_HEADER = "x-rollfleet-weights-lora-alpha"  # the push is a LoRA adapter with this alpha
DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """One tensor inside a bucket's payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def delta_base(headers: Mapping[str, str]) -> int | None:
    """The base version a push's headers name for a delta, None for a full push; InvalidInput
    for a delta without a base, or a base without a delta."""
    delta = headers.get(DELTA_HEADER, "0").strip().lower()
    raw = headers.get(BASE_HEADER)
    if delta not in ("0", "1", "false", "true"):
        raise InvalidInput(f"weights: {DELTA_HEADER} must be 1 or 0, not {delta[:20]!r}")
    if delta in ("0", "false"):
        if raw is not None:
            raise InvalidInput(f"weights: {BASE_HEADER} only goes with {DELTA_HEADER}: 1")
        return None
    if raw is None or not raw.strip().isdigit() or int(raw) >= 2**63:
        raise InvalidInput(
            f"weights: a delta needs {BASE_HEADER}: the version it was computed against"
        )
    return int(raw)


def lora_alpha(headers: Mapping[str, str]) -> float | None:
    """The alpha of a push its headers say is a LoRA adapter (None: weights); InvalidInput for
    a value that is not a positive number."""
    raw = headers.get(LORA_HEADER)
    if raw is None:
        return None
    try:
        alpha = float(raw)
    except ValueError:
        alpha = float("nan")
    if not 0 < alpha < float("inf"):
        raise InvalidInput(f"weights: {LORA_HEADER} must be a positive number, not {raw[:20]!r}")
    return alpha


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def raw_view(tensor: Any) -> memoryview:
    """The bytes of a torch tensor or numpy array, without a copy when it is contiguous."""
    if hasattr(tensor, "detach"):  # torch: bfloat16 has no numpy dtype, so go through uint8
        import torch

        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        view: memoryview = flat.numpy().data
        return view
    import numpy as np

    return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data


@dataclass(frozen=True, slots=True)
class EncodedBucket:
    """One bucket to send: its header's tensor entries and the tensors' bytes."""

    entries: list[list[Any]]
    views: list[memoryview]

    @property
    def nbytes(self) -> int:
        """The payload's size."""
        return sum(view.nbytes for view in self.views)

    def header(self, digest: int) -> bytes:
        """The header JSON, with the payload's digest."""
        return json.dumps({"tensors": self.entries, CHECKSUM: digest}).encode()


def encoded_buckets(
    tensors: Iterable[tuple[str, Any]], bucket_bytes: int
) -> Iterator[EncodedBucket]:
    """Named tensors in buckets of about ``bucket_bytes``, as header entries and byte views."""
    for bucket in bucket_tensors(tensors, bucket_bytes):
        views = [(name, tensor, raw_view(tensor)) for name, tensor in bucket.items]
        entries = [[name, dtype_name(t), list(t.shape), view.nbytes] for name, t, view in views]
        yield EncodedBucket(entries, [view for _, _, view in views])


def encode(
    tensors: Iterable[tuple[str, Any]], bucket_bytes: int = PUSH_BUCKET_BYTES
) -> Iterator[bytes | memoryview]:
    """The body of a push: the magic, each bucket's header and payload, the end marker."""
    yield MAGIC
    for bucket in encoded_buckets(tensors, bucket_bytes):
        digest = xxhash.xxh3_64()
        for view in bucket.views:
            digest.update(view)
        head = bucket.header(digest.intdigest())
        yield struct.pack("<I", len(head)) + head
        yield from bucket.views
    yield struct.pack("<I", 0)


def parse_header(raw: bytes) -> tuple[list[TensorHeader], int]:
    """A bucket header's tensors and checksum; InvalidInput naming what is wrong."""
    try:
        header = json.loads(raw)
        digest = header[CHECKSUM]
        entries = header["tensors"]
        if not isinstance(digest, int) or not 0 <= digest < 2**64 or not isinstance(entries, list):
            raise TypeError(f"{CHECKSUM} must be a 64-bit unsigned integer and tensors a list")
        found = [_tensor_header(entry) for entry in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"weights: unreadable bucket header: {exc}") from exc
    return found, digest


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
    """Exact-size reads over an async stream of byte chunks (an HTTP body)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.buffer = bytearray()
        self.total = 0

    async def take(self, n: int) -> bytearray | memoryview:
        """The next ``n`` bytes, in a buffer of their own that grows as they arrive (a header
        claiming 4 GiB costs nothing until 4 GiB came); InvalidInput if the stream ends first."""
        out = bytearray()
        while len(out) < n:
            if not self.buffer:
                chunk = await anext(self.chunks, None)
                if chunk is None:
                    raise InvalidInput("weights: the stream ended before its end marker")
                self.total += len(chunk)
                if self.total > MAX_TOTAL + MAX_HEADER:
                    raise InvalidInput(f"weights: a push is at most {MAX_TOTAL} bytes")
                self.buffer += chunk
            step = min(len(self.buffer), n - len(out))
            out += memoryview(self.buffer)[:step]
            del self.buffer[:step]
        return out

    async def at_end(self) -> bool:
        """True when nothing follows."""
        while not self.buffer:
            chunk = await anext(self.chunks, None)
            if chunk is None:
                return True
            self.buffer += chunk
        return False


class _BufferReader:
    """The same reads over a buffer already in memory (a push memfd, mapped): no copies."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.at = view, 0

    async def take(self, n: int) -> bytearray | memoryview:
        """A view of the next ``n`` bytes."""
        if self.at + n > len(self.view):
            raise InvalidInput("weights: the push memfd ends before its end marker")
        self.at += n
        return self.view[self.at - n : self.at]

    async def at_end(self) -> bool:
        """True when nothing follows."""
        return self.at == len(self.view)


@dataclass(frozen=True, slots=True)
class _Received:
    """One bucket read off a push: its tensors, its checksum and its payload."""

    index: int
    headers: list[TensorHeader]
    digest: int
    payload: bytearray | memoryview


async def decode(
    chunks: AsyncIterator[bytes] | memoryview | list[memoryview], *, sealed: bool = False
) -> list[tuple[str, Any]]:
    """Every named tensor of a push (an HTTP body's chunks, or a mapped push memfd, or the
    mapped memfds of a push in parts: each a whole push stream, their buckets numbered on
    across them), as torch tensors over the received bytes, once every end marker arrived and
    each bucket's checksum matched; InvalidInput otherwise. The limits hold for the whole push.
    Mapped buckets are checked in threads, one a core. ``sealed``: the memoryviews map sealed
    push memfds (:func:`~rollfleet.engines.weights.memfd.mapped_push_memfd`), so nobody can
    change their bytes: the tensors are marked (:func:`is_sealed`) for an engine to serve from
    as they are, without a copy."""
    if isinstance(chunks, memoryview):
        chunks = [chunks]
    mapped = isinstance(chunks, list)
    readers: list[_Reader | _BufferReader] = (
        [_BufferReader(v) for v in chunks] if isinstance(chunks, list) else [_Reader(chunks)]
    )
    received: list[_Received] = []
    total = count = 0
    for reader in readers:
        await _check_magic(reader)
        while True:
            (length,) = struct.unpack("<I", await reader.take(4))
            if length == 0:
                break
            index = len(received)
            if length > MAX_HEADER:
                raise InvalidInput(
                    f"weights: bucket {index} header: {length} bytes, max {MAX_HEADER}"
                )
            headers, digest = parse_header(bytes(await reader.take(length)))
            size = sum(h.nbytes for h in headers)
            total, count = total + size, count + len(headers)
            if size > MAX_BUCKET or total > MAX_TOTAL:
                raise InvalidInput(f"weights: bucket {index} of {size} bytes is over the limits")
            if count > MAX_TENSORS:
                raise InvalidInput(f"weights: more than {MAX_TENSORS} tensors")
            bucket = _Received(index, headers, digest, await reader.take(size))
            if not mapped:  # checked as it arrives, while the next one is on the wire
                _verify([bucket])
            received.append(bucket)
        if not await reader.at_end():
            raise InvalidInput("weights: bytes after the end marker")
    if mapped:
        await _verify_in_threads(received)
    return _tensors(received, sealed and mapped)


async def _check_magic(reader: _Reader | _BufferReader) -> None:
    magic = bytes(await reader.take(len(MAGIC)))
    if magic in OLD_MAGICS:
        raise InvalidInput(
            f"weights: the push is in the old {OLD_MAGICS[magic]} format; this gateway reads"
            f" {MAGIC.decode()} ({CHECKSUM} checksums): update rollfleet on the trainer"
        )
    if magic != MAGIC:
        raise InvalidInput(f"weights: the body does not start with the {MAGIC.decode()} magic")


def _verify(buckets: list[_Received]) -> None:
    """InvalidInput naming the first bucket whose payload does not match its checksum."""
    _refuse_corrupt(_corrupt(buckets))


def _refuse_corrupt(corrupt: list[int]) -> None:
    if corrupt:
        raise InvalidInput(f"weights: bucket {min(corrupt)} is corrupt ({CHECKSUM} mismatch)")


def _corrupt(buckets: list[_Received]) -> list[int]:
    """The indexes of the buckets whose payload does not match its checksum."""
    return [b.index for b in buckets if xxhash.xxh3_64_intdigest(b.payload) != b.digest]


async def _verify_in_threads(buckets: list[_Received]) -> None:
    """:func:`_verify` in one thread a core (XXH3 lets go of the GIL), the buckets shared out
    by size, off the event loop."""
    import asyncio

    cores = max(1, min(len(buckets), len(os.sched_getaffinity(0))))
    shares: list[list[_Received]] = [[] for _ in range(cores)]
    loads = [0] * cores
    for bucket in sorted(buckets, key=lambda b: -len(b.payload)):
        least = loads.index(min(loads))
        shares[least].append(bucket)
        loads[least] += len(bucket.payload)
    found = await asyncio.gather(*(asyncio.to_thread(_corrupt, share) for share in shares))
    _refuse_corrupt([index for share in found for index in share])


def _tensors(received: list[_Received], sealed: bool) -> list[tuple[str, Any]]:
    """The checked buckets' tensors, as views over their payloads (marked when ``sealed``)."""
    import torch

    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for bucket in received:
        offset = 0
        for h in bucket.headers:
            if h.name in seen:
                raise InvalidInput(f"weights: tensor {h.name!r} sent twice")
            seen.add(h.name)
            dtype = getattr(torch, h.dtype)
            if h.nbytes == 0:
                out.append((h.name, torch.empty(h.shape, dtype=dtype)))
                continue
            with warnings.catch_warnings():  # a read-only buffer: it is only read
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(
                    bucket.payload, dtype=torch.uint8, count=h.nbytes, offset=offset
                )
            tensor = raw.view(dtype).reshape(h.shape)
            if sealed:
                setattr(tensor, SEALED, True)
            out.append((h.name, tensor))
            offset += h.nbytes
    return out


def is_sealed(tensor: Any) -> bool:
    """True for a tensor :func:`decode` made over a sealed push memfd: nobody can change its
    bytes, so an engine may serve it as it is instead of copying it."""
    return bool(getattr(tensor, SEALED, False))
