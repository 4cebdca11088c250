"""No request breaks the server: body caps, cross-site refusals, Host checks and slow clients.

Against real servers on loopback ports (the control plane with ``rollfleet serve``'s parts, the
gateway over the echo engine, the pool service), with raw sockets wherever a client library would
not send what an attacker sends. Nothing here sleeps to synchronise: every wait is a read (or a
``select``) with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from support import free_port

from rollfleet.compose import control_plane_parts
from rollfleet.engines.echo import EchoEngine
from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.pool.leases import PoolRegistry
from rollfleet.pool.pool import Pool
from rollfleet.pool.providers.memory import MemoryProvider
from rollfleet.pool.service import pool_app
from rollfleet.server.embedded import ServerThread
from rollfleet.web.guard import GuardConfig
from rollfleet.web.serving import uvicorn_options

HEADER_TIMEOUT_S = 2.0
CAP = 1024 * 1024  # a small body cap, so a chunked body passes it quickly
GUARD = GuardConfig(max_body=CAP, header_timeout_s=HEADER_TIMEOUT_S, keep_alive_s=1.0)
JSON = {"content-type": "application/json"}
BATCH = orjson.dumps({"items": [{"input": {"q": 1}}]})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(
        f"sqlite:///{tmp_path}/guard.db", parts=control_plane_parts(), guard=GUARD
    ) as srv:
        yield srv


def connect(port: int) -> socket.socket:
    """A raw TCP connection to the server on ``port``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_answer(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer read off ``sock``: status, headers (lower-case names) and body."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closes ``sock`` (end of stream) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def head(method: str, path: str, port: int, *extra: str) -> bytes:
    """A request head for ``path`` on loopback port ``port`` with ``extra`` header lines."""
    lines = [f"{method} {path} HTTP/1.1", f"host: 127.0.0.1:{port}", *extra, "", ""]
    return "\r\n".join(lines).encode()


def api_error(status: int, body: bytes, expected: int, name: str) -> None:
    """An answer with ``expected`` status in the API's one error shape, named ``name``."""
    assert status == expected, body
    data = orjson.loads(body)
    assert data["error"] == name and data["message"], data


def total_rollouts(server: ServerThread) -> int:
    """How many rollouts the control plane holds."""
    return int(httpx.get(f"{server.url}/statistics", timeout=10).json()["total_rollouts"])


# --- request bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/rollouts", "/rollouts/batch", "/claims"])
def test_a_declared_body_over_the_cap_is_refused_before_it_is_read(
    server: ServerThread, path: str
) -> None:
    with connect(server.port) as sock:
        # 300 MiB announced, not one byte of it sent: the answer can only come before reading it
        sock.sendall(
            head(
                "POST",
                path,
                server.port,
                "content-type: application/json",
                f"content-length: {300 * 1024 * 1024}",
            )
        )
        status, headers, body = read_answer(sock)
        api_error(status, body, 413, "InvalidInput")
        assert headers["connection"] == "close"
        assert closed_by_server(sock)
    assert total_rollouts(server) == 0


def send_chunked_until_answered(sock: socket.socket, total: int) -> None:
    """Send a chunked body of up to ``total`` bytes, stopping as soon as an answer is readable."""
    chunk = b"[" + b" " * (64 * 1024 - 2) + b"]"
    sent = 0
    while sent < total:
        if select.select([sock], [], [], 0)[0]:
            return
        try:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            return
        sent += len(chunk)
    select.select([sock], [], [], 10)


@pytest.mark.parametrize("path", ["/rollouts", "/rollouts/batch"])
def test_a_chunked_body_is_counted_as_it_streams(server: ServerThread, path: str) -> None:
    with connect(server.port) as sock:
        sock.sendall(
            head(
                "POST",
                path,
                server.port,
                "content-type: application/json",
                "transfer-encoding: chunked",
            )
        )
        send_chunked_until_answered(sock, 4 * CAP)
        status, headers, body = read_answer(sock)
        api_error(status, body, 413, "InvalidInput")
        assert headers["connection"] == "close"
    assert total_rollouts(server) == 0


def test_a_chunked_body_under_the_cap_is_served(server: ServerThread) -> None:
    with connect(server.port) as sock:
        sock.sendall(
            head(
                "POST",
                "/rollouts/batch",
                server.port,
                "content-type: application/json",
                "transfer-encoding: chunked",
            )
        )
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(BATCH), BATCH))
        status, _, body = read_answer(sock)
        assert status == 200, body
    assert total_rollouts(server) == 1


# --- cross-site requests and the Host header --------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://evil.example"},
        {"origin": "null"},
        {"origin": "http://127.0.0.1:1"},  # another port on this machine is another origin
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
    ],
)
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rollouts/batch", BATCH),  # a hot route, served ahead of FastAPI
        ("/rollouts", orjson.dumps({"input": {}})),
        ("/dashboard/api/batches/b1/abort", b'{"reason": "x"}'),  # a dashboard action
    ],
)
def test_a_cross_site_request_is_refused(
    server: ServerThread, headers: dict[str, str], path: str, body: bytes
) -> None:
    answer = httpx.post(server.url + path, content=body, headers={**JSON, **headers}, timeout=10)
    api_error(answer.status_code, answer.content, 403, "Unauthorized")
    assert total_rollouts(server) == 0


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
@pytest.mark.parametrize(
    "path", ["/rollouts/batch", "/claims", "/rollouts", "/dashboard/api/batches/b1/abort"]
)
def test_a_state_changing_body_must_be_json(
    server: ServerThread, content_type: str | None, path: str
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    answer = httpx.post(server.url + path, content=BATCH, headers=headers, timeout=10)
    api_error(answer.status_code, answer.content, 415, "InvalidInput")
    assert total_rollouts(server) == 0


def test_same_origin_and_plain_clients_are_served(server: ServerThread) -> None:
    same_origin = {"origin": server.url, "sec-fetch-site": "same-origin"}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        # the dashboard's own page: same origin, JSON, with a charset parameter
        ok = http.post(
            "/rollouts/batch",
            content=BATCH,
            headers={**same_origin, "content-type": "application/json; charset=utf-8"},
        )
        assert ok.status_code == 200, ok.text
        rollout_id = ok.json()[0]["rollout_id"]
        # a body-less POST (the dashboard's cancel button) needs no content type
        cancelled = http.post(f"/rollouts/{rollout_id}/cancel", headers=same_origin)
        assert cancelled.status_code == 200, cancelled.text
        # the user typed the URL (no Origin, Sec-Fetch-Site: none)
        assert http.get("/statistics", headers={"sec-fetch-site": "none"}).status_code == 200
        # a foreign page may send a GET (it cannot read the answer without CORS)
        assert http.get("/statistics", headers={"origin": "http://evil.example"}).status_code == 200


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:{port}",
        "127.0.0.1.evil.example",
        "localhost:{port}@evil.example",
        "10.0.0.1:{port}",
    ],
)
@pytest.mark.parametrize(("method", "path"), [("GET", "/statistics"), ("POST", "/claims")])
def test_a_foreign_host_is_refused_on_loopback(
    server: ServerThread, host: str, method: str, path: str
) -> None:
    with connect(server.port) as sock:
        body = b'{"worker_id": "w"}'
        request = (
            f"{method} {path} HTTP/1.1\r\nhost: {host.format(port=server.port)}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(request + body)
        status, _, answer = read_answer(sock)
        api_error(status, answer, 421, "InvalidInput")


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:{port}",
        "127.0.0.1",
        "127.0.0.1:{port}",
        "[::1]",
        "[::1]:{port}",
        "LOCALHOST:{port}",
    ],
)
def test_loopback_host_names_are_served(server: ServerThread, host: str) -> None:
    answer = httpx.get(
        f"{server.url}/statistics", headers={"host": host.format(port=server.port)}, timeout=10
    )
    assert answer.status_code == 200, answer.text


# --- slow clients -------------------------------------------------------------------------------


def test_half_sent_requests_are_closed_and_others_are_served(server: ServerThread) -> None:
    slow: list[socket.socket] = []
    try:
        opened = time.monotonic()
        for i in range(200):
            sock = connect(server.port)
            if i % 2:  # half send a head; the other half send nothing at all
                sock.sendall(b"GET /statistics HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
            slow.append(sock)
        answer = httpx.get(f"{server.url}/statistics", timeout=HEADER_TIMEOUT_S)
        assert answer.status_code == 200
        if time.monotonic() - opened < HEADER_TIMEOUT_S:  # held until now, then closed
            assert not select.select(slow, [], [], 0)[0]
        for sock in slow:
            assert closed_or_timed_out(sock, HEADER_TIMEOUT_S + 10)
        assert time.monotonic() - opened >= HEADER_TIMEOUT_S
    finally:
        for sock in slow:
            sock.close()


def closed_or_timed_out(sock: socket.socket, timeout: float) -> bool:
    """Whether the server ends ``sock``: end of stream, perhaps after a 408 answer."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data == b"" or data.startswith(b"HTTP/1.1 408 ")


def test_a_head_that_never_ends_is_refused(server: ServerThread) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /statistics HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(64):  # 4 MiB of one header line, within the header timeout
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(b"a" * 65536)
        status, _, body = read_answer(sock)
        api_error(status, body, 431, "InvalidInput")
        assert closed_by_server(sock)


def test_a_long_poll_outlives_the_header_timeout(server: ServerThread) -> None:
    wait_s = HEADER_TIMEOUT_S + 1
    body = {"worker_id": "w", "wait_s": wait_s}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        started = time.monotonic()
        answer = http.post("/claims", json=body)
        assert answer.status_code == 200 and answer.json() == []
        assert time.monotonic() - started >= wait_s - 0.5


def test_an_idle_keep_alive_connection_is_closed(server: ServerThread) -> None:
    with connect(server.port) as sock:
        sock.sendall(head("GET", "/statistics", server.port))
        assert read_answer(sock)[0] == 200
        answered = time.monotonic()
        assert closed_by_server(sock, timeout=GUARD.keep_alive_s + 10)
        assert time.monotonic() - answered >= GUARD.keep_alive_s - 0.1


# --- the gateway and the pool service -----------------------------------------------------------


@contextlib.asynccontextmanager
async def gateway_url() -> AsyncIterator[str]:
    """The standalone gateway over the echo engine, served on a loopback port."""
    engine = EchoEngine()
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine)
    try:
        async with running_gateway(gateway) as url:
            yield url
    finally:
        await gateway.close()


@contextlib.asynccontextmanager
async def pool_url() -> AsyncIterator[str]:
    """The pool service over a one-instance memory pool, served on a loopback port."""
    registry = PoolRegistry([(Pool(MemoryProvider(), 1, name="m"), 30.0)])
    port = free_port()
    config = uvicorn.Config(
        pool_app(registry),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
        **uvicorn_options(GuardConfig()),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn has no event
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


SERVERS = {"gateway": (gateway_url, "/v1/chat/completions"), "pool": (pool_url, "/pools/m/leases")}


@pytest.mark.parametrize("which", sorted(SERVERS))
async def test_the_gateway_and_the_pool_service_are_guarded(which: str) -> None:
    serving, path = SERVERS[which]
    async with serving() as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        huge = {**JSON, "content-length": str(300 * 1024 * 1024)}
        port = int(url.rsplit(":", 1)[1])
        status, _, body = await asyncio.to_thread(declared, port, path, huge)
        api_error(status, body, 413, "InvalidInput")
        plain = await http.post(path, content=b"{}", headers={"content-type": "text/plain"})
        api_error(plain.status_code, plain.content, 415, "InvalidInput")
        foreign = await http.post(path, json={}, headers={"origin": "http://evil.example"})
        api_error(foreign.status_code, foreign.content, 403, "Unauthorized")
        rebound = await http.get(path, headers={"host": "evil.example"})
        api_error(rebound.status_code, rebound.content, 421, "InvalidInput")


def declared(port: int, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """The answer to a POST head with ``headers`` and no body sent."""
    with connect(port) as sock:
        sock.sendall(head("POST", path, port, *(f"{k}: {v}" for k, v in headers.items())))
        return read_answer(sock)
