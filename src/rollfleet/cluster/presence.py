"""Presence connections: one open lane connection per channel actor and client process.

A get made by Ray call names its process's presence id; the channel's actor ends such gets
when that connection closes (the process died), so a dead consumer takes nothing.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
import uuid

from rollfleet.cluster.lane import LaneAddress, encode, frame

log = logging.getLogger("rollfleet.cluster")

_presences: dict[LaneAddress, tuple[str, socket.socket]] = {}
_presences_lock = threading.Lock()


def open_presence(address: LaneAddress) -> str | None:
    """This process's presence id at a channel actor: a lane connection that only stays open,
    so that the actor ends this process's waiting Ray-call gets when it dies (None: the actor
    cannot be reached that way; gets then work as before, without that guard)."""
    with _presences_lock:
        held = _presences.get(address)
        if held is not None:
            return held[0]
        host, port, token = address
        presence = uuid.uuid4().hex
        try:
            sock = socket.create_connection((host, port), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.sendall(frame(token))
            for piece in encode(("presence", (presence,))):
                sock.sendall(piece)
        except OSError as exc:
            log.warning("channel at %s:%s: no presence connection (%s)", host, port, exc)
            return None
        _presences[address] = (presence, sock)  # open until this process exits
        return presence


@atexit.register
def close_presences() -> None:
    """Close this process's presence connections (its exit would; this says it first)."""
    with _presences_lock:
        for _, sock in _presences.values():
            sock.close()
        _presences.clear()


def drop_presence(address: LaneAddress, presence: str | None) -> None:
    """Forget a presence the actor saw close (the next get opens a new one)."""
    with _presences_lock:
        held = _presences.get(address)
        if held is not None and held[0] == presence:
            del _presences[address]
            held[1].close()


def presence_id(address: LaneAddress) -> str | None:
    """This process's presence id at the channel actor at ``address``, if one is open."""
    held = _presences.get(address)
    return None if held is None else held[0]
