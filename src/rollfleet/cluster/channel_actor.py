"""The actor behind a Channel: keyed FIFO queues of small payloads or object references.

It never holds large data: producers ``ray.put`` big items themselves and send the reference,
consumers fetch from the object store directly (one hop). All waiting happens here, on one
asyncio loop, so a blocked ``get`` costs no thread and a timeout can never lose an item: the
actor decides, atomically, whether an operation happened.
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

# status codes returned to the client (cheaper than pickling an exception)
OK, EMPTY, FULL, TIMEOUT = 0, 1, 2, 3

Payload = tuple[str, Any]  # (kind, data): see channel._encode
# payloads that hold an object reference: never sent over the lane
REF_KINDS = ("r", "P")
# how long a put waits for an earlier one from the same handle (lost if its sender died)
ORDER_WAIT = 60.0


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
        self._tickets: dict[int, Payload] = {}
        self._ticket_ids = itertools.count()
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
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            given = await lane.read_frame(reader, len(self._token))
            if not hmac.compare_digest(given, self._token):
                return
            while True:
                op, args = await lane.read_message(reader)
                for piece in lane.encode(await self._lane_op(op, args)):
                    writer.write(piece)
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _lane_op(self, op: str, args: tuple[Any, ...]) -> Any:
        """Run a lane request; popped references are parked under tickets for ``claim``."""
        if op == "put":
            return await self.put(*args)
        if op == "qsize":
            return await self.qsize(*args)
        status, payloads = await self.get_batch(*args)
        return status, [self._park(p) for p in payloads]

    def _park(self, payload: Payload) -> Payload:
        """A payload for the lane: big data out of band, references parked under a ticket."""
        if payload[0] not in REF_KINDS:
            return payload[0], lane.out_of_band(payload[1])
        ticket = next(self._ticket_ids)
        self._tickets[ticket] = payload
        return ("t", ticket)

    async def claim(self, tickets: list[int]) -> list[Payload]:
        """Hand over the references popped through the lane (their data stays in the object
        store)."""
        return [self._tickets.pop(t) for t in tickets]

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
        self, key: Any, nowait: bool, timeout: float | None
    ) -> tuple[int, Payload | None]:
        """Pop the oldest entry under ``key``."""
        status, batch = await self.get_batch(key, 1, None, nowait, timeout)
        return status, (batch[0] if batch else None)

    async def get_batch(
        self,
        key: Any,
        n: int | None,
        target_weight: float | None,
        nowait: bool,
        timeout: float | None,
    ) -> tuple[int, list[Payload]]:
        """Pop ``n`` entries, or entries until their weights reach ``target_weight``."""
        ready = self._ready_check(key, n, target_weight)
        if not ready():
            if nowait:
                return EMPTY, []
            if not await _wait(self._items, ready, timeout):
                return TIMEOUT, []
        return OK, await self._pop(key, n, target_weight)

    def _ready_check(
        self, key: Any, n: int | None, target_weight: float | None
    ) -> Callable[[], bool]:
        if target_weight is not None:
            return lambda: (
                bool(self._queues.get(key)) and self._weights.get(key, 0.0) >= target_weight
            )
        need = n or 1
        return lambda: len(self._queues.get(key, ())) >= need

    async def _pop(self, key: Any, n: int | None, target_weight: float | None) -> list[Payload]:
        queue = self._queues[key]
        out: list[Payload] = []
        got = 0.0
        while queue and (len(out) < (n or 1) if target_weight is None else got < target_weight):
            weight, payload = queue.popleft()
            got += weight
            out.append(payload)
        self._weights[key] -= got
        self._total -= len(out)
        if not queue:
            del self._queues[key]
            del self._weights[key]
        async with self._space:
            self._space.notify_all()
        return out


async def _wait(cond: asyncio.Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
    """Wait until ``ready()``; False when ``timeout`` passed first."""
    try:
        async with asyncio.timeout(timeout):
            async with cond:
                await cond.wait_for(ready)
    except TimeoutError:
        return ready()
    return True
