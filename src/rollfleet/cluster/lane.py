"""The channel lane: a direct TCP connection from a client process to its channel's actor.

Small items and control requests take it instead of a Ray actor call, which costs several
times more per message. The first frame of a connection is the channel's secret token (handed
out over Ray's own authenticated calls); then each message is a count and sizes, a pickle
(protocol 5) and its out-of-band buffers, so big payloads are never copied into the pickle.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import Any

from rollfleet.errors import ClusterError, ClusterTimeout

LaneAddress = tuple[str, int, bytes]


def frame(data: bytes) -> bytes:
    """``data`` with its length in front."""
    return len(data).to_bytes(4, "little") + data


OOB_MIN = 64 * 1024  # payloads at least this big travel as out-of-band buffers


def out_of_band(data: Any) -> Any:
    """``data`` marked to travel beside the pickle rather than inside it, when it is big."""
    return pickle.PickleBuffer(data) if isinstance(data, bytes) and len(data) >= OOB_MIN else data


def encode(message: Any) -> list[Any]:
    """The pieces to send for ``message``: sizes + pickle, then each out-of-band buffer."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = (len(head), *(r.nbytes for r in raws))
    return [struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes) + head, *raws]


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message from ``reader`` (its buffers arrive as bytes, used without a copy)."""
    (count,) = struct.unpack("<I", await reader.readexactly(4))
    sizes = struct.unpack(f"<{count}Q", await reader.readexactly(8 * count))
    head = await reader.readexactly(sizes[0])
    buffers = [await reader.readexactly(size) for size in sizes[1:]]
    return pickle.loads(head, buffers=buffers)


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    """The next frame's body (ConnectionError when it is longer than ``limit``)."""
    size = int.from_bytes(await reader.readexactly(4), "little")
    if limit is not None and size > limit:
        raise ConnectionError(f"frame of {size} bytes, at most {limit} expected")
    return await reader.readexactly(size)


class Lane:
    """One blocking connection per thread to a channel's actor."""

    def __init__(self, address: LaneAddress, label: str) -> None:
        self._address = address
        self._label = label
        self._local = threading.local()

    def _socket(self) -> socket.socket:
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is None:
            host, port, token = self._address
            try:
                sock = socket.create_connection((host, port), timeout=30)
            except OSError as exc:
                raise ClusterError(
                    f"{self._label}: cannot reach the channel at {host}:{port}: {exc}"
                ) from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.sendall(frame(token))
            self._local.sock = sock
        return sock

    def call(self, op: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        """Send one request and wait (up to ``timeout``) for its answer."""
        sock = self._socket()
        try:
            sock.settimeout(timeout)
            for piece in encode((op, args)):
                sock.sendall(piece)
            (count,) = struct.unpack("<I", self._read(sock, 4))
            sizes = struct.unpack(f"<{count}Q", self._read(sock, 8 * count))
            head = self._read(sock, sizes[0])
            return pickle.loads(head, buffers=[self._read(sock, size) for size in sizes[1:]])
        except TimeoutError as exc:
            self.close()
            raise ClusterTimeout(
                f"{self._label}: the channel did not answer within {timeout}s"
            ) from exc
        except OSError as exc:
            self.close()
            raise ClusterError(f"{self._label}: lost the channel (its actor died?): {exc}") from exc

    @staticmethod
    def _read(sock: socket.socket, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionResetError("channel closed the connection")
            got += n
        return buffer

    def close(self) -> None:
        """Drop this thread's connection (a later call reconnects)."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None


_lanes: dict[LaneAddress, Lane] = {}
_lanes_lock = threading.Lock()


def shared_lane(address: LaneAddress, label: str) -> Lane:
    """The process-wide lane to ``address``: every handle on a channel shares its connections."""
    with _lanes_lock:
        lane = _lanes.get(address)
        if lane is None:
            lane = _lanes[address] = Lane(address, label)
        return lane
