"""Consumers that die on a real local Ray cluster keep nothing: a parked get, a ticket, a Ray-call get.

Each consumer is a Ray actor killed with ``ray.kill`` while it waits (or between popping a
reference and claiming it). The channel actor's ``waiting()`` says when a get is parked and when it
has ended, so nothing here sleeps to synchronise.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

HAVE_RAY = importlib.util.find_spec("ray") is not None
if HAVE_RAY:
    import ray

    from rollfleet.cluster import Channel, create_channel

    @ray.remote(num_cpus=0)
    class Consumer:
        def ready(self) -> bool:
            return True

        def lane_get(self, channel: Channel) -> Any:
            return channel.get(timeout=120)

        async def ray_get(self, channel: Channel) -> Any:
            return await channel.get_async(timeout=120)

        def work_get(self, channel: Channel) -> Any:
            return channel.get(timeout=120, async_op=True).wait()

        def pop_without_claiming(self, channel: Channel, n: int) -> list[Any]:
            status, payloads = channel._call("get", ("default", n, None, False, 30.0), 30.0)
            assert status == 0
            return payloads  # tickets, never claimed: the consumer "dies" before the claim


def until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def channel(cluster: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    ch = create_channel(request.node.name[:60])
    yield ch
    ch.destroy()


def waiting(channel: Any) -> tuple[int, int]:
    return tuple(ray.get(channel._actor.waiting.remote(), timeout=30))  # type: ignore[return-value]


@pytest.mark.parametrize("how", ["lane_get", "ray_get", "work_get"])
def test_a_get_parked_by_a_consumer_that_died_takes_nothing(channel: Any, how: str) -> None:
    consumer = Consumer.remote()
    ray.get(consumer.ready.remote(), timeout=60)
    pending = getattr(consumer, how).remote(channel)
    until(lambda: waiting(channel)[0] == 1)  # parked in the channel actor
    ray.kill(consumer)
    until(lambda: waiting(channel)[0] == 0)  # the channel saw it go
    channel.put("for the living")
    assert channel.get(timeout=30) == "for the living"
    with pytest.raises(ray.exceptions.RayError):  # its caller died with it
        ray.get(pending, timeout=30)


def test_references_a_dead_consumer_popped_but_never_claimed_come_back(channel: Any) -> None:
    first = bytes(range(256)) * 12_000  # 3 MiB: over the inline limit, travels by reference
    second = first[::-1]
    channel.put(first)
    channel.put(second)
    channel.put("small")
    consumer = Consumer.remote()
    tickets = ray.get(consumer.pop_without_claiming.remote(channel, 2), timeout=60)
    assert [p[0] for p in tickets] == ["t", "t"]
    assert channel.qsize() == 1 and waiting(channel)[1] == 2
    ray.kill(consumer)
    until(lambda: waiting(channel)[1] == 0)
    assert channel.qsize() == 3
    assert channel.get_batch(3, timeout=30) == [first, second, "small"]  # back in front, in order


def test_a_living_consumer_is_served_as_before(channel: Any) -> None:
    consumer = Consumer.remote()
    ray.get(consumer.ready.remote(), timeout=60)
    for how in ("lane_get", "ray_get", "work_get"):
        pending = getattr(consumer, how).remote(channel)
        until(lambda: waiting(channel)[0] == 1)
        channel.put(how)
        assert ray.get(pending, timeout=60) == how
    ray.kill(consumer)
