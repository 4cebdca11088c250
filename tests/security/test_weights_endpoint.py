"""The weights endpoint against a caller who holds the token but not good intentions: a FIFO named
like a push file, a header claiming 4 GiB, a version pushed to the end of the range, two pushes at
once. Each is refused, naming what is wrong, and the gateway goes on serving and taking pushes."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from support import eventually

from rollfleet.engines.weights import (
    FILE_HEADER,
    JUMP_HEADER,
    MAGIC,
    encode,
    push_dir,
    push_weights,
    weights_url,
)
from rollfleet.errors import InvalidInput

AUTH = {"authorization": "Bearer s3cret"}


def state(seed: int) -> list[tuple[str, Any]]:
    from rollfleet.engines.hf import tiny_hf_model

    return list(tiny_hf_model(seed=seed)[0].state_dict().items())


def claiming_4_gib() -> bytes:
    """93 bytes or so: the magic, one bucket header promising a 4 GiB tensor, and nothing else."""
    header = json.dumps({"tensors": [["w", "uint8", [4 << 30], 4 << 30]], "xxh3_64": 1}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header


async def test_a_fifo_named_like_a_push_file_is_refused_without_blocking(hf_served) -> None:
    url, _, engine = hf_served
    fifo = os.path.join(push_dir(), "rollfleet-weights-" + "f" * 32 + ".rfw")
    os.mkfifo(fifo, 0o600)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            reply = await client.put(weights_url(url, 1), headers={FILE_HEADER: fifo, **AUTH})
            assert reply.status_code == 422, reply.text
            assert "is not a regular file" in reply.json()["error"]["message"]
            alive = await client.get(url + "/v1/models", headers=AUTH)
        assert alive.status_code == 200 and engine.version == 0
    finally:
        os.unlink(fifo)


async def test_a_header_claiming_4_gib_allocates_only_what_arrived(hf_served) -> None:
    url, _, engine = hf_served
    body = claiming_4_gib()
    assert len(body) < 128
    tracemalloc.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            reply = await client.put(
                weights_url(url, 1),
                content=body,
                headers={"content-type": "application/octet-stream", **AUTH},
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply.status_code == 422 and "ended before its end marker" in reply.text
    assert peak < 64 << 20, f"{peak} bytes allocated for a 4 GiB claim"
    assert engine.version == 0


async def test_a_version_far_ahead_is_refused_unless_asked_for_and_blocks_nothing(
    hf_served,
) -> None:
    url, gateway, engine = hf_served
    with pytest.raises(InvalidInput, match=r"more than 1000 past 0; send x-rollfleet-weights-jump"):
        await push_weights(url, state(1), version=2**63 - 1, token="s3cret")
    assert (await push_weights(url, state(1), version=1, token="s3cret"))["version"] == 1
    answer = await push_weights(url, state(2), version=5000, token="s3cret", jump=True)
    assert answer["version"] == 5000 == gateway.weights_version == engine.version
    assert JUMP_HEADER == "x-rollfleet-weights-jump"


async def test_a_second_push_while_one_is_being_received_is_409_and_the_first_lands(
    hf_served,
) -> None:
    url, gateway, _ = hf_served
    parts = [p if isinstance(p, bytes) else p.tobytes() for p in encode(state(1), 1 << 16)]
    release = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield parts[0]
        await release.wait()  # the first push holds the gateway's receiving lock meanwhile
        for part in parts[1:]:
            yield part

    headers = {"content-type": "application/octet-stream", **AUTH}
    async with httpx.AsyncClient(timeout=30) as client:
        first = asyncio.create_task(
            client.put(weights_url(url, 1), content=slow(), headers=headers)
        )

        async def receiving() -> bool:
            return gateway.receiving.locked()

        await eventually(receiving, what="the first push to be received")
        second = await client.put(weights_url(url, 2), content=b"".join(parts), headers=headers)
        release.set()
        landed = await first
    assert second.status_code == 409 and "being received" in second.text
    assert landed.status_code == 200 and gateway.weights_version == 1
