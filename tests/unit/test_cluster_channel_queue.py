"""The channel actor's queue logic, driven directly on an event loop (no Ray)."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
from support import require

from rollfleet.cluster import channel_actor as ca


def codec() -> Any:
    require(importlib.util.find_spec("ray") is not None, "Ray (pip install 'rollfleet[cluster]')")
    from rollfleet.cluster import channel

    return channel


def entry(value: object, weight: float = 1.0) -> tuple[float, ca.Payload]:
    return (weight, ("p", value))


async def test_cluster_queue_keeps_fifo_order_per_key() -> None:
    q = ca.ChannelActor("t", 0)
    for i in range(5):
        assert await q.put("a", [entry(i)], False, None) == ca.OK
    await q.put("b", [entry("x")], False, None)
    assert await q.qsize() == 6
    assert await q.qsize("a") == 5
    got = [(await q.get("a", False, None))[1] for _ in range(5)]
    assert [p[1] for p in got if p] == [0, 1, 2, 3, 4]
    assert await q.get("a", True, None) == (ca.EMPTY, None)
    assert (await q.get("b", True, None))[1] == ("p", "x")


async def test_cluster_queue_get_batch_by_count_and_by_weight() -> None:
    q = ca.ChannelActor("t", 0)
    await q.put("k", [entry("a", 1), entry("b", 2), entry("c", 3), entry("d", 1)], False, None)
    status, batch = await q.get_batch("k", 2, None, False, None)
    assert status == ca.OK and [p[1] for p in batch] == ["a", "b"]
    status, batch = await q.get_batch("k", None, 3.5, False, None)  # c (3) + d (1) >= 3.5
    assert status == ca.OK and [p[1] for p in batch] == ["c", "d"]
    assert await q.get_batch("k", None, 1.0, False, 0.05) == (ca.TIMEOUT, [])


async def test_cluster_queue_get_batch_waits_until_enough_items() -> None:
    q = ca.ChannelActor("t", 0)
    waiter = asyncio.create_task(q.get_batch("k", 3, None, False, 5.0))
    for i in range(3):
        await asyncio.sleep(0)
        assert not waiter.done()
        await q.put("k", [entry(i)], False, None)
    status, batch = await asyncio.wait_for(waiter, 5)
    assert status == ca.OK and [p[1] for p in batch] == [0, 1, 2]


async def test_cluster_queue_maxsize_backpressure() -> None:
    q = ca.ChannelActor("t", 2)
    await q.put("k", [entry(1), entry(2)], False, None)
    assert await q.put("k", [entry(3)], True, None) == ca.FULL
    assert await q.put("other", [entry(3)], False, 0.05) == ca.TIMEOUT  # the bound is channel-wide
    blocked = asyncio.create_task(q.put("k", [entry(3)], False, 5.0))
    await asyncio.sleep(0)
    assert not blocked.done()
    await q.get("k", False, None)
    assert await asyncio.wait_for(blocked, 5) == ca.OK
    assert await q.qsize() == 2


async def test_cluster_queue_timed_out_get_loses_nothing() -> None:
    q = ca.ChannelActor("t", 0)
    assert await q.get("k", False, 0.01) == (ca.TIMEOUT, None)
    await q.put("k", [entry("late")], False, None)
    assert (await q.get("k", False, 0.01))[1] == ("p", "late")


async def test_cluster_queue_parks_references_for_claim() -> None:
    q = ca.ChannelActor("t", 0)
    marker = object()
    await q.put("k", [(1.0, ("r", [marker])), entry("small")], False, None)
    status, parked = await q._lane_op("get", ("k", 2, None, False, None))
    assert status == ca.OK
    assert parked[0][0] == "t" and parked[1] == ("p", "small")
    assert await q.claim([parked[0][1]]) == [("r", [marker])]


@pytest.mark.parametrize("item", [b"raw", "text", 42, {"a": [1, 2]}, (1, None), 3.5])
def test_cluster_small_items_travel_inline(item: object) -> None:
    channel = codec()
    payload = channel._encode(item, 1024)
    assert payload[0] in ("b", "p")
    assert channel._decode_all([payload], []) == [item]


def test_cluster_lambda_items_use_cloudpickle() -> None:
    channel = codec()
    payload = channel._encode(
        [lambda x: x + 1], 1 << 16
    )  # plain pickle fails, cloudpickle takes over
    assert payload[0] == "p"
    assert channel._decode_all([payload], [])[0][0](1) == 2
