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

import httptools

# below uvicorn's 5 s: a pooled connection is dropped here before the server drops it
KEEPALIVE_S = 4.0
MAX_IDLE = 64  # idle connections kept per event loop
MAX_HEAD = 64 * 1024  # an answer's status line and headers
MAX_BODY = 64 * 1024 * 1024  # an answer's body, unless the Client is given another bound


class ProtocolError(ConnectionError):
    """The server's answer was not HTTP/1.1 this client understands."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: sends a request, parses the answer with httptools (llhttp)."""

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None
        self.open = True
        self.reusable = True
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._received = 0  # bytes of the current answer so far
        self._head = 0  # bytes of its status line and headers
        self._body: list[bytes] = []
        self._size = 0
        self._lengths: set[bytes] = set()
        self._chunked = False
        self._headers_done = False
        self._complete = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes, answer: asyncio.Future[tuple[int, bytes]]) -> None:
        """Write one request; ``answer`` gets (status, body)."""
        if self._parser is None:  # one parser for the connection's life: answers follow in order
            self._parser = httptools.HttpResponseParser(self)
        self._received = self._head = self._size = 0
        self._body = []
        self._lengths = set()
        self._chunked = self._headers_done = self._complete = False
        self.answer = answer
        assert self.transport is not None
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; the answer settles when the message completes."""
        if self.answer is None or self.answer.done() or self._parser is None:
            self.reusable = False  # bytes nobody asked for: this connection is out of step
            return
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except ProtocolError as exc:
            self._fail(exc)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, ProtocolError) else ProtocolError(str(exc)))
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(_describe(exc, data, self._head)))
        else:
            # llhttp keeps appending to a header line that never ends, so bound the raw bytes too
            if not self._headers_done and self._received > MAX_HEAD:
                self._fail(ProtocolError(f"the answer's head is over {MAX_HEAD} bytes"))

    # -- httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        """A second answer on one request's bytes is a stream out of step."""
        if self._complete:
            self.reusable = False
            raise ProtocolError("bytes after the answer")

    def on_status(self, status: bytes) -> None:
        """Count the status line against the head bound."""
        self._count_head(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        """Bound the head; note the framing headers (RFC 9112 refusals are decided on them)."""
        self._count_head(len(name) + len(value))
        if len(name) not in (14, 17):  # neither content-length nor transfer-encoding
            return
        lowered = name.lower()
        if lowered == b"content-length":
            self._lengths.update(v.strip() for v in value.split(b","))
        elif lowered == b"transfer-encoding":
            if value.strip().lower() != b"chunked" or self._chunked:
                raise ProtocolError(f"unsupported Transfer-Encoding: {value[:40]!r}")
            self._chunked = True

    def on_headers_complete(self) -> None:
        """Refuse ambiguous framing and over-size lengths before any body byte is kept."""
        if len(self._lengths) > 1:
            raise ProtocolError(f"conflicting Content-Length values: {sorted(self._lengths)}")
        if self._chunked and self._lengths:
            raise ProtocolError("an answer with both Transfer-Encoding and Content-Length")
        for value in self._lengths:
            if not value.isdigit() or len(value) > 18:
                raise ProtocolError(f"bad Content-Length: {value[:40]!r}")
            if int(value) > self.max_body:
                raise _too_big(self.max_body)
        assert self._parser is not None
        self.reusable = self.reusable and self._parser.should_keep_alive()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        """Keep the body, within its bound."""
        self._size += len(body)
        if self._size > self.max_body:
            raise _too_big(self.max_body)
        self._body.append(body)

    def on_message_complete(self) -> None:
        """Settle the answer; an interim 1xx answer is skipped (RFC 9110 §15.2)."""
        assert self._parser is not None and self.answer is not None
        if 100 <= self._parser.get_status_code() < 200:
            self._received = self._head = self._size = 0
            self._body, self._lengths = [], set()
            self._chunked = self._headers_done = False
            return
        self._complete = True
        if not self.answer.done():
            self.answer.set_result((self._parser.get_status_code(), b"".join(self._body)))

    # -- the connection's end ---------------------------------------------------------------
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
            stale = self._received == 0
            self.answer.set_exception(_Closed(stale, exc))

    def close(self) -> None:
        """Close the connection."""
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def _count_head(self, n: int) -> None:
        self._head += n
        if self._head > MAX_HEAD:
            raise ProtocolError(f"the answer's head is over {MAX_HEAD} bytes")

    def _fail(self, exc: ProtocolError) -> None:
        self.reusable = False
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)

    def _end_of_stream(self) -> None:
        """Settle an answer whose body runs to the end of the stream (no length, not chunked)."""
        framed = self._chunked or self._lengths
        if self.answer is None or self.answer.done() or not self._headers_done or framed:
            return
        assert self._parser is not None
        self.answer.set_result((self._parser.get_status_code(), b"".join(self._body)))


class _Closed(ConnectionError):
    """The connection closed before the answer was complete."""

    def __init__(self, stale: bool, cause: Exception | None) -> None:
        super().__init__(f"the server closed the connection{f': {cause}' if cause else ''}")
        self.stale = stale


def _describe(exc: Exception, data: bytes, head: int) -> str:
    """What was malformed, in the words a person reading the error needs."""
    if head == 0:
        first = data.split(b"\r\n", 1)[0][:80]
        return f"not an HTTP/1.1 status line: {first!r} ({exc})"
    if "content-length" in str(exc).lower():
        return f"bad Content-Length ({exc})"
    return f"malformed answer: {exc}"


def _too_big(limit: int) -> ProtocolError:
    return ProtocolError(f"the answer's body is over {limit} bytes")


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
