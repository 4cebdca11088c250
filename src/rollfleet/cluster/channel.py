"""``Channel``: a named, keyed FIFO between workers (and drivers), backed by one async actor.

Items under ``inline_limit`` bytes (2 MiB by default) travel inside the put/get messages, over a
direct TCP lane to the actor (see ``lane``): Ray's per-object bookkeeping (put, borrower
registration, a call returning the reference) costs a few milliseconds per item, more than
copying a couple of MiB twice (measured in docs/cluster.md). Larger items are ``ray.put`` by the
producer and the channel passes only the reference: the consumer reads the data from the object
store in one hop. Blocking, ``maxsize`` back-pressure and timeouts are decided inside the actor, so
a
timed-out put never lands later and a timed-out get never eats an item. The ``*_async`` methods
and ``async_op=True`` use Ray actor calls (awaitable without a thread).

A consumer that dies while its get waits takes nothing: a lane get ends with its connection, and
a Ray-call get names this process's presence connection to the actor (opened once per channel
and process, and kept open), whose closing ends it. References popped for a consumer that dies
before claiming them go back to the front of their queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import time
import uuid
from collections import deque
from typing import Any

import ray
from ray import exceptions as rayexc
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollfleet.cluster import channel_actor as ca
from rollfleet.cluster.cluster import NAMESPACE, find_node
from rollfleet.cluster.lane import LaneAddress, out_of_band, shared_lane
from rollfleet.cluster.presence import drop_presence, open_presence, presence_id
from rollfleet.cluster.waiting import Work, caller_name, get_all, get_all_async
from rollfleet.errors import ChannelEmpty, ChannelFull, ClusterError, ClusterTimeout, InvalidInput

log = logging.getLogger("rollfleet.cluster")

DEFAULT_KEY = "default"
# the measured crossover between two lane copies and one object-store hop
INLINE_LIMIT = 2 * 1024 * 1024
_GRACE = 30.0  # how much longer than the actor's own deadline the client waits for its answer

_created: dict[str, Channel] = {}  # channels this process created: alive as long as it is
_RemoteChannel: Any = ray.remote(num_cpus=0, max_concurrency=100_000)(ca.ChannelActor)  # type: ignore[call-overload]


def _actor_name(name: str) -> str:
    return f"channel:{name}"


def create_channel(
    name: str,
    node_id: int | str | None = None,
    maxsize: int = 0,
    *,
    exist_ok: bool = False,
    detached: bool = False,
    inline_limit: int = INLINE_LIMIT,
) -> Channel:
    """Create the channel ``name`` holding at most ``maxsize`` items (0: unbounded).

    RLinf's argument order: ``create_channel(name, node_id, maxsize)``. ``node_id`` pins the
    channel's actor to a node: its index (as ``Cluster().nodes()`` numbers them, RLinf's node
    rank) or its Ray node id; None lets Ray place it. Pass ``maxsize`` by keyword when there is
    no node. The channel lives as long as the process that created it, or until ``destroy()``
    when ``detached``. With ``exist_ok`` an existing channel of that name is returned instead.
    ``inline_limit``: items of at least this many bytes go by object-store reference.
    """
    if maxsize < 0:
        raise InvalidInput(f"channel {name!r}: maxsize must be >= 0, got {maxsize}")
    options: dict[str, Any] = {
        "name": _actor_name(name),
        "namespace": NAMESPACE,
        "get_if_exists": exist_ok,
    }
    if detached:
        options["lifetime"] = "detached"
    if node_id is not None:
        if isinstance(node_id, bool) or not isinstance(node_id, (int, str)):
            raise InvalidInput(f"channel {name!r}: node_id must be a node index or a Ray node id")
        try:
            node = find_node(node_id).node_id
        except InvalidInput as exc:  # most likely a maxsize given where the node goes
            raise InvalidInput(
                f"channel {name!r}: {exc}; the order is create_channel(name, node_id, maxsize), "
                "pass maxsize= by keyword"
            ) from exc
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    try:
        actor = _RemoteChannel.options(**options).remote(name, maxsize)
    except ValueError as exc:
        raise ClusterError(
            f"channel {name!r} already exists; use connect_channel({name!r})"
        ) from exc
    channel = _created[name] = _attach(name, actor, inline_limit)
    log.info("channel %s ready (maxsize=%d)", name, channel.maxsize)
    return channel


def connect_channel(
    name: str, timeout: float = 0.0, *, inline_limit: int = INLINE_LIMIT
) -> Channel:
    """Connect to the existing channel ``name``, waiting up to ``timeout`` seconds for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _attach(
                name, ray.get_actor(_actor_name(name), namespace=NAMESPACE), inline_limit
            )
        except ValueError as exc:
            if time.monotonic() >= deadline:
                if timeout:
                    raise ClusterTimeout(
                        f"{caller_name()}: channel {name!r} did not appear within {timeout}s"
                    ) from exc
                raise ClusterError(
                    f"no channel named {name!r}; create it with create_channel"
                ) from exc
            time.sleep(0.05)


def _attach(name: str, actor: Any, inline_limit: int) -> Channel:
    """A Channel handle on ``actor`` once it answers (its maxsize and lane address)."""
    _, maxsize, address = get_all(
        [actor.meta.remote()], [f"channel {name!r}"], "channel start", 120.0
    )[0]
    return Channel(name, actor, int(maxsize), address, inline_limit)


def _encode(item: Any, limit: int) -> ca.Payload:
    """Inline small items, ``ray.put`` big ones and keep only the reference."""
    if isinstance(item, bytes) and len(item) < limit:
        return ("b", item)
    if isinstance(item, bytes) or (hasattr(item, "nbytes") and int(item.nbytes) >= limit):
        return ("r", [ray.put(item)])  # bytes, numpy arrays, tensors: stored once, read zero-copy
    data = _pickle(item)
    return ("p", data) if len(data) < limit else ("P", [ray.put(data)])


def _pickle(item: Any) -> bytes:
    """Plain pickle (fast), or cloudpickle for what it cannot do (lambdas, local classes)."""
    try:
        return pickle.dumps(item, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError):
        return bytes(ray.cloudpickle.dumps(item))  # type: ignore[no-untyped-call]


def _inline(entries: list[tuple[float, ca.Payload]]) -> bool:
    return all(p[0] not in ca.REF_KINDS for _, p in entries)


def _decode_all(payloads: list[ca.Payload], fetched: list[Any]) -> list[Any]:
    """Items from payloads; ``fetched`` holds the object-store values of the reference payloads."""
    values = iter(fetched)
    out = []
    for kind, data in payloads:
        if kind == "b":
            out.append(data if isinstance(data, bytes) else bytes(data))
        elif kind == "p":
            out.append(pickle.loads(data))
        else:
            value = next(values)
            out.append(pickle.loads(value) if kind == "P" else value)
    return out


class Channel:
    """A handle on a named channel; cheap to copy and to pass to other workers."""

    def __init__(
        self,
        name: str,
        actor: Any,
        maxsize: int,
        lane: LaneAddress,
        inline_limit: int = INLINE_LIMIT,
    ) -> None:
        self.name = name
        self._actor = actor
        self._maxsize = maxsize
        self._lane_address = lane
        self._lane = shared_lane(lane, f"channel {name!r}")
        self.inline_limit = inline_limit
        self._in_flight: deque[Work] = deque()
        self._where = [f"channel {name!r}"]
        # Ray-call puts carry (client, seq) so the actor keeps their order
        self._client = uuid.uuid4().hex
        self._seq = itertools.count()

    def _put_rpc(
        self, key: Any, entries: list[tuple[float, ca.Payload]], nowait: bool, timeout: float | None
    ) -> Any:
        return self._actor.put_in_order.remote(
            self._client, next(self._seq), key, entries, nowait, timeout
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            Channel,
            (self.name, self._actor, self._maxsize, self._lane_address, self.inline_limit),
        )

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self._maxsize})"

    @property
    def maxsize(self) -> int:
        """The most items the channel holds (0: unbounded)."""
        return self._maxsize

    def _what(self, op: str, key: Any) -> str:
        return f"channel {self.name!r} {op} (key={key!r}) by {caller_name()}"

    def _rpc(self, ref: Any, op: str, key: Any, timeout: float | None) -> Any:
        return get_all([ref], self._where, self._what(op, key), _grace(timeout))[0]

    def _call(self, op: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        """A request over the lane, after this handle's async puts have landed (keeps order)."""
        self.flush()
        return self._lane.call(op, args, _grace(timeout))

    def _check(self, status: int, op: str, key: Any, timeout: float | None) -> None:
        if status == ca.TIMEOUT:
            raise ClusterTimeout(f"{self._what(op, key)} timed out after {timeout}s")
        if status == ca.FULL:
            raise ChannelFull(f"{self._what(op, key)}: channel full ({self._maxsize} items)")
        if status == ca.EMPTY:
            raise ChannelEmpty(f"{self._what(op, key)}: no item")
        if status == ca.GONE:
            drop_presence(self._lane_address, self._presence_id)
            raise ClusterError(
                f"{self._what(op, key)}: the channel saw this process's presence connection close "
                "and took nothing for it; retry"
            )

    @property
    def _presence_id(self) -> str | None:
        return presence_id(self._lane_address)

    def _get_rpc(self, key: Any, n: int | None, target: float | None, timeout: float | None) -> Any:
        """A get by Ray call, ended by the actor if this process dies while it waits."""
        presence = self._presence_id or open_presence(self._lane_address)
        return self._actor.get_batch.remote(key, n, target, False, timeout, presence)

    # -- put -----------------------------------------------------------------------------------
    def _put(
        self,
        items: list[Any],
        weights: list[float],
        key: Any,
        nowait: bool,
        timeout: float | None,
        op: str,
    ) -> None:
        entries = [
            (float(w), _encode(item, self.inline_limit))
            for item, w in zip(items, weights, strict=True)
        ]
        args = (key, entries, nowait, timeout)
        if _inline(entries):
            wire = [(w, (kind, out_of_band(data))) for w, (kind, data) in entries]
            self._check(self._call("put", (key, wire, nowait, timeout), timeout), op, key, timeout)
            return
        # references travel through Ray, so that it counts the channel as a borrower
        self._check(self._rpc(self._put_rpc(*args), op, key, timeout), op, key, timeout)

    def flush(self) -> None:
        """Wait until every ``async_op`` put this handle started has landed (raising its error)."""
        while self._in_flight:
            self._in_flight.popleft().wait()

    def put(
        self,
        item: Any,
        key: Any = DEFAULT_KEY,
        weight: float = 1.0,
        *,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Add ``item`` under ``key``; blocks while the channel is full (up to ``timeout``)."""
        if async_op:
            return self._put_async_op(item, weight, key, timeout)
        self._put([item], [weight], key, False, timeout, "put")
        return None

    def put_batch(
        self,
        items: list[Any],
        key: Any = DEFAULT_KEY,
        weights: list[float] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Add several items in one message (they enter the channel together)."""
        self._put(items, weights or [1.0] * len(items), key, False, timeout, "put_batch")

    def put_nowait(self, item: Any, key: Any = DEFAULT_KEY, weight: float = 1.0) -> None:
        """Add ``item`` or raise ChannelFull at once."""
        self._put([item], [weight], key, True, None, "put_nowait")

    def _put_async_op(self, item: Any, weight: float, key: Any, timeout: float | None) -> Work:
        """Start a put; at most ``maxsize`` (bounded) or 1000 of this handle's puts are in
        flight."""
        while len(self._in_flight) >= (self._maxsize or 1000):
            self._in_flight.popleft().wait()
        ref = self._put_rpc(
            key, [(float(weight), _encode(item, self.inline_limit))], False, timeout
        )
        work = Work(
            [ref],
            self._where,
            self._what("put", key),
            lambda r: self._check(r[0], "put", key, timeout),
        )
        self._in_flight.append(work)
        return work

    async def put_async(
        self,
        item: Any,
        key: Any = DEFAULT_KEY,
        weight: float = 1.0,
        *,
        timeout: float | None = None,
    ) -> None:
        """Awaitable put; suspends while the channel is full."""
        ref = self._put_rpc(
            key, [(float(weight), _encode(item, self.inline_limit))], False, timeout
        )
        status = (await get_all_async([ref], self._where, self._what("put", key), _grace(timeout)))[
            0
        ]
        self._check(status, "put", key, timeout)

    # -- get -----------------------------------------------------------------------------------
    def _take(
        self,
        key: Any,
        n: int | None,
        target: float | None,
        nowait: bool,
        timeout: float | None,
        op: str,
    ) -> list[Any]:
        status, payloads = self._call("get", (key, n, target, nowait, timeout), timeout)
        self._check(status, op, key, timeout)
        tickets = [p[1] for p in payloads if p[0] == "t"]
        if not tickets:
            return _decode_all(payloads, [])
        answer = self._rpc(self._actor.claim.remote(tickets), op, key, None)
        if answer is None:  # this thread's lane connection closed before the claim: given back
            raise ClusterError(f"{self._what(op, key)}: the items were given back to the channel")
        claimed = iter(answer)
        payloads = [next(claimed) if p[0] == "t" else p for p in payloads]
        return _decode_all(payloads, self._fetch(payloads))

    def get(
        self, key: Any = DEFAULT_KEY, *, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Remove and return the oldest item under ``key``, waiting up to ``timeout`` for one."""
        if async_op:
            ref = self._get_rpc(key, 1, None, timeout)
            return Work(
                [ref],
                self._where,
                self._what("get", key),
                lambda r: self._unpack(r[0], key, timeout)[0],
            )
        return self._take(key, 1, None, False, timeout, "get")[0]

    def get_nowait(self, key: Any = DEFAULT_KEY) -> Any:
        """Remove and return the oldest item under ``key`` or raise ChannelEmpty."""
        return self._take(key, 1, None, True, None, "get_nowait")[0]

    def get_batch(
        self,
        n: int | None = None,
        *,
        target_weight: float | None = None,
        key: Any = DEFAULT_KEY,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Remove ``n`` items, or items until their weights reach ``target_weight``, in one
        message."""
        if (n is None) == (target_weight is None) or (n is not None and n < 1):
            raise InvalidInput("get_batch needs exactly one of n >= 1 or target_weight")
        if async_op:
            ref = self._get_rpc(key, n, target_weight, timeout)
            return Work(
                [ref],
                self._where,
                self._what("get_batch", key),
                lambda r: self._unpack(r[0], key, timeout),
            )
        return self._take(key, n, target_weight, False, timeout, "get_batch")

    async def get_async(self, key: Any = DEFAULT_KEY, *, timeout: float | None = None) -> Any:
        """Awaitable get."""
        return (await self.get_batch_async(1, key=key, timeout=timeout))[0]

    async def get_batch_async(
        self,
        n: int | None = None,
        *,
        target_weight: float | None = None,
        key: Any = DEFAULT_KEY,
        timeout: float | None = None,
    ) -> list[Any]:
        """Awaitable get_batch."""
        presence = self._presence_id or await asyncio.to_thread(open_presence, self._lane_address)
        ref = self._actor.get_batch.remote(key, n, target_weight, False, timeout, presence)
        status, payloads = (
            await get_all_async([ref], self._where, self._what("get", key), _grace(timeout))
        )[0]
        self._check(status, "get", key, timeout)
        refs = [p[1][0] for p in payloads if p[0] in ca.REF_KINDS]
        try:
            return _decode_all(payloads, list(await asyncio.gather(*refs)) if refs else [])
        except rayexc.ObjectLostError as exc:
            raise self._lost(exc) from exc

    def _unpack(
        self, answer: tuple[int, list[ca.Payload]], key: Any, timeout: float | None
    ) -> list[Any]:
        status, payloads = answer
        self._check(status, "get", key, timeout)
        return _decode_all(payloads, self._fetch(payloads))

    def _fetch(self, payloads: list[ca.Payload]) -> list[Any]:
        """The object-store values of the reference payloads (one hop from their producers)."""
        refs = [p[1][0] for p in payloads if p[0] in ca.REF_KINDS]
        try:
            return list(ray.get(refs)) if refs else []
        except rayexc.ObjectLostError as exc:
            raise self._lost(exc) from exc

    def _lost(self, exc: Exception) -> ClusterError:
        return ClusterError(
            f"channel {self.name!r}: an item's data is gone (its producer exited before it was "
            f"read, or its node died): {type(exc).__name__}"
        )

    # -- inspection ----------------------------------------------------------------------------
    def qsize(self, key: Any = None) -> int:
        """Items queued under ``key`` (all keys when None)."""
        return int(self._call("qsize", (key,), 0.0))

    def empty(self, key: Any = None) -> bool:
        """True when nothing is queued under ``key`` (or at all)."""
        return self.qsize(key) == 0

    def full(self) -> bool:
        """True when a bounded channel holds ``maxsize`` items."""
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def destroy(self) -> None:
        """Kill the channel's actor (queued items are dropped)."""
        self._lane.close()
        drop_presence(self._lane_address, self._presence_id)
        _created.pop(self.name, None)
        ray.kill(self._actor, no_restart=True)
        log.info("channel %s destroyed", self.name)


def _grace(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + _GRACE
