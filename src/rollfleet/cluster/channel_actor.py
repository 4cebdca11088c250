"""The actor behind a Channel: keyed FIFO queues of small payloads or object references.

It never holds large data: producers ``ray.put`` big items themselves and send the reference,
consumers fetch from the object store directly (one hop). All waiting happens here, on one
asyncio loop, so a blocked ``get`` costs no thread and a timeout can never lose an item: the
actor decides, atomically, whether an operation happened.

A consumer that dies keeps nothing. A get parked over a lane connection ends when that connection
closes (the client sends nothing while it waits for an answer, so any byte or EOF means it is
gone); references popped for it and parked under tickets it never claimed go back to the front of
their queue when its connection closes. A get made by Ray call names its process's *presence*
connection (a lane connection that only stays open); when that closes, its parked gets end
without taking anything. Once an item is handed over (written to the lane, returned by Ray, or
claimed) it is the consumer's: delivery is at most once.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import secrets
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from rollfleet.cluster import lane

# status codes returned to the client (cheaper than pickling an exception); GONE: the caller's
# presence connection closed (it is dead, or must open a new one)
OK, EMPTY, FULL, TIMEOUT, GONE = 0, 1, 2, 3, 4

Payload = tuple[str, Any]  # (kind, data): see channel._encode
Entry = tuple[float, Payload]  # (weight, payload) as queued
Watch = Callable[[], "asyncio.Future[Any]"]  # starts watching for the caller being gone
# payloads that hold an object reference: never sent over the lane
REF_KINDS = ("r", "P")
# how long a put waits for an earlier one from the same handle (lost if its sender died)
ORDER_WAIT = 60.0
# a lane peer that vanished without closing (its node died) is noticed after about this long
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


class ChannelActor:
    """Keyed FIFO queues with a shared ``maxsize`` bound, weights for get_batch, and waiters."""

    def __init__(self, name: str, maxsize: int) -> None:
        self._name = name
        self._maxsize = maxsize
        self._queues: dict[Any, deque[tuple[float, Payload]]] = {}
        self._weights: dict[Any, float] = {}
        self._total = 0
        self._items = asyncio.Condition()
        self._space = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._token = secrets.token_bytes(16)
        # references popped through the lane, until claimed: ticket -> (key, weight, payload,
        # the lane session that popped them); a closed session gives back what it did not claim
        self._tickets: dict[int, tuple[Any, float, Payload, int]] = {}
        self._ticket_ids = itertools.count()
        self._session_tickets: dict[int, set[int]] = {}
        self._session_ids = itertools.count()
        self._present: dict[str, asyncio.Event] = {}  # presence id -> set once it has closed
        self._absent: set[str] = set()  # presence ids whose connection has closed
        self._waiting = 0  # gets waiting for items now
        self._next_seq: dict[str, int] = {}  # per client handle: the next Ray-call put to apply
        self._turns = asyncio.Condition()

    async def meta(self) -> tuple[str, int, tuple[str, int, bytes]]:
        """The channel's name, maxsize and lane address (host, port, token)."""
        if self._server is None:
            import ray

            host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            self._server = await asyncio.start_server(self._session, host, 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return self._name, self._maxsize, (host, port, self._token)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one lane connection: a token, then request/answer frames until it closes."""
        _tune(writer.get_extra_info("socket"))
        session = next(self._session_ids)
        self._session_tickets[session] = set()
        try:
            given = await lane.read_frame(reader, len(self._token))
            if not hmac.compare_digest(given, self._token):
                return
            while True:
                op, args = await lane.read_message(reader)
                if op == "presence":
                    await self._presence(str(args[0]), reader)
                    return
                answer = await self._lane_op(op, args, session, reader)
                if answer is None:
                    return  # the client went away while its request waited
                for piece in lane.encode(answer):
                    writer.write(piece)
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            await self._give_back_tickets(session)
            writer.close()

    async def _presence(self, presence: str, reader: asyncio.StreamReader) -> None:
        """Hold a client process's presence connection; its closing ends the gets it parked."""
        closed = self._present.setdefault(presence, asyncio.Event())
        try:
            while await reader.read(1 << 16):
                pass  # a presence connection sends nothing more; read until it closes
        finally:
            self._absent.add(presence)
            self._present.pop(presence, None)
            closed.set()

    async def _lane_op(
        self,
        op: str,
        args: tuple[Any, ...],
        session: int | None = None,
        reader: asyncio.StreamReader | None = None,
    ) -> Any:
        """Run a lane request; popped references are parked under tickets for ``claim``.

        A get that must wait also watches ``reader``: EOF (or any byte: the client sends none
        while it waits) means the client is gone, and the get ends without taking anything
        (None).
        """
        if op == "put":
            return await self.put(*args)
        if op == "qsize":
            return await self.qsize(*args)
        watch = None if reader is None else _closed_watch(reader)
        status, entries = await self._take(*args, gone=watch)
        if status == GONE:
            return None
        return status, [self._park(args[0], entry, session) for entry in entries]

    def _park(self, key: Any, entry: Entry, session: int | None) -> Payload:
        """A payload for the lane: big data out of band, references parked under a ticket."""
        weight, payload = entry
        if payload[0] not in REF_KINDS:
            return payload[0], lane.out_of_band(payload[1])
        ticket = next(self._ticket_ids)
        self._tickets[ticket] = (key, weight, payload, -1 if session is None else session)
        if session is not None:
            self._session_tickets[session].add(ticket)
        return ("t", ticket)

    async def claim(self, tickets: list[int]) -> list[Payload] | None:
        """Hand over the references popped through the lane (their data stays in the object
        store); None when they were given back (the lane connection that popped them closed)."""
        if any(t not in self._tickets for t in tickets):
            return None
        out = []
        for t in tickets:
            _key, _weight, payload, session = self._tickets.pop(t)
            self._session_tickets.get(session, set()).discard(t)
            out.append(payload)
        return out

    async def _give_back_tickets(self, session: int) -> None:
        """Put the references a closed lane session never claimed back at the front of their
        queues, in the order they were popped."""
        tickets = sorted(self._session_tickets.pop(session, ()))
        by_key: dict[Any, list[Entry]] = {}
        for t in tickets:
            key, weight, payload, _session = self._tickets.pop(t)
            by_key.setdefault(key, []).append((weight, payload))
        for key, entries in by_key.items():
            self._give_back(key, entries)
        if by_key:
            async with self._items:
                self._items.notify_all()

    def _give_back(self, key: Any, entries: list[Entry]) -> None:
        """Return popped entries to the front of ``key``'s queue (maxsize may be exceeded for a
        while: an item is never dropped for want of room)."""
        queue = self._queues.setdefault(key, deque())
        queue.extendleft(reversed(entries))
        self._weights[key] = self._weights.get(key, 0.0) + sum(w for w, _ in entries)
        self._total += len(entries)

    async def waiting(self) -> tuple[int, int]:
        """Gets waiting for items now, and references popped through the lane not yet claimed."""
        return self._waiting, len(self._tickets)

    async def qsize(self, key: Any = None) -> int:
        """Items queued under ``key`` (every key when None)."""
        if key is None:
            return self._total
        return len(self._queues.get(key, ()))

    def _room(self, n: int) -> bool:
        return not self._maxsize or self._total + n <= self._maxsize or self._total == 0

    async def put_in_order(
        self,
        client: str,
        seq: int,
        key: Any,
        entries: list[tuple[float, Payload]],
        nowait: bool,
        timeout: float | None,
    ) -> int:
        """``put`` for Ray calls, which an async actor may start out of order: apply them in ``seq``
        order."""
        await _wait(self._turns, lambda: self._next_seq.get(client, 0) >= seq, ORDER_WAIT)
        try:
            return await self.put(key, entries, nowait, timeout)
        finally:
            self._next_seq[client] = max(self._next_seq.get(client, 0), seq + 1)
            async with self._turns:
                self._turns.notify_all()

    async def put(
        self, key: Any, entries: list[tuple[float, Payload]], nowait: bool, timeout: float | None
    ) -> int:
        """Append ``entries`` under ``key`` once they fit under maxsize."""
        if not self._room(len(entries)):
            if nowait:
                return FULL
            if not await _wait(self._space, lambda: self._room(len(entries)), timeout):
                return TIMEOUT
        queue = self._queues.setdefault(key, deque())
        queue.extend(entries)
        self._weights[key] = self._weights.get(key, 0.0) + sum(w for w, _ in entries)
        self._total += len(entries)
        async with self._items:
            self._items.notify_all()
        return OK

    async def get(
        self, key: Any, nowait: bool, timeout: float | None, presence: str | None = None
    ) -> tuple[int, Payload | None]:
        """Pop the oldest entry under ``key``."""
        status, batch = await self.get_batch(key, 1, None, nowait, timeout, presence)
        return status, (batch[0] if batch else None)

    async def get_batch(
        self,
        key: Any,
        n: int | None,
        target_weight: float | None,
        nowait: bool,
        timeout: float | None,
        presence: str | None = None,
    ) -> tuple[int, list[Payload]]:
        """Pop ``n`` entries, or entries until their weights reach ``target_weight``.

        ``presence``: the caller's presence connection; if it closes while this get waits, the
        get ends (GONE) without taking anything.
        """
        watch = None
        if presence is not None:
            if presence in self._absent:
                return GONE, []
            closed = self._present.setdefault(presence, asyncio.Event())
            watch = _event_watch(closed)
        status, entries = await self._take(key, n, target_weight, nowait, timeout, gone=watch)
        return status, [payload for _, payload in entries]

    async def _take(
        self,
        key: Any,
        n: int | None,
        target_weight: float | None,
        nowait: bool,
        timeout: float | None,
        *,
        gone: Watch | None = None,
    ) -> tuple[int, list[Entry]]:
        """Pop entries once ready; while waiting, ``gone`` ending means the caller is gone."""
        ready = self._ready_check(key, n, target_weight)
        if not ready():
            if nowait:
                return EMPTY, []
            self._waiting += 1
            try:
                if gone is None:
                    status = OK if await _wait(self._items, ready, timeout) else TIMEOUT
                else:
                    status = await self._wait_unless_gone(ready, timeout, gone)
            finally:
                self._waiting -= 1
            if status != OK:
                return status, []
        return OK, await self._pop(key, n, target_weight)

    async def _wait_unless_gone(
        self, ready: Callable[[], bool], timeout: float | None, gone: Watch
    ) -> int:
        """Wait until ``ready()`` (OK), the timeout (TIMEOUT), or the caller is gone (GONE); on
        OK, ``ready()`` holds (nothing else ran between the check and the return)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            status = await self._wait_once(ready, deadline, gone)
            # letting go of the watch yields to the loop: another get may have taken the item
            if status != OK or ready():
                return status

    async def _wait_once(
        self, ready: Callable[[], bool], deadline: float | None, gone: Watch
    ) -> int:
        """One wait with a fresh watch; OK may no longer hold once the watch is let go."""
        loop = asyncio.get_running_loop()
        watch = gone()
        try:
            while not ready():
                if watch.done():
                    return GONE
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return TIMEOUT
                waiter = asyncio.ensure_future(_wait(self._items, ready, left))
                try:
                    await asyncio.wait([waiter, watch], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            return GONE if watch.done() else OK
        finally:
            if not watch.done():
                watch.cancel()
                # a cancelled read must have let go of the reader before the session reads again
                await asyncio.wait([watch])

    def _ready_check(
        self, key: Any, n: int | None, target_weight: float | None
    ) -> Callable[[], bool]:
        if target_weight is not None:
            return lambda: (
                bool(self._queues.get(key)) and self._weights.get(key, 0.0) >= target_weight
            )
        need = n or 1
        return lambda: len(self._queues.get(key, ())) >= need

    async def _pop(self, key: Any, n: int | None, target_weight: float | None) -> list[Entry]:
        queue = self._queues[key]
        out: list[Entry] = []
        got = 0.0
        while queue and (len(out) < (n or 1) if target_weight is None else got < target_weight):
            entry = queue.popleft()
            got += entry[0]
            out.append(entry)
        self._weights[key] -= got
        self._total -= len(out)
        if not queue:
            del self._queues[key]
            del self._weights[key]
        async with self._space:
            self._space.notify_all()
        return out


def _closed_watch(reader: asyncio.StreamReader) -> Watch:
    """Watches a lane peer: it ends when the peer sends anything or closes (a client sends
    nothing while it waits for an answer)."""
    return lambda: asyncio.ensure_future(reader.read(1))


def _event_watch(event: asyncio.Event) -> Watch:
    """Watches an event (a presence connection's closing)."""
    return lambda: asyncio.ensure_future(event.wait())


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalives, so that a peer whose node died is noticed, not awaited."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


async def _wait(cond: asyncio.Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
    """Wait until ``ready()``; False when ``timeout`` passed first."""
    try:
        async with asyncio.timeout(timeout):
            async with cond:
                await cond.wait_for(ready)
    except TimeoutError:
        return ready()
    return True
