"""The lean HTTP/1.1 client against a raw asyncio server that answers exactly as each test scripts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from rollfleet.client import HttpStore
from rollfleet.client.wire import Client, ProtocolError
from rollfleet.errors import StoreUnavailable

pytestmark = pytest.mark.timeout(60)


@dataclass
class Scripted:
    """A TCP server on 127.0.0.1: each request's head (and body) is recorded, then ``answer`` replies."""

    answer: Callable[[asyncio.StreamWriter, int], None]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)
    received: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                self.received.set()
                self.answer(writer, len(self.requests))
                await writer.drain()
                if writer.is_closing():
                    return
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
        finally:
            writer.close()


Answer = Callable[[asyncio.StreamWriter, int], None]


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Answer], Awaitable[Scripted]]]:
    """Start scripted servers; they are stopped after the test."""
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> Scripted:
        s = Scripted(answer)
        server = await asyncio.start_server(s.serve, "127.0.0.1", 0)
        servers.append(server)
        s.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return s

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def ok(body: bytes) -> Callable[[asyncio.StreamWriter, int], None]:
    return lambda w, _n: w.write(
        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def test_sends_json_with_headers_and_reuses_the_connection(scripted) -> None:  # type: ignore[no-untyped-def]
    s = await scripted(ok(b'{"a":1}'))
    client = Client(s.url, {"authorization": "Bearer t"})
    for _ in range(3):
        assert await client.request("POST", "/x", b'{"q":2}', params=[("k", "a b")]) == (
            200,
            b'{"a":1}',
        )
    assert s.connections == 1
    first = s.requests[0]
    assert (
        first.startswith(b"POST /x?k=a+b HTTP/1.1\r\n") and b"authorization: Bearer t\r\n" in first
    )
    assert first.endswith(b'\r\n\r\n{"q":2}')
    client.close()


async def test_chunked_answers_arrive_whole(scripted) -> None:  # type: ignore[no-untyped-def]
    def chunked(w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"4\r\nabcd\r\n")  # the rest comes in later packets
        w.write(b"3;ext=1\r\nefg\r\n0\r\nX-Trailer: y\r\n\r\n")

    s = await scripted(chunked)
    client = Client(s.url, {})
    assert await client.request("GET", "/c") == (201, b"abcdefg")
    assert await client.request("GET", "/c") == (201, b"abcdefg")  # and the connection stays usable
    assert s.connections == 1
    client.close()


async def test_an_answer_without_length_is_read_to_the_end(scripted) -> None:  # type: ignore[no-untyped-def]
    def until_close(w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        w.close()

    s = await scripted(until_close)
    client = Client(s.url, {})
    assert await client.request("GET", "/e") == (200, b"all of it")
    assert await client.request("GET", "/e") == (200, b"all of it")
    assert s.connections == 2  # never reused after the end of stream
    client.close()


async def test_a_connection_the_server_closed_while_idle_is_replaced(scripted) -> None:  # type: ignore[no-untyped-def]
    def hang_up_on_the_second(w: asyncio.StreamWriter, n: int) -> None:
        if n == 2:  # the server's keep-alive timer fired as the request arrived: closed, unanswered
            w.close()
        else:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    s = await scripted(hang_up_on_the_second)
    client = Client(s.url, {})
    assert await client.request("POST", "/r", b"1") == (200, b"ok")
    assert await client.request("POST", "/r", b"2") == (
        200,
        b"ok",
    )  # sent again on a new connection
    assert [r[-1:] for r in s.requests] == [b"1", b"2", b"2"] and s.connections == 2
    client.close()


async def test_a_fresh_connection_closed_early_is_an_error_not_a_retry(scripted) -> None:  # type: ignore[no-untyped-def]
    s = await scripted(lambda w, _n: w.close())
    client = Client(s.url, {})
    with pytest.raises(ConnectionError, match="closed the connection"):
        await client.request("POST", "/claims", b"{}")
    assert (
        len(s.requests) == 1
    )  # a request on a new connection may have been acted on: never sent twice
    client.close()


async def test_cancelling_a_request_closes_its_connection(scripted) -> None:  # type: ignore[no-untyped-def]
    s = await scripted(lambda _w, _n: None)  # never answers: a long-poll
    client = Client(s.url, {})
    call = asyncio.create_task(client.request("POST", "/claims", b"{}"))
    await asyncio.wait_for(s.received.wait(), 10)  # the request is at the server, waiting
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(s.closed_by_client.wait(), 10)  # the server sees the caller go
    client.close()


async def test_a_timeout_raises_and_closes(scripted) -> None:  # type: ignore[no-untyped-def]
    s = await scripted(lambda _w, _n: None)
    client = Client(s.url, {})
    with pytest.raises(TimeoutError):
        await client.request("GET", "/slow", timeout=0.2)
    await asyncio.wait_for(s.closed_by_client.wait(), 10)
    client.close()


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n", "bad Content-Length"),
    ],
)
async def test_what_is_not_http_is_a_protocol_error_and_the_store_says_unavailable(  # type: ignore[no-untyped-def]
    scripted,
    answer: bytes,
    why: str,
) -> None:
    s = await scripted(lambda w, _n: w.write(answer))
    client = Client(s.url, {})
    with pytest.raises(ProtocolError, match=why):
        await client.request("GET", "/x")
    client.close()
    store = HttpStore(s.url, timeout=5)
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        await store.statistics()
    await store.close()


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="not an http"):
        Client("ftp://example.org", {})


def raw(first: bytes) -> Answer:
    """Answer the first request with ``first`` as it is, every later one with a good answer."""
    good = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    return lambda w, n: w.write(first if n == 1 else good)


MALFORMED = {
    "head over 64 KiB": b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * 70_000 + b"\r\n\r\n",
    "body over the bound": b"HTTP/1.1 200 OK\r\ncontent-length: 2000\r\n\r\n" + b"b" * 2000,
    "chunked body over the bound": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"7d0\r\n"
    + b"c" * 2000
    + b"\r\n0\r\n\r\n",
    "both transfer-encoding and content-length": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n"
    b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "conflicting content-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
    "a transfer-encoding that is not chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
    "a bad chunk size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhi\r\n0\r\n\r\n",
    "a chunk longer than its size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"2\r\nhello\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_malformed_or_oversized_answer_is_refused_and_its_connection_dropped(
    scripted: Callable[[Answer], Awaitable[Scripted]], case: str
) -> None:
    server = await scripted(raw(MALFORMED[case]))
    client = Client(server.url, {}, max_body=1000)
    with pytest.raises(ProtocolError):
        await client.request("GET", "/x")
    assert await client.request("GET", "/y") == (200, b"ok")
    assert server.connections == 2  # the broken connection was closed, not reused
    client.close()


async def test_bytes_left_after_an_answer_stop_the_connection_being_reused(
    scripted: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    smuggled = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nevil"
    server = await scripted(raw(smuggled))
    client = Client(server.url, {})
    assert await client.request("GET", "/x") == (200, b"ok")
    assert await client.request("GET", "/y") == (200, b"ok")  # not the smuggled "evil"
    assert server.connections == 2
    client.close()


async def test_one_endless_header_line_is_bounded(
    scripted: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    endless = b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * 200_000  # no line break, ever
    server = await scripted(raw(endless))
    client = Client(server.url, {})
    with pytest.raises(ProtocolError, match="head is over"):
        await client.request("GET", "/x")
    client.close()


async def test_an_interim_answer_is_skipped(
    scripted: Callable[[Answer], Awaitable[Scripted]],
) -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"
    server = await scripted(raw(early))
    client = Client(server.url, {})
    assert await client.request("GET", "/x") == (200, b"hi")
    assert await client.request("GET", "/y") == (200, b"ok")
    assert server.connections == 1  # the connection stayed in step and was reused
    client.close()
