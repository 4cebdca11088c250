"""The weights endpoint against a caller who holds the token but not good intentions: a pipe named
as a push memfd, a memfd left unsealed, or truncated while the gateway reads it, a header claiming
4 GiB, a version pushed to the end of the range, two pushes at once. Each is refused, naming what
is wrong, and the gateway goes on serving and taking pushes."""

from __future__ import annotations

import asyncio
import fcntl
import json
import mmap
import os
import struct
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from support import eventually, greedy, require

from rollfleet.engines.hf.engine import HFEngine
from rollfleet.engines.tiny import tiny_hf_model
from rollfleet.engines.weights.memfd import memfd_path, write_push_memfd
from rollfleet.engines.weights.push import push_weights, weights_url
from rollfleet.engines.weights.wire import FILE_HEADER, JUMP_HEADER, MAGIC, encode
from rollfleet.errors import EngineError, InvalidInput

AUTH = {"authorization": "Bearer s3cret"}


def state(seed: int) -> list[tuple[str, Any]]:
    return list(tiny_hf_model(seed=seed)[0].state_dict().items())


def claiming_4_gib() -> bytes:
    """93 bytes or so: the magic, one bucket header promising a 4 GiB tensor, and nothing else."""
    header = json.dumps({"tensors": [["w", "uint8", [4 << 30], 4 << 30]], "xxh3_64": 1}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header


def serves(engine: Any, tensors: list[tuple[str, Any]]) -> bool:
    """True when the engine's live model holds exactly these tensors."""
    live = engine.hf_model.state_dict()
    return all(live[name].dtype == t.dtype and live[name].equal(t) for name, t in tensors)


def memfd_holding(data: bytes, seals: int) -> int:
    """A memfd of this process holding ``data``, with only ``seals`` added."""
    fd = os.memfd_create("test-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.pwrite(fd, data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def changes(fd: int) -> list[Callable[[], object]]:
    """Every way this process could shrink, grow or rewrite the memfd under a reader."""
    path, size = memfd_path(fd), os.fstat(fd).st_size
    return [
        lambda: os.ftruncate(fd, 0),
        lambda: os.ftruncate(fd, size // 2),
        lambda: os.ftruncate(fd, size + 4096),
        lambda: os.pwrite(fd, b"\0" * 64, 0),
        lambda: os.open(path, os.O_RDWR | os.O_TRUNC),
        lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE),
        lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK),  # sealed for good
    ]


class HeldEngine(HFEngine):
    """The HF engine, but its weights update waits, its tensors views of the gateway's mapping
    of the memfd, until the test lets it go on (``release``: True) or refuses it (False)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holding = asyncio.Event()
        self.release: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def update_weights(self, weights: Any, version: int | None = None) -> int:
        self.holding.set()
        if not await self.release:
            raise EngineError("the test refused this update")
        return await super().update_weights(weights, version)


@pytest.fixture
async def held_served() -> AsyncIterator[tuple[str, Any, HeldEngine]]:
    """hf_served, with a :class:`HeldEngine`: url, gateway, engine."""
    import importlib.util

    require(
        bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch")),
        "transformers and torch (rollfleet[hf])",
    )
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway

    engine = HeldEngine(*tiny_hf_model(seed=0), max_batch=8)
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine, "hf-0")
    try:
        async with running_gateway(gateway, token="s3cret") as url:
            try:
                yield url, gateway, engine
            finally:  # the server waits for the held request before it stops
                if not engine.release.done():
                    engine.release.set_result(False)
    finally:
        await gateway.close()


async def test_a_pipe_named_as_a_push_memfd_is_refused_without_blocking(hf_served) -> None:
    url, _, engine = hf_served
    read, write = os.pipe()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            reply = await client.put(
                weights_url(url, 1), headers={FILE_HEADER: memfd_path(read), **AUTH}
            )
            assert reply.status_code == 422, reply.text
            assert "is not a regular file" in reply.json()["error"]["message"]
            alive = await client.get(url + "/v1/models", headers=AUTH)
        assert alive.status_code == 200 and engine.version == 0
    finally:
        os.close(read)
        os.close(write)


async def test_an_unsealed_memfd_is_refused_naming_the_missing_seal_and_changes_nothing(
    hf_served,
) -> None:
    """Unsealed, a memfd could be truncated under the gateway's mapping (SIGBUS) or rewritten
    after its checksums were checked: each missing seal is named, and the version stays."""
    url, gateway, engine = hf_served
    await push_weights(url, state(1), version=1, token="s3cret")
    before = await greedy(engine)
    push = b"".join(bytes(p) for p in encode(state(2)))
    cases = [
        (0, "is not sealed against shrinking or writing"),
        (fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW, "is not sealed against shrinking ("),
        (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, "is not sealed against writing ("),
    ]
    async with httpx.AsyncClient(timeout=10) as client:
        for seals, why in cases:
            fd = memfd_holding(push, seals)
            try:
                reply = await client.put(
                    weights_url(url, 2), headers={FILE_HEADER: memfd_path(fd), **AUTH}
                )
            finally:
                os.close(fd)
            assert reply.status_code == 422 and why in reply.json()["error"]["message"], seals
    assert gateway.weights_version == engine.version == 1
    assert serves(engine, state(1)) and await greedy(engine) == before


async def test_a_sealed_push_memfd_cannot_be_changed_and_its_push_applies(hf_served) -> None:
    url, _, engine = hf_served
    sent = state(1)
    fd = write_push_memfd(sent, 1 << 16)
    try:
        for change in changes(fd):
            with pytest.raises(PermissionError):
                change()
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.put(
                weights_url(url, 1), headers={FILE_HEADER: memfd_path(fd), **AUTH}
            )
    finally:
        os.close(fd)
    assert reply.status_code == 200, reply.text
    assert engine.version == 1 and serves(engine, sent)


async def test_a_client_truncating_its_memfd_while_the_gateway_reads_it_cannot(
    held_served,
) -> None:
    """The update is held while the engine's tensors are views of the gateway's mapping: the
    client's every attempt to shrink or rewrite the memfd then fails (unsealed, the engine's
    copy would have died of SIGBUS), and the engine ends up with exactly the bytes sent."""
    url, gateway, engine = held_served
    sent = state(1)
    fd = write_push_memfd(sent, 1 << 16)
    holding = asyncio.create_task(engine.holding.wait())
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            push = asyncio.create_task(
                client.put(weights_url(url, 1), headers={FILE_HEADER: memfd_path(fd), **AUTH})
            )
            try:
                await asyncio.wait([push, holding], return_when=asyncio.FIRST_COMPLETED)
                assert holding.done() and not push.done(), push.result().text
                for change in changes(fd):
                    with pytest.raises(PermissionError):
                        change()
                engine.release.set_result(True)
            finally:  # a check failed: the update is refused rather than read from a changed memfd
                if not engine.release.done():
                    engine.release.set_result(False)
                reply = await push
            alive = await client.get(url + "/v1/models", headers=AUTH)
    finally:
        holding.cancel()
        os.close(fd)
    assert reply.status_code == 200, reply.text
    assert alive.status_code == 200 and gateway.weights_version == engine.version == 1
    assert serves(engine, sent)


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
