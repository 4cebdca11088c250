"""A same-host push is served from its sealed memfd's mapping, with no copy on the gateway's
side: it answers what a fresh engine on the same weights answers, the version before goes with
the swap, a refused push changes nothing, and the weights outlive the trainer that pushed them."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
from support import greedy

from rollfleet.engines.weights.push import push_weights

MAPPING = "memfd:rollfleet-weights"


def state(seed: int) -> list[tuple[str, Any]]:
    from rollfleet.engines.tiny import tiny_hf_model

    return list(tiny_hf_model(seed=seed)[0].state_dict().items())


def mappings() -> set[tuple[int, int]]:
    """The address ranges of this process's push memfd mappings (an earlier test's engine may
    still hold some: compare with those from before), once the engine's threads that free a
    version have."""
    for thread in threading.enumerate():
        if thread.name == "rollfleet-hf-free":
            thread.join()
    gc.collect()
    ranges = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if MAPPING in line:
                start, end = line.split()[0].split("-")
                ranges.add((int(start, 16), int(end, 16)))
    return ranges


def mapped(tensor: Any, ranges: set[tuple[int, int]]) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end in ranges)


async def fresh_greedy(seed: int) -> list[int]:
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    fresh = HFEngine(*tiny_hf_model(seed=seed))
    await fresh.start()
    try:
        return await greedy(fresh)
    finally:
        await fresh.stop()


async def test_a_same_host_push_is_served_from_its_mapping_like_a_fresh_engine(hf_served) -> None:
    url, _, engine = hf_served
    await push_weights(url, state(1), version=1, token="s3cret", transport="file")
    ranges = mappings()
    for model in (engine.hf_model, engine.standby):  # the standby shares it: one copy in all
        params = list(model.state_dict(keep_vars=True).values())
        assert all(id(p) in engine.kept and mapped(p, ranges) for p in params)
    assert await greedy(engine) == await fresh_greedy(1)


async def test_the_versions_before_go_with_each_swap(hf_served) -> None:
    url, _, engine = hf_served
    before = mappings()
    for version in (1, 2, 3):
        await push_weights(url, state(version), version=version, token="s3cret", transport="file")
        assert len(mappings() - before) == 1, f"after version {version}"
    assert await greedy(engine) == await fresh_greedy(3)


async def test_a_refused_push_after_a_mapped_one_changes_nothing(hf_served) -> None:
    from rollfleet.errors import InvalidInput

    url, _, engine = hf_served
    before = mappings()
    await push_weights(url, state(1), version=1, token="s3cret", transport="file")
    served, kept = await greedy(engine), set(engine.kept)
    wrong = [(n, t[:1] if n == "model.norm.weight" else t) for n, t in state(2)]
    with pytest.raises(InvalidInput, match="model.norm.weight"):
        await push_weights(url, wrong, version=2, token="s3cret", transport="file")
    assert engine.version == 1 and engine.kept == kept and len(mappings() - before) == 1
    assert await greedy(engine) == served


async def test_a_body_push_after_a_mapped_one_copies_into_the_engines_own_memory(
    hf_served,
) -> None:
    """A push over HTTP (or in process) is not sealed: it is copied, never into the mapping, and
    the engine then serves from memory of its own."""
    url, _, engine = hf_served
    before = mappings()
    await push_weights(url, state(1), version=1, token="s3cret", transport="file")
    await push_weights(url, state(2), version=2, token="s3cret", transport="http")
    live, ranges = engine.hf_model.state_dict(keep_vars=True).values(), mappings()
    assert not any(id(p) in engine.kept or mapped(p, ranges) for p in live)
    assert await greedy(engine) == await fresh_greedy(2)
    await push_weights(url, state(3), version=3, token="s3cret", transport="file")
    assert await greedy(engine) == await fresh_greedy(3)
    assert len(mappings() - before) == 1


async def test_a_mapped_delta_keeps_the_rest_from_the_version_before(hf_served) -> None:
    url, _, engine = hf_served
    before = mappings()
    await push_weights(url, state(1), version=1, token="s3cret", transport="file")
    new = dict(state(2))
    sent = [(n, t) for n, t in state(2) if ".mlp." in n]
    await push_weights(url, sent, version=2, delta=True, base=1, token="s3cret", transport="file")
    live = engine.hf_model.state_dict()
    old = dict(state(1))
    assert all(live[n].equal(new[n] if ".mlp." in n else old[n]) for n in old)
    assert len(mappings() - before) == 2  # the delta's, and version 1's for the rest


async def test_a_write_to_a_served_tensor_stays_in_this_process() -> None:
    """The mapping is private: a write (none is meant) copies its page, neither faults nor
    reaches the memfd."""
    from rollfleet.engines.weights.memfd import mapped_push_memfd, memfd_path, write_push_memfd
    from rollfleet.engines.weights.wire import decode, is_sealed

    fd = write_push_memfd(state(1), 1 << 16)
    try:
        before = os.pread(fd, os.fstat(fd).st_size, 0)
        with mapped_push_memfd(memfd_path(fd)) as view:
            tensors = await decode(view, sealed=True)
            assert all(is_sealed(t) for _, t in tensors)
            tensors[0][1].add_(1)
            del tensors
        assert os.pread(fd, os.fstat(fd).st_size, 0) == before
    finally:
        os.close(fd)


async def test_the_weights_outlive_a_trainer_killed_after_its_push(hf_served) -> None:
    url, _, engine = hf_served
    before = mappings()
    trainer = textwrap.dedent(f"""
        import asyncio, threading
        from rollfleet.engines.tiny import tiny_hf_model
        from rollfleet.engines.weights.push import push_weights
        asyncio.run(push_weights({url!r}, tiny_hf_model(seed=1)[0].state_dict().items(), 1,
                                 token="s3cret", transport="file"))
        print("pushed", flush=True)
        threading.Event().wait()  # the test kills us here
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.strip() == "pushed"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert engine.version == 1 and len(mappings() - before) == 1
    assert await greedy(engine) == await fresh_greedy(1)
    await push_weights(url, state(2), version=2, token="s3cret", transport="file")
    assert await greedy(engine) == await fresh_greedy(2) and len(mappings() - before) == 1
