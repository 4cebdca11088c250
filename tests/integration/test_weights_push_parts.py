"""A same-host push in parts: memfds written side by side, each a whole sealed push stream, named
together in one header. The gateway serves exactly the tensors sent, checks every part's buckets
(numbered on across the parts), and refuses a push whose parts are too many, name a tensor twice
or hold a bad path, by name, changing nothing."""

from __future__ import annotations

import fcntl
import os
import threading
from typing import Any

import httpx
import pytest

from rollfleet.engines.weights import memfd, push
from rollfleet.engines.weights.memfd import (
    mapped_push_memfds,
    memfd_path,
    write_push_memfd,
    write_push_parts,
)
from rollfleet.engines.weights.push import push_weights, weights_url
from rollfleet.engines.weights.wire import FILE_HEADER, decode, encoded_buckets

AUTH = {"authorization": "Bearer s3cret"}


def state(seed: int) -> list[tuple[str, Any]]:
    from rollfleet.engines.tiny import tiny_hf_model

    return list(tiny_hf_model(seed=seed)[0].state_dict().items())


def close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


async def put(url: str, version: int, paths: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.put(weights_url(url, version), headers={FILE_HEADER: paths, **AUTH})


async def test_parts_are_sealed_streams_that_decode_to_the_tensors_sent_in_order() -> None:
    sent = state(1)
    fds = write_push_parts(sent, 1 << 14, parts=3)
    try:
        assert len(fds) == 3
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        assert all(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & wanted == wanted for fd in fds)
        with mapped_push_memfds(",".join(memfd_path(fd) for fd in fds)) as views:
            got = await decode(views, sealed=True)
            assert [n for n, _ in got] == [n for n, _ in sent]
            assert all(a.equal(b) for (_, a), (_, b) in zip(got, sent, strict=True))
            del got
    finally:
        close(fds)


def test_buckets_go_to_consecutive_runs_of_about_equal_bytes() -> None:
    buckets = list(encoded_buckets(state(1), 1 << 14))
    sizes = [b.nbytes for b in buckets]
    for parts in (1, 2, 3, len(buckets), len(buckets) + 5):
        runs = memfd._runs(buckets, parts)
        assert [b for run in runs for b in run] == buckets and all(runs)
        assert len(runs) == min(parts, len(buckets))
        if parts <= 3:
            loads = [sum(b.nbytes for b in run) for run in runs]
            assert max(loads) <= sum(sizes) / parts + max(sizes)  # off by one bucket at most


async def test_a_push_in_parts_over_http_serves_exactly_its_tensors(
    hf_served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """push_weights splits a push one part a core (parts of at least MIN_PART bytes: made
    small here), keeps a spare a part, and the engine serves exactly what was sent."""
    url, _, engine = hf_served
    monkeypatch.setattr(memfd, "MIN_PART", 1)
    buckets = len(list(encoded_buckets(state(1), 1 << 14)))
    parts = min(len(os.sched_getaffinity(0)), memfd.MAX_PARTS, buckets)
    for version in (1, 2):
        sent = state(version)
        await push_weights(
            url, sent, version=version, token="s3cret", transport="file", bucket_bytes=1 << 14
        )
        live = engine.hf_model.state_dict()
        assert engine.version == version
        assert all(live[name].equal(tensor) for name, tensor in sent)
        for thread in threading.enumerate():
            if thread.name == "rollfleet-push-spare":
                thread.join()
        assert len(push._SPARES.fds) == parts


async def test_a_corrupt_bucket_in_a_later_part_is_named_by_its_index_in_the_push(
    hf_served,
) -> None:
    url, _, engine = hf_served
    sent = state(1)
    fds = write_push_parts(sent, 1 << 14, parts=2)
    first = len(memfd._runs(list(encoded_buckets(sent, 1 << 14)), 2)[0])
    raw = bytearray(os.pread(fds[1], os.fstat(fds[1]).st_size, 0))
    close(fds[1:])
    raw[-100] ^= 0x01  # inside the second part's last bucket
    flipped = os.memfd_create("test-flipped", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(flipped, raw)
    fcntl.fcntl(flipped, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    total = len(list(encoded_buckets(sent, 1 << 14)))
    try:
        reply = await put(url, 1, f"{memfd_path(fds[0])},{memfd_path(flipped)}")
    finally:
        close([fds[0], flipped])
    assert reply.status_code == 422 and first > 0
    message = reply.json()["error"]["message"]
    assert f"bucket {total - 1} is corrupt" in message
    assert engine.version == 0


async def test_too_many_parts_a_tensor_twice_or_one_bad_path_is_422_and_changes_nothing(
    hf_served,
) -> None:
    url, _, engine = hf_served
    fd = write_push_memfd(state(1), 1 << 14)
    path = memfd_path(fd)
    try:
        reply = await put(url, 1, ",".join([path] * 65))
        assert reply.status_code == 422
        assert "the push names 65 memfds, at most 64" in reply.json()["error"]["message"]
        reply = await put(url, 1, f"{path},{path}")
        assert reply.status_code == 422 and "sent twice" in reply.json()["error"]["message"]
        reply = await put(url, 1, f"{path},/etc/passwd")
        assert reply.status_code == 422
        assert "'/etc/passwd' is not a push memfd" in reply.json()["error"]["message"]
        assert engine.version == 0
        reply = await put(url, 1, path)
        assert reply.status_code == 200 and engine.version == 1
    finally:
        os.close(fd)
