"""A trainer pushes weights to a running gateway over HTTP (and in process): versioned, applied
whole or not at all, refused with a reason, and survived when the trainer dies mid-push."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import greedy

from rollfleet.engines.base import GenerationRequest, SamplingParams
from rollfleet.engines.weights.push import push_weights, weights_url
from rollfleet.engines.weights.wire import encode
from rollfleet.errors import Conflict, InvalidInput


def state(seed: int) -> list[tuple[str, Any]]:
    from rollfleet.engines.tiny import tiny_hf_model

    return list(tiny_hf_model(seed=seed)[0].state_dict().items())


@pytest.mark.parametrize("transport", ["http", "file"])
async def test_a_push_during_generation_fails_none_and_matches_a_fresh_engine(
    hf_served, transport
) -> None:
    """Over the wire (the body streams) and on this host (a sealed memfd, its path is sent)."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    url, gateway, engine = hf_served
    before = await greedy(engine)
    running = [
        asyncio.create_task(
            gateway.generate(
                GenerationRequest(
                    prompt=f"p{i}", params=SamplingParams(max_tokens=40, ignore_eos=True)
                )
            )
        )
        for i in range(8)
    ]
    answer = await push_weights(url, state(1), version=1, token="s3cret", transport=transport)
    done = await asyncio.gather(*running)
    assert all(len(g.completion_token_ids) == 40 for g in done)  # none failed or was cut
    assert answer["version"] == 1 and answer["replicas"][0]["weights_version"] == 1
    assert answer["receive_s"] > 0 and ("write_s" in answer) == (transport == "file")
    assert gateway.weights_version == engine.version == 1
    async with httpx.AsyncClient() as client:
        listed = (
            await client.get(url + "/v1/models", headers={"authorization": "Bearer s3cret"})
        ).json()
    assert [m["weights_version"] for m in listed["data"]] == [1]
    fresh = HFEngine(*tiny_hf_model(seed=1))
    await fresh.start()
    try:
        after = await greedy(engine)
        assert after == await greedy(fresh) and after != before
    finally:
        await fresh.stop()


async def test_stale_and_duplicate_versions_are_409_and_change_nothing(hf_served) -> None:
    url, gateway, engine = hf_served
    await push_weights(url, state(1), version=5, token="s3cret")
    before = await greedy(engine)
    for version in (5, 3):
        with pytest.raises(Conflict, match=f"version {version} is not newer than 5"):
            await push_weights(url, state(2), version=version, token="s3cret")
    assert engine.version == 5 and await greedy(engine) == before


async def test_bad_tensors_and_corrupt_buckets_are_422_naming_them(hf_served) -> None:
    url, gateway, engine = hf_served
    before = await greedy(engine)
    good = state(1)
    with pytest.raises(InvalidInput, match="unknown tensor 'nope'"):
        await push_weights(url, [*good, ("nope", good[0][1].clone())], version=1, token="s3cret")
    misshaped = [(n, t[:1] if n == "model.norm.weight" else t) for n, t in good]
    with pytest.raises(InvalidInput, match="'model.norm.weight' has shape"):
        await push_weights(url, misshaped, version=1, token="s3cret", transport="http")
    raw = bytearray(b"".join(bytes(p) for p in encode(good)))
    raw[-100] ^= 0x01
    async with httpx.AsyncClient() as client:
        reply = await client.put(
            weights_url(url, 1),
            content=bytes(raw),
            headers={"content-type": "application/octet-stream", "authorization": "Bearer s3cret"},
        )
    assert reply.status_code == 422 and "corrupt" in reply.json()["error"]["message"]
    assert engine.version == 0 and await greedy(engine) == before  # nothing was half-applied


async def test_a_push_needs_the_token_and_the_octet_stream_type(hf_served) -> None:
    url, _, engine = hf_served
    with pytest.raises(Exception, match="(?i)token|unauthori"):
        await push_weights(url, state(1), version=1)
    async with httpx.AsyncClient() as client:
        reply = await client.put(
            weights_url(url, 1),
            content=b"{}",
            headers={"content-type": "application/json", "authorization": "Bearer s3cret"},
        )
    assert reply.status_code == 415
    assert engine.version == 0


async def test_a_trainer_killed_mid_push_leaves_the_old_weights_and_the_next_push_works(
    hf_served, tmp_path
) -> None:
    url, gateway, engine = hf_served
    before = await greedy(engine)
    trainer = textwrap.dedent(f"""
        import sys, threading, httpx
        from rollfleet.engines.tiny import tiny_hf_model
        from rollfleet.engines.weights.push import weights_url
        from rollfleet.engines.weights.wire import encode
        parts = list(encode(tiny_hf_model(seed=1)[0].state_dict().items(), bucket_bytes=1 << 16))
        def body():
            for i, part in enumerate(parts):
                yield bytes(part)
                if i == len(parts) // 2:
                    print("half", flush=True)
                    threading.Event().wait()  # the test kills us here
        httpx.put(weights_url({url!r}, 1), content=body(), timeout=None, headers={{
            "content-type": "application/octet-stream", "authorization": "Bearer s3cret"}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == "half"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert engine.version == 0 and await greedy(engine) == before
    await push_weights(url, state(1), version=1, token="s3cret")
    assert engine.version == 1 and await greedy(engine) != before


async def test_in_process_push_goes_straight_to_the_gateway(hf_served) -> None:
    _, gateway, engine = hf_served
    answer = await push_weights(gateway, state(3), version=2)
    assert answer["version"] == 2 and engine.version == 2


def sealed(data: bytes) -> int:
    """A memfd holding ``data``, sealed as push_weights seals its own."""
    fd = os.memfd_create("test-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.pwrite(fd, data, 0)
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


async def test_a_path_that_is_not_a_sealed_memfd_of_the_servers_user_is_refused_by_name(
    hf_served,
) -> None:
    """The path a client names is untrusted: only ``/proc/<pid>/fd/<fd>`` naming a regular file
    of the server's user sealed against shrinking and writing is read. A file in the push
    directory (what a push used to be) is refused by name like any other path, and nothing
    changes."""
    from rollfleet.engines.weights.memfd import memfd_path, push_dir, write_push_memfd
    from rollfleet.engines.weights.wire import FILE_HEADER

    url, _, engine = hf_served
    fd = write_push_memfd(state(1), 1 << 20)
    shm = os.path.join(push_dir(), "rollfleet-weights-" + "0" * 32 + ".rfw")
    Path(shm).write_bytes(os.pread(fd, os.fstat(fd).st_size, 0))
    plain = os.open(shm, os.O_RDONLY | os.O_CLOEXEC)  # the same bytes, in a file unsealed
    try:
        async with httpx.AsyncClient() as client:
            for path, why in [
                (shm, f"{shm!r} is not a push memfd"),
                ("/etc/passwd", "is not a push memfd"),
                (f"/proc/self/fd/{fd}", "is not a push memfd"),
                (f"/proc/{os.getpid()}/fd/../fd/{fd}", "is not a push memfd"),
                (f"/proc/{os.getpid()}/fd/999999999", "cannot open"),
                (memfd_path(plain), "is not sealed against shrinking or writing"),
            ]:
                reply = await client.put(
                    weights_url(url, 1),
                    headers={FILE_HEADER: path, "authorization": "Bearer s3cret"},
                )
                assert reply.status_code == 422 and why in reply.json()["error"]["message"], path
            assert engine.version == 0
            reply = await client.put(
                weights_url(url, 1),
                headers={FILE_HEADER: memfd_path(fd), "authorization": "Bearer s3cret"},
            )
            assert reply.status_code == 200 and engine.version == 1
    finally:
        os.close(plain)
        os.unlink(shm)
        os.close(fd)


async def test_a_push_memfd_round_trips_and_a_flipped_byte_in_it_is_422_naming_the_bucket(
    hf_served,
) -> None:
    """The memfd is written a chunk at a time with each header after its payload: it decodes to
    the tensors sent, and a byte changed in it is caught, before anything is applied."""
    from rollfleet.engines.weights.memfd import mapped_push_memfd, memfd_path, write_push_memfd
    from rollfleet.engines.weights.wire import FILE_HEADER, decode

    url, _, engine = hf_served
    before = await greedy(engine)
    sent = state(1)
    fd = write_push_memfd(sent, 1 << 16)
    try:
        with mapped_push_memfd(memfd_path(fd)) as view:
            got = await decode(view)
            assert [n for n, _ in got] == [n for n, _ in sent]
            pairs = zip(got, sent, strict=True)
            assert all(a.dtype == b.dtype and a.equal(b) for (_, a), (_, b) in pairs)
            del got, pairs
        raw = bytearray(os.pread(fd, os.fstat(fd).st_size, 0))
    finally:
        os.close(fd)
    raw[-100] ^= 0x01  # inside the last bucket's payload
    last = sum(isinstance(p, bytes) for p in encode(sent, 1 << 16)) - 3  # magic, end marker
    flipped = sealed(bytes(raw))
    try:
        async with httpx.AsyncClient() as client:
            reply = await client.put(
                weights_url(url, 1),
                headers={FILE_HEADER: memfd_path(flipped), "authorization": "Bearer s3cret"},
            )
    finally:
        os.close(flipped)
    assert reply.status_code == 422 and last > 0
    assert f"bucket {last} is corrupt (xxh3_64 mismatch)" in reply.json()["error"]["message"]
    assert engine.version == 0 and await greedy(engine) == before


async def test_an_old_format_push_is_422_naming_the_format(hf_served) -> None:
    import json
    import struct

    url, _, engine = hf_served
    head = json.dumps({"tensors": [["model.norm.weight", "float32", [1], 4]], "crc32": 0}).encode()
    old = b"RFW1" + struct.pack("<I", len(head)) + head + bytes(4) + struct.pack("<I", 0)
    async with httpx.AsyncClient() as client:
        reply = await client.put(
            weights_url(url, 1),
            content=old,
            headers={"content-type": "application/octet-stream", "authorization": "Bearer s3cret"},
        )
    assert reply.status_code == 422 and "old RFW1" in reply.json()["error"]["message"]
    assert engine.version == 0


async def test_a_spare_memfd_of_any_size_and_bytes_is_cut_to_the_push_and_sealed() -> None:
    """A spare (made between pushes, its pages allocated) holding stale or foreign bytes, larger
    or smaller than the push, ends up holding exactly the push, sealed like a new one."""
    from rollfleet.engines.weights.memfd import (
        mapped_push_memfd,
        memfd_path,
        new_push_memfd,
        write_push_memfd,
    )
    from rollfleet.engines.weights.wire import decode

    sent = state(1)
    exact = write_push_memfd(sent, 1 << 16)
    try:
        size = os.fstat(exact).st_size
        wanted = os.pread(exact, size, 0)
    finally:
        os.close(exact)
    for spare_size in (size * 2, size // 3, 0):
        spare = new_push_memfd(spare_size)
        os.pwrite(spare, b"\xff" * min(spare_size, 1 << 20), 0)  # what a last push left there
        fd = write_push_memfd(sent, 1 << 16, spare)
        try:
            assert fd == spare and os.fstat(fd).st_size == size
            assert os.pread(fd, size + 1, 0) == wanted
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\0", 0)
            with mapped_push_memfd(memfd_path(fd)) as view:
                got = await decode(view)
                assert all(a.equal(b) for (_, a), (_, b) in zip(got, sent, strict=True))
                del got
        finally:
            os.close(fd)


async def test_successive_pushes_fill_the_spare_and_serve_exactly_the_new_weights(
    hf_served,
) -> None:
    """After a same-host push this process keeps one spare memfd for the next (in no directory:
    the kernel frees it however the process ends); a spare scribbled on changes nothing, each
    push serves exactly its own tensors."""
    import threading

    from rollfleet.engines.weights import push

    url, _, engine = hf_served
    for version in (1, 2, 3):
        sent = state(version)
        answer = await push_weights(url, sent, version=version, token="s3cret", transport="file")
        live = engine.hf_model.state_dict()
        assert engine.version == version
        assert answer["write_s"] > 0 and answer["receive_s"] > 0  # the push's parts, timed
        assert all(live[name].equal(tensor) for name, tensor in sent)
        for thread in threading.enumerate():
            if thread.name == "rollfleet-push-spare":
                thread.join()
        (spare,) = push._SPARES.fds  # a small push: one part
        assert os.readlink(f"/proc/self/fd/{spare}").startswith("/memfd:rollfleet-weights")
        os.pwrite(spare, b"\xff" * 4096, 0)  # the next push overwrites all of it


def test_spares_are_never_kept_over_their_cap_nor_filled_by_a_forked_child() -> None:
    from rollfleet.engines.weights import push

    spares = push._Spares()
    spares.refill([os.memfd_create("test-used")], [push.SPARE_MAX // 2 + 1] * 2)
    assert spares.take() == []  # the used memfd was closed, and no spare made
    spares.refill([os.memfd_create("a"), os.memfd_create("b")], [4096, 8192])
    fds = list(spares.fds)
    assert [os.fstat(fd).st_size for fd in fds] == [4096, 8192]
    spares.pid = -1  # what a forked child sees: its parent's spares
    assert spares.take() == [] and spares.fds == []
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # the child's copies of them are closed
