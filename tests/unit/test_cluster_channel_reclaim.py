"""A consumer that dies keeps nothing: the channel actor's lane sessions and presence, without Ray.

The actor serves its lane on a local TCP port here; the clients are asyncio streams speaking the
lane protocol, and "dying" is closing the connection (what the kernel does for a killed process).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from rollfleet.cluster import channel_actor as ca
from rollfleet.cluster import lane


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Re-check an actor-side condition after each turn of the loop; fail after ``timeout``."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.001)


class Client:
    """One lane connection, as a consumer process holds it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, op: str, *args: Any) -> None:
        for piece in lane.encode((op, args)):
            self.writer.write(piece)

    async def call(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return await lane.read_message(self.reader)

    async def die(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@pytest.fixture
async def served() -> AsyncIterator[tuple[ca.ChannelActor, Callable[[], Awaitable[Client]]]]:
    actor = ca.ChannelActor("t", 0)
    server = await asyncio.start_server(actor._session, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]

    async def connect() -> Client:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(lane.frame(actor._token))
        return Client(reader, writer)

    yield actor, connect
    server.close()


def small(value: object) -> tuple[float, ca.Payload]:
    return (1.0, ("p", value))


def ref(value: object) -> tuple[float, ca.Payload]:
    return (1.0, ("r", [value]))  # a reference payload: parked under a ticket on the lane


async def parked(actor: ca.ChannelActor, n: int) -> bool:
    return (await actor.waiting())[0] == n


async def test_a_lane_get_of_a_consumer_that_died_takes_nothing(served: Any) -> None:
    actor, connect = served
    consumer = await connect()
    consumer.send("get", "k", 1, None, False, 60.0)
    await until(lambda: parked(actor, 1))
    await consumer.die()
    await until(lambda: parked(actor, 0))  # the get ended with its connection
    assert await actor.put("k", [small("next")], False, None) == ca.OK
    live = await connect()
    assert await live.call("get", "k", 1, None, False, 5.0) == (ca.OK, [("p", "next")])


async def test_a_lane_get_that_waited_answers_and_the_connection_stays_usable(served: Any) -> None:
    actor, connect = served
    consumer = await connect()
    consumer.send("get", "k", 2, None, False, 60.0)
    await until(lambda: parked(actor, 1))
    await actor.put("k", [small(1)], False, None)
    await actor.put("k", [small(2)], False, None)
    assert await lane.read_message(consumer.reader) == (ca.OK, [("p", 1), ("p", 2)])
    # the watch on the connection let go of it: the next request on it is served normally
    assert await consumer.call("get", "k", 1, None, False, 0.05) == (ca.TIMEOUT, [])
    await actor.put("k", [small(3)], False, None)
    assert await consumer.call("get", "k", 1, None, True, None) == (ca.OK, [("p", 3)])


async def test_two_waiting_gets_and_one_item_one_gets_it_the_other_waits_on(served: Any) -> None:
    # letting go of a waiting get's watch yields to the loop: the other get can take the item in
    # that moment, and the first must go on waiting rather than pop an empty queue
    actor, connect = served
    first, second = await connect(), await connect()
    first.send("get", "k", 1, None, False, 60.0)
    second.send("get", "k", 1, None, False, 60.0)
    await until(lambda: parked(actor, 2))
    await actor.put("k", [small("one")], False, None)
    await until(lambda: parked(actor, 1))
    await actor.put("k", [small("two")], False, None)
    answers = sorted(
        [await lane.read_message(first.reader), await lane.read_message(second.reader)]
    )
    assert answers == [(ca.OK, [("p", "one")]), (ca.OK, [("p", "two")])]


async def test_references_a_dead_consumer_never_claimed_go_back_in_order(served: Any) -> None:
    actor, connect = served
    await actor.put("k", [ref("a"), ref("b"), small("c")], False, None)
    consumer = await connect()
    status, got = await consumer.call("get", "k", 2, None, False, None)
    assert status == ca.OK and [p[0] for p in got] == ["t", "t"]
    assert await actor.qsize() == 1 and (await actor.waiting())[1] == 2
    await consumer.die()  # before claiming its tickets
    await until(lambda: _qsize_is(actor, 3))
    assert (await actor.waiting())[1] == 0
    assert await actor.claim([got[0][1], got[1][1]]) is None  # too late: given back
    status, again = await actor.get_batch("k", 3, None, True, None)
    assert status == ca.OK and again == [("r", ["a"]), ("r", ["b"]), ("p", "c")]


async def _qsize_is(actor: ca.ChannelActor, n: int) -> bool:
    return await actor.qsize() == n


async def test_claimed_references_stay_claimed_when_the_consumer_leaves(served: Any) -> None:
    actor, connect = served
    await actor.put("k", [ref("a"), ref("b")], False, None)
    consumer = await connect()
    status, got = await consumer.call("get", "k", 2, None, False, None)
    assert await actor.claim([t for _, t in got]) == [("r", ["a"]), ("r", ["b"])]
    await consumer.die()
    await until(lambda: _sessions_are(actor, 0))  # the actor has seen the connection close
    assert await actor.qsize() == 0 and (await actor.waiting())[1] == 0


async def _sessions_are(actor: ca.ChannelActor, n: int) -> bool:
    return len(actor._session_tickets) == n


async def test_a_ray_call_get_ends_when_its_presence_connection_closes(served: Any) -> None:
    actor, connect = served
    presence = await connect()
    presence.send("presence", "p-1")
    get = asyncio.create_task(actor.get_batch("k", 1, None, False, 60.0, "p-1"))
    await until(lambda: parked(actor, 1))
    await presence.die()
    assert await asyncio.wait_for(get, 10) == (ca.GONE, [])
    await actor.put("k", [small("kept")], False, None)
    assert await actor.get_batch("k", 1, None, False, 1.0, "p-1") == (ca.GONE, [])  # it stays gone
    assert await actor.get_batch("k", 1, None, False, 1.0, "p-2") == (ca.OK, [("p", "kept")])


async def test_a_ray_call_get_with_a_live_presence_is_served(served: Any) -> None:
    actor, connect = served
    presence = await connect()
    presence.send("presence", "p-live")
    get = asyncio.create_task(actor.get_batch("k", 1, None, False, 60.0, "p-live"))
    await until(lambda: parked(actor, 1))
    await actor.put("k", [small("x")], False, None)
    assert await asyncio.wait_for(get, 10) == (ca.OK, [("p", "x")])
    assert await actor.get_batch("k", 1, None, False, 0.05, "p-live") == (ca.TIMEOUT, [])
