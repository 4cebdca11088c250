"""Channels on a real local Ray cluster: order, keys, batches, back-pressure, many peers, big items."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.ray

HAVE_RAY = importlib.util.find_spec("ray") is not None
if HAVE_RAY:
    import numpy as np

    from rollfleet.cluster import (
        Channel,
        ChannelEmpty,
        ChannelFull,
        CpuPlacement,
        Worker,
        connect_channel,
        create_channel,
    )
    from rollfleet.cluster.channel import _encode
    from rollfleet.errors import ClusterError, ClusterTimeout

    class Peer(Worker):
        def produce(self, channel: Channel, n: int) -> int:
            for i in range(n):
                channel.put((self.rank, i))
            return n

        def produce_async_op(self, channel: Channel, n: int) -> int:
            works = [channel.put(i, async_op=True) for i in range(n)]
            for work in works:
                work.wait(timeout=60)
            return n

        def consume(self, channel: Channel, n: int) -> list[Any]:
            return [channel.get(timeout=60) for _ in range(n)]

        def make(self, name: str) -> str:
            channel = self.create_channel(name)
            channel.put(f"from {self.worker_address}")
            return channel.name

        def read(self, name: str) -> Any:
            return self.connect_channel(name, timeout=30).get(timeout=30)


@pytest.fixture(scope="module")
def peers(cluster: Any) -> Iterator[Any]:
    g = Peer.create_group().launch(cluster, CpuPlacement(4), name="peers")
    yield g
    g.shutdown()


@pytest.fixture
def channel(cluster: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    ch = create_channel(request.node.name[:60], maxsize=getattr(request, "param", 0))
    yield ch
    ch.destroy()


def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_cluster_channel_fifo_keys_and_sizes(channel: Any) -> None:
    for i in range(5):
        channel.put(i)
    channel.put("k-item", key="k")
    assert channel.qsize() == 6 and channel.qsize("k") == 1 and not channel.empty()
    assert [channel.get() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert channel.get(key="k") == "k-item"
    assert channel.empty()


def test_cluster_channel_get_batch_by_count_and_weight(channel: Any) -> None:
    channel.put_batch(["a", "b", "c"])
    assert channel.get_batch(2) == ["a", "b"]
    channel.put("heavy", weight=5.0)
    channel.put("light", weight=1.0)
    assert channel.get_batch(target_weight=6.5) == ["c", "heavy", "light"]  # 1 + 5 + 1 >= 6.5
    with pytest.raises(Exception, match="exactly one of"):
        channel.get_batch()


def test_cluster_channel_nowait_and_timeouts(cluster: Any) -> None:
    ch = create_channel("tiny", maxsize=1)
    try:
        with pytest.raises(ChannelEmpty):
            ch.get_nowait()
        ch.put_nowait("one")
        assert ch.full()
        with pytest.raises(ChannelFull) as full:
            ch.put_nowait("two")
        assert isinstance(full.value, asyncio.QueueFull)
        with pytest.raises(ClusterTimeout, match=r"channel 'tiny' put .* by driver timed out"):
            ch.put("two", timeout=0.2)
        assert ch.get_nowait() == "one"
        with pytest.raises(ClusterTimeout, match="timed out after 0.2s"):
            ch.get(timeout=0.2)
        assert ch.qsize() == 0  # neither the timed-out put nor the get touched the queue
    finally:
        ch.destroy()


def test_cluster_channel_big_items_go_by_reference(channel: Any) -> None:
    blob = bytes(range(256)) * 4096  # 1 MiB: under the default inline limit
    large = blob * 3  # 3 MiB: over it
    array = np.arange(300_000, dtype=np.int64)  # 2.4 MB
    assert _encode(blob, channel.inline_limit)[0] == "b"
    assert _encode(large, channel.inline_limit)[0] == "r"
    assert _encode({"nested": "x" * 3_000_000}, channel.inline_limit)[0] == "P"
    by_ref = connect_channel(channel.name, inline_limit=64 * 1024)
    assert _encode(blob, by_ref.inline_limit)[0] == "r"
    by_ref.put(blob)
    channel.put(large)
    channel.put(array)
    by_ref.put({"nested": "x" * 100_000})
    channel.put(blob)
    assert channel.get() == blob
    assert channel.get() == large
    assert np.array_equal(channel.get(), array)
    assert channel.get_batch(2) == [{"nested": "x" * 100_000}, blob]


def test_cluster_channel_connect_by_name_and_errors(channel: Any) -> None:
    other = connect_channel(channel.name)
    other.put("via other handle")
    assert channel.get() == "via other handle"
    with pytest.raises(ClusterError, match="already exists"):
        create_channel(channel.name)
    with pytest.raises(ClusterError, match="no channel named"):
        connect_channel("missing-channel")
    with pytest.raises(ClusterTimeout, match="did not appear within 0.2s"):
        connect_channel("missing-channel", timeout=0.2)


@pytest.mark.parametrize("channel", [3], indirect=True)
def test_cluster_channel_backpressure_blocks_a_producer(channel: Any, peers: Any) -> None:
    work = peers.execute_on(0).produce(channel, 10)
    wait_until(lambda: channel.qsize() == 3)
    assert not work.done()  # blocked on the full channel
    assert channel.qsize() == 3
    got = [channel.get(timeout=30) for _ in range(10)]
    assert got == [(0, i) for i in range(10)]
    assert work.wait(timeout=60) == [10]


@pytest.mark.parametrize("channel", [2], indirect=True)
def test_cluster_channel_async_op_puts_are_bounded_too(channel: Any, peers: Any) -> None:
    work = peers.execute_on(1).produce_async_op(channel, 6)
    wait_until(lambda: channel.qsize() == 2)
    assert not work.done()
    assert [channel.get(timeout=30) for _ in range(6)] == list(range(6))
    assert work.wait(timeout=60) == [6]


def test_cluster_channel_many_producers_and_consumers_10000_items(channel: Any, peers: Any) -> None:
    producers = peers.execute_on(0, 1).produce(channel, 5000)
    consumers = peers.execute_on(2, 3).consume(channel, 5000)
    assert producers.wait(timeout=120) == [5000, 5000]
    received = consumers.wait(timeout=120)
    everything = received[0] + received[1]
    assert sorted(everything) == sorted((r, i) for r in (0, 1) for i in range(5000))
    for got in received:  # each consumer sees each producer's items in order
        for producer in (0, 1):
            seq = [i for r, i in got if r == producer]
            assert seq == sorted(seq)
    assert channel.empty()


async def test_cluster_channel_async_variants(channel: Any) -> None:
    await channel.put_async("a")
    await channel.put_async(b"b" * 200_000)
    assert await channel.get_async() == "a"
    assert await channel.get_batch_async(1) == [b"b" * 200_000]
    getter = asyncio.ensure_future(channel.get_async(timeout=30))
    await channel.put_async("wake")
    assert await getter == "wake"
    channel.put(b"c" * 150_000)  # out-of-band over the lane, then out through a Ray call
    assert await channel.get_async() == b"c" * 150_000
    work = channel.get(async_op=True)
    channel.put("later")
    assert work.wait(timeout=30) == "later"
    with pytest.raises(ClusterTimeout):
        await channel.get_async(timeout=0.2)


def test_cluster_channel_created_by_a_worker(peers: Any) -> None:
    assert peers.execute_on(0).make("made-by-worker").wait() == ["made-by-worker"]
    assert peers.execute_on(1).read("made-by-worker").wait() == ["from peers:0"]
