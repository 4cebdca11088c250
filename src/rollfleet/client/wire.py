"""A lean HTTP/1.1 client for the control plane's JSON API: pooled keep-alive connections, nothing
else, with every size bounded.

Every runner calls the control plane a few times per rollout, so this is every runner's hot path.
A general client's per-request machinery (aiohttp's cookie jar, tracing hooks, header multidicts,
redirect and proxy handling) is CPU the runner's agent does not get: on the store benchmark's
claim+complete loop, 96–109 µs of client CPU a rollout with aiohttp against 62–71 µs with this
client (docs/store.md). It writes the request in one ``send`` and parses the answer in
``data_received``: status line, headers, ``Content-Length`` or chunked bodies. HTTPS works
through asyncio's TLS transport.

A malformed or over-size answer (a head over 64 KiB, a body over ``max_body``, both
Transfer-Encoding and Content-Length, conflicting lengths, bytes left over after an answer) is a
:class:`ProtocolError` and its connection is closed, never reused: a broken or hostile server costs
the caller one clear error, not unbounded memory or a desynchronised stream.

A connection is reused while the server keeps it open; a reused one that the server had already
closed as idle (end of stream before a single byte of the answer) is replaced and the request sent
again: the server never read it. Cancelling a request closes its connection, so the server sees
the caller go (a long-poll claim then leases nothing).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlencode, urlsplit

# below uvicorn's 5 s: a pooled connection is dropped here before the server drops it
KEEPALIVE_S = 4.0
MAX_IDLE = 64  # idle connections kept per event loop
MAX_HEAD = 64 * 1024  # an answer's status line and headers
MAX_BODY = 64 * 1024 * 1024  # an answer's body, unless the Client is given another bound


class ProtocolError(ConnectionError):
    """The server's answer was not HTTP/1.1 this client understands."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: sends a request, collects the answer."""

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.open = True
        self.reusable = True
        self.idle_since = 0.0
        # status, body start, length (-1 chunked, -2 to EOF)
        self._head: tuple[int, int, int, bool] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes, answer: asyncio.Future[tuple[int, bytes]]) -> None:
        """Write one request; ``answer`` gets (status, body)."""
        self.buf.clear()
        self._head = None
        self.answer = answer
        assert self.transport is not None
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        """Collect bytes; settle the answer once the body is complete."""
        self.buf += data
        if self.answer is None or self.answer.done():
            self.reusable = False  # bytes nobody asked for: this connection is out of step
            return
        try:
            done = self._parse()
        except ProtocolError as exc:
            self.reusable = False
            self.answer.set_exception(exc)
            return
        if done is not None:
            self.answer.set_result(done)

    def eof_received(self) -> bool:
        """The server ended the stream: an answer read to end of stream is complete now."""
        self.reusable = False
        self._end_of_stream()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Fail an unfinished answer; the connection is never reused."""
        self.open = False
        self._end_of_stream()  # TLS transports may report the end only here
        if self.answer is not None and not self.answer.done():
            # not one byte of an answer: the server closed it before reading the request
            stale = not self.buf
            self.answer.set_exception(_Closed(stale, exc))

    def close(self) -> None:
        """Close the connection."""
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def _end_of_stream(self) -> None:
        """Settle an answer whose body runs to the end of the stream (no length, not chunked)."""
        if (
            self.answer is not None
            and not self.answer.done()
            and self._head is not None
            and self._head[2] == -2
        ):
            status, start, _length, _close = self._head
            if len(self.buf) - start > self.max_body:
                self.answer.set_exception(_too_big(self.max_body))
                return
            self.answer.set_result((status, bytes(self.buf[start:])))

    def _parse(self) -> tuple[int, bytes] | None:
        if self._head is None:
            end = self.buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    raise ProtocolError(f"the answer's head is over {MAX_HEAD} bytes")
                return None
            self._head = _parse_head(bytes(self.buf[:end]), end + 4)
            self.reusable = self.reusable and not self._head[3]
        status, start, length, _close = self._head
        if length > self.max_body or len(self.buf) - start > self.max_body + 64 * 1024:
            raise _too_big(self.max_body)
        if length >= 0:
            if len(self.buf) - start < length:
                return None
            if len(self.buf) - start > length:  # bytes after the answer: never reuse this one
                self.reusable = False
            return status, bytes(self.buf[start : start + length])
        if length == -1:
            body = _dechunk(self.buf, start, self.max_body)
            if body is not None and body[1] < len(self.buf):
                self.reusable = False
            return None if body is None else (status, body[0])
        return None  # read to end of stream


class _Closed(ConnectionError):
    """The connection closed before the answer was complete."""

    def __init__(self, stale: bool, cause: Exception | None) -> None:
        super().__init__(f"the server closed the connection{f': {cause}' if cause else ''}")
        self.stale = stale


def _too_big(limit: int) -> ProtocolError:
    return ProtocolError(f"the answer's body is over {limit} bytes")


def _parse_head(head: bytes, body_start: int) -> tuple[int, int, int, bool]:
    """(status, body start, length: -1 chunked, -2 to end of stream, close after) of a head.

    Refused per RFC 9112: a Content-Length that is not one number (or several that differ), a
    Transfer-Encoding other than chunked, and both headers at once (a request-smuggling shape).
    """
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    status = int(parts[1])
    close = parts[0] == b"HTTP/1.0"
    lengths: set[int] = set()
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name == b"content-length":
            for item in value.split(b","):
                if not item.strip().isdigit() or len(item.strip()) > 18:
                    raise ProtocolError(f"bad Content-Length: {value[:40]!r}")
                lengths.add(int(item.strip()))
        elif name == b"transfer-encoding":
            if value.lower() != b"chunked" or chunked:
                raise ProtocolError(f"unsupported Transfer-Encoding: {value[:40]!r}")
            chunked = True
        elif name == b"connection":
            close = value.lower() == b"close"
    if len(lengths) > 1:
        raise ProtocolError(f"conflicting Content-Length values: {sorted(lengths)}")
    if chunked and lengths:
        raise ProtocolError("an answer with both Transfer-Encoding and Content-Length")
    length = -1 if chunked else (lengths.pop() if lengths else -2)
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    return status, body_start, length, close or length == -2


def _dechunk(buf: bytearray, pos: int, limit: int) -> tuple[bytes, int] | None:
    """The body of a complete chunked message starting at ``pos`` and where the message ends, or
    None if more is to come; a body over ``limit`` bytes is refused."""
    body = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos, pos + 1024)
        if eol < 0:
            if len(buf) - pos > 1024:
                raise ProtocolError("a chunk-size line over 1 KiB in a chunked answer")
            return None
        field = bytes(buf[pos:eol]).split(b";")[0].strip()
        if not field or len(field) > 15 or any(c not in b"0123456789abcdefABCDEF" for c in field):
            raise ProtocolError("bad chunk size in a chunked answer")
        size = int(field, 16)
        if len(body) + size > limit:
            raise _too_big(limit)
        if size == 0:  # the message ends after the trailers, if any
            end = buf.find(b"\r\n\r\n", eol)
            return None if end < 0 else (bytes(body), end + 4)
        start, end = eol + 2, eol + 2 + size
        if len(buf) < end + 2:
            return None
        if buf[end : end + 2] != b"\r\n":
            raise ProtocolError("a chunk longer than its size in a chunked answer")
        body += buf[start:end]
        pos = end + 2


class Client:
    """Pooled keep-alive HTTP/1.1 connections to one server, per event loop."""

    def __init__(self, base_url: str, headers: dict[str, str], max_body: int = MAX_BODY) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        default_port = self.port == (443 if self.ssl else 80)
        fixed = {"host": self.host if default_port else f"{self.host}:{self.port}", **headers}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode()
        self._idle: dict[asyncio.AbstractEventLoop, list[_Connection]] = {}
        self.max_body = max_body

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        params: list[tuple[str, str]] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, bytes]:
        """Send one request and return (status, body); raises OSError/ConnectionError or
        TimeoutError."""
        target = self.prefix + path + ("?" + urlencode(params) if params else "")
        data = b"".join(
            (
                f"{method} {target} HTTP/1.1\r\n".encode(),
                self._fixed,
                b"content-length: %d\r\n\r\n" % (len(body) if body else 0),
                body or b"",
            )
        )
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while True:
                conn, reused = await self._acquire(loop)
                answer: asyncio.Future[tuple[int, bytes]] = loop.create_future()
                conn.send(data, answer)
                try:
                    result = await answer
                except _Closed as exc:
                    if (
                        reused and exc.stale
                    ):  # closed as idle by the server before it read this request
                        continue
                    raise
                except BaseException:  # cancelled or timed out: the server must see the caller go
                    conn.close()
                    raise
                self._release(loop, conn)
                return result

    async def _acquire(self, loop: asyncio.AbstractEventLoop) -> tuple[_Connection, bool]:
        idle = self._idle.get(loop)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.open and now - conn.idle_since < KEEPALIVE_S:
                return conn, True
            conn.close()
        _transport, conn = await loop.create_connection(
            lambda: _Connection(self.max_body), self.host, self.port, ssl=self.ssl
        )
        return conn, False

    def _release(self, loop: asyncio.AbstractEventLoop, conn: _Connection) -> None:
        idle = self._idle.setdefault(loop, [])
        if conn.open and conn.reusable and len(idle) < MAX_IDLE:
            conn.answer = None
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every pooled connection (each on its own loop's thread)."""
        pools, self._idle = self._idle, {}
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, conns in pools.items():
            if loop.is_closed():
                continue
            for conn in conns:
                if loop is here:
                    conn.close()
                else:
                    loop.call_soon_threadsafe(conn.close)
