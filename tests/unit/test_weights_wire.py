"""The weight push format: round trips, and every refusal names what is wrong."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Iterable

import pytest
import torch  # the test extra installs it (a trainer's tensors are torch tensors)

from rollfleet.engines.weights.wire import MAGIC, decode, encode
from rollfleet.errors import InvalidInput


def tensors() -> list[tuple[str, object]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=gen)),
        ("b.bias", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("c.ids", torch.arange(10, dtype=torch.int64)),
        ("d.empty", torch.zeros(0, 4)),
    ]


async def chunks(parts: Iterable[bytes | memoryview], size: int = 7) -> AsyncIterator[bytes]:
    """The body cut in small pieces, as a network delivers it."""
    body = b"".join(bytes(p) for p in parts)
    for i in range(0, len(body), size):
        yield body[i : i + size]


def body(parts: Iterable[bytes | memoryview]) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in parts))


async def test_a_push_round_trips_every_dtype_in_small_buckets() -> None:
    sent = tensors()
    got = await decode(chunks(encode(sent, bucket_bytes=40)))
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (_, a), (_, b) in zip(sent, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


async def test_numpy_arrays_are_sent_too() -> None:
    import numpy as np

    got = await decode(chunks(encode([("x", np.arange(6, dtype=np.float32).reshape(2, 3))])))
    assert got[0][1].tolist() == [[0, 1, 2], [3, 4, 5]]


async def test_a_flipped_byte_is_a_corrupt_bucket() -> None:
    raw = body(encode(tensors()))
    raw[-12] ^= 0xFF  # inside the last bucket's payload
    with pytest.raises(InvalidInput, match="bucket 0 is corrupt"):
        await decode(chunks([raw]))


async def test_a_stream_cut_short_is_refused() -> None:
    raw = body(encode(tensors()))
    with pytest.raises(InvalidInput, match="ended before its end marker"):
        await decode(chunks([raw[: len(raw) // 2]]))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (["x", "complex64", [2], 16], "dtype 'complex64'"),
        (["x", "float32", [2, 2], 12], "do not hold float32"),
        (["x", "float32", [-1], 4], "not a count"),
        (["", "float32", [1], 4], "1 to 1024 characters"),
        (["x", "float32", [1]], "unreadable bucket header"),
    ],
)
async def test_bad_headers_name_the_tensor(entry: list[object], message: str) -> None:
    head = json.dumps({"tensors": [entry], "xxh3_64": 0}).encode()
    raw = MAGIC + struct.pack("<I", len(head)) + head + bytes(64) + struct.pack("<I", 0)
    with pytest.raises(InvalidInput, match=message):
        await decode(chunks([raw]))


async def test_other_refusals() -> None:
    with pytest.raises(InvalidInput, match="RFW2 magic"):
        await decode(chunks([b"NOPE" + struct.pack("<I", 0)]))
    with pytest.raises(InvalidInput, match="header: 16777216 bytes"):
        await decode(chunks([MAGIC + struct.pack("<I", 1 << 24)]))
    twice = list(encode([("x", torch.zeros(2))]))[:-1] + list(encode([("x", torch.zeros(2))]))[1:]
    with pytest.raises(InvalidInput, match="'x' sent twice"):
        await decode(chunks(twice))
    with pytest.raises(InvalidInput, match="after the end marker"):
        await decode(chunks([body(encode([("x", torch.zeros(2))])) + b"extra"]))


async def test_a_flipped_byte_names_the_bucket_it_is_in() -> None:
    """XXH3-64 over each bucket: one flipped bit in the second bucket is that bucket's fault."""
    parts = [bytes(p) for p in encode(tensors(), bucket_bytes=40)]  # a.weight alone, then b.bias
    second = sum(len(p) for p in parts[:4])  # the first byte of b.bias
    raw = bytearray(b"".join(parts))
    raw[second] ^= 0x01
    with pytest.raises(InvalidInput, match="bucket 1 is corrupt \\(xxh3_64 mismatch\\)"):
        await decode(chunks([raw]))


async def test_a_push_in_the_old_crc32_format_is_refused_naming_it() -> None:
    head = json.dumps({"tensors": [["x", "float32", [1], 4]], "crc32": 0}).encode()
    old = b"RFW1" + struct.pack("<I", len(head)) + head + bytes(4) + struct.pack("<I", 0)
    with pytest.raises(InvalidInput, match="old RFW1 \\(CRC-32 checksums\\) format.*RFW2"):
        await decode(chunks([old]))


async def test_a_header_without_the_digest_or_with_one_too_wide_is_unreadable() -> None:
    for digest in ({}, {"xxh3_64": 2**64}, {"xxh3_64": -1}):
        header = {"tensors": [], **digest}
        head = json.dumps(header).encode()
        with pytest.raises(InvalidInput, match="unreadable bucket header"):
            await decode(chunks([MAGIC + struct.pack("<I", len(head)) + head]))
