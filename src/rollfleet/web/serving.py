"""Serving helpers for every uvicorn server rollfleet starts (control plane, gateway, pools).

One bearer-token check (constant-time), one bind rule (no open non-loopback port), one free-port
finder and one HTTP protocol with Nagle's algorithm off, a bounded request head and each answer's
head and body in one write (:class:`HeadWithBody`), configured from a
:class:`~rollfleet.web.guard.GuardConfig` by :func:`uvicorn_options`; and the connection limit a
server can hold: :func:`raise_fd_limit` and :func:`connection_limit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import quote

import orjson
from starlette.requests import Request

from rollfleet.errors import InvalidInput, StoreUnavailable, Unauthorized
from rollfleet.web.guard import GuardConfig

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# open files a server keeps for itself besides its clients' connections: database pool, LISTEN,
# election, logs, hosted pools' sandboxes, a gateway's engine connections
FD_HEADROOM = 1024
# a held long-poll costs a replica ~20 KiB (docs/scale.md): 16,384 of them ~320 MiB
DEFAULT_MAX_CONNECTIONS = 16_384
OVER_LIMIT = "Exceeded concurrency limit."


def token_matches(authorization: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (always true without a token).

    The comparison takes the same time wherever the first wrong byte is: a ``!=`` would let a
    caller find the token a byte at a time from response times.
    """
    if token is None:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())


def bearer_check(token: str | None, what: str = "") -> Callable[[Request], Awaitable[None]]:
    """An async check (a FastAPI dependency) raising :class:`Unauthorized` without the right token.

    It is ``async`` on purpose: FastAPI runs a plain function dependency on a worker thread, and
    that hop cost ~0.8 ms on every request.
    """
    prefix = f"{what}: " if what else ""

    async def check(request: Request) -> None:
        if not token_matches(request.headers.get("authorization"), token):
            raise Unauthorized(f"{prefix}missing or wrong bearer token")

    return check


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback address without a bearer token."""
    if host not in LOOPBACK and not token:
        raise StoreUnavailable(
            f"refusing to serve on {host} without a token: pass --token or set ROLLFLEET_TOKEN "
            "(loopback addresses need none)"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def nodelay_http_protocol(
    header_timeout_s: float | None = None, max_head: int | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with Nagle's algorithm off and, when given, a bounded request head.

    uvicorn writes a response's head and body separately; with Nagle on (uvloop, or a
    listening socket made without IPPROTO_TCP) the body waits for the client's delayed ACK,
    which adds ~40 ms to every call. Measured in bench/engines.py. Each answer's head also waits
    for its body (:class:`HeadWithBody`): one ``send`` instead of two.

    uvicorn bounds neither the time nor the size of a request head: 2,000 half-sent requests
    held their connections until the clients gave up, and one endless header line grew without
    end. A connection gets ``header_timeout_s`` to send a whole head (counted from connecting,
    then from the first byte of each further request; the idle time between requests is
    uvicorn's keep-alive timeout) and ``max_head`` bytes for it; past either it is answered 408
    or 431 and closed (closed silently if it sent nothing).
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHTTP(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _in_head = False  # between the first byte of a request and the end of its head
        _begun_here = False  # a request began in the read being parsed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            self._begun_here = False
            super().data_received(data)
            # the read that begins a head may end another request: only later reads count, so
            # a head holds at most max_head bytes plus one read
            if self._in_head and not self._begun_here and max_head is not None:
                self._head_bytes += len(data)
                if self._head_bytes > max_head:
                    self._refuse(431, f"request head over {max_head} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._begun_here, self._head_bytes = True, True, 0
            if self._head_timer is None:
                self._arm_head_timer()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm_head_timer()
            super().on_headers_complete()
            cycle = self.cycle  # this request's answer: its head and body in one send
            if cycle is not None and cycle.transport is self.transport:
                cycle.transport = cast(asyncio.Transport, HeadWithBody(self.transport, self.loop))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if header_timeout_s is not None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm_head_timer()  # a pipelined head waits while an answer is under way
            elif not self._in_head:
                self.transport.close()  # connected and sent nothing
            else:
                self._refuse(408, f"request head not complete within {header_timeout_s} s")

        def _refuse(self, status: int, message: str) -> None:
            if self.transport.is_closing():
                return
            self._disarm_head_timer()
            body = orjson.dumps({"error": "InvalidInput", "message": message})
            reason = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
            self.transport.write(
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )
            self.transport.close()

    return GuardedHTTP


class HeadWithBody:
    """One response's view of its connection: the response head waits for the body's first
    write, and both go out in one ``send``.

    uvicorn writes a head and its body separately: two system calls and, with Nagle's algorithm
    off, two TCP segments for every answer. A head is never held past the loop turn it was
    written in (a streamed body's first chunk may come later), nor past a ``close``; an
    informational head (``100 Continue``) goes out at once.
    """

    __slots__ = ("_transport", "_loop", "_head", "_sent")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._sent = False  # the head has been written: everything else goes straight out

    def write(self, data: bytes) -> None:
        """Hold the response head; write it with the next bytes, or write straight through."""
        if self._head is not None:
            data, self._head = self._head + data, None
        elif not self._sent and not data.startswith(b"HTTP/1.1 1"):
            self._head, self._sent = data, True
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        """Write a head still held (its body did not follow in the same turn), unless the
        connection has gone meanwhile."""
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        """Write what is held, then close the connection."""
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's open-file soft limit to its hard limit; ``(before, after)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:  # (macOS refuses an unlimited soft limit: it then stays as it was)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limit(requested: int | None, fd_limit: int) -> int:
    """The connections a server with ``fd_limit`` open files may hold: ``requested``, or
    :data:`DEFAULT_MAX_CONNECTIONS` where the limit allows; refuses what the limit cannot hold."""
    most = fd_limit - FD_HEADROOM
    if requested is None:
        if most < 64:
            raise InvalidInput(
                f"the open-file limit is {fd_limit}: too few to serve; raise it (ulimit -n)"
            )
        return min(DEFAULT_MAX_CONNECTIONS, most)
    if requested < 1:
        raise InvalidInput(f"--max-connections {requested}: give at least 1")
    if requested > most:
        raise InvalidInput(
            f"--max-connections {requested}: the open-file limit is {fd_limit}, so at most "
            f"{max(most, 0)} connections fit ({FD_HEADROOM} files kept for the server itself); "
            "raise the hard limit (ulimit -Hn, LimitNOFILE=) or ask for fewer"
        )
    return requested


class OverLimitLogFilter(logging.Filter):
    """Lets through uvicorn's "over the connection limit" warning at most once per ``every_s``,
    counting the refusals in between (one line per refused request cost the server CPU when
    thousands of runners were refused)."""

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = -float("inf")
        self._quiet = 0

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to log ``record``: any other record, or the first refusal of a period."""
        if record.getMessage() != OVER_LIMIT:
            return True
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._quiet += 1
            return False
        if self._quiet:
            record.msg = (
                f"{OVER_LIMIT} ({self._quiet} more refused in the last {now - self._last:.0f} s)"
            )
            record.args = ()
        self._last, self._quiet = now, 0
        return True


def _quiet_over_limit_log() -> None:
    """Install :class:`OverLimitLogFilter` on uvicorn's error logger once."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, OverLimitLogFilter) for f in logger.filters):
        logger.addFilter(OverLimitLogFilter())


def uvicorn_options(guard: GuardConfig) -> dict[str, Any]:
    """The ``uvicorn.Config`` settings for ``guard``'s connection limits (and Nagle off)."""
    _quiet_over_limit_log()
    return {
        "http": nodelay_http_protocol(guard.header_timeout_s, guard.max_head),
        "timeout_keep_alive": guard.keep_alive_s,
        "limit_concurrency": guard.limit_concurrency,
    }


def segment(value: str) -> str:
    """``value`` as one URL path segment: every reserved or control character percent-encoded.

    Clients build every path that holds an id with this, so an id can never end the path, start
    a query, or (with a CR/LF) end the request line and smuggle a second request.
    """
    return quote(value, safe="")
