"""A control plane over its connection limit answers 503 at once, and runners back off."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from rollfleet.client import HttpStore
from rollfleet.client.endpoints import Backoff
from rollfleet.errors import InvalidInput
from rollfleet.model import RolloutSpec, RolloutStatus
from rollfleet.runner.runner import Runner
from rollfleet.web.serving import (
    DEFAULT_MAX_CONNECTIONS,
    FD_HEADROOM,
    connection_limit,
    free_port,
)

pytestmark = pytest.mark.timeout(120)
SERVE = [sys.executable, "-m", "rollfleet.cli", "serve"]
CLAIM = b"POST /claims "


def test_the_default_limit_fits_the_open_file_limit() -> None:
    assert connection_limit(None, 1 << 20) == DEFAULT_MAX_CONNECTIONS
    assert connection_limit(None, 4096) == 4096 - FD_HEADROOM
    assert connection_limit(100, 4096) == 100
    with pytest.raises(InvalidInput, match="the open-file limit is 4096"):
        connection_limit(4096 - FD_HEADROOM + 1, 4096)


def test_backoff_doubles_to_its_cap_with_full_jitter_and_resets() -> None:
    top = Backoff(rng=lambda: 1.0)  # the top of every jitter range
    assert [top.delay() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    top.reset()
    assert top.delay() == 0.5
    assert Backoff(rng=lambda: 0.0).delay() == 0.0


def test_serve_refuses_a_limit_its_open_files_cannot_hold(tmp_path: Path) -> None:
    argv = [*SERVE, "--db", f"sqlite:///{tmp_path}/s.db", "--port", str(free_port())]
    done = subprocess.run(
        [*argv, "--max-connections", "100000000"], capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "--max-connections 100000000: the open-file limit is" in out
    assert "Traceback" not in out


class Proxy:
    """A TCP proxy in front of the server: counts the claims it forwards and the 503s it brings
    back (what the server saw), can cut every connection, and can hold new ones until resumed."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.claims = 0
        self.refused = 0
        self.open = asyncio.Event()
        self.open.set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._server = server
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        """Close every connection through the proxy; new ones wait for :meth:`resume`."""
        self.open.clear()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.open.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer, up=True),
            self._pipe(up_reader, writer, up=False),
            return_exceptions=True,
        )
        self._writers -= {writer, up_writer}

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        try:
            while data := await src.read(65536):
                if up:
                    self.claims += data.count(CLAIM)
                else:
                    self.refused += data.count(b"HTTP/1.1 503 ")
                dst.write(data)
                await dst.drain()
        finally:
            dst.transport.abort()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """``rollfleet serve --max-connections 32`` on SQLite: its URL, port and log."""
    port, log = free_port(), tmp_path / "serve.log"
    argv = [*SERVE, "--db", f"sqlite:///{tmp_path}/s.db", "--port", str(port)]
    with log.open("wb") as err:
        proc = subprocess.Popen([*argv, "--max-connections", "32"], stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, log.read_text()
            time.sleep(0.1)  # polling for the server to answer
        yield url, port, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _hold(port: int) -> asyncio.StreamWriter:
    """One connection holding a 60 s long-poll claim on the empty queue."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = orjson.dumps({"worker_id": "holder", "wait_s": 60, "max_n": 1})
    head = "POST /claims HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return writer


async def _full(url: str) -> bool:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{url}/health")).status_code == 503


@pytest.fixture
async def runners(served: tuple[str, int, Path]) -> AsyncIterator[tuple[Proxy, list[Runner]]]:
    """8 runners claiming through the proxy, each registered and long-polling."""
    url, port, _ = served
    proxy = Proxy(port)
    through = await proxy.start()
    registered: set[str] = set()
    all_registered = asyncio.Event()

    def on_event(name: str, worker_id: str = "", **_: object) -> None:
        if name == "worker_started":
            registered.add(worker_id)
        if len(registered) == 8:
            all_registered.set()

    made = [
        Runner(
            HttpStore(through),
            "rollfleet.agents.sleep",
            worker_id=f"r{i}",
            claim_wait_s=0.5,
            on_event=on_event,
        )
        for i in range(8)
    ]
    tasks = [asyncio.create_task(r.run()) for r in made]
    await asyncio.wait_for(all_registered.wait(), 60)
    yield proxy, made
    for r in made:
        r.stop(drain=False)
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    for r in made:
        await r.store.close()


async def test_a_full_server_answers_503_and_runners_back_off_then_recover(
    served: tuple[str, int, Path], runners: tuple[Proxy, list[Runner]]
) -> None:
    url, port, log = served
    proxy, made = runners
    proxy.cut()  # the runners' connections drop; their next ones wait while the server fills up
    holders: list[asyncio.StreamWriter] = []
    while True:
        while not await _full(url):
            holders.append(await _hold(port))
        # A claim the cut cut off still runs on the server until its 0.5 s long-poll ends, and
        # counts against the limit until then: wait past that bound, then top up again, so the
        # server is full with holders alone (CI once counted 96 claims when it was not).
        await asyncio.sleep(1.0)
        if await _full(url):
            break
    claims0, refused0 = proxy.claims, proxy.refused
    proxy.open.set()
    window = 6.0
    await asyncio.sleep(window)  # the window the server's traffic is counted over
    claims, refused = proxy.claims - claims0, proxy.refused - refused0
    # retrying every 0.5 s, as runners did, is at least runners × window / 0.5 claims
    tight = len(made) * window / 0.5
    assert len(made) <= claims < 0.6 * tight, (claims, tight)
    assert refused >= claims  # every claim (and heartbeat) was answered 503 at once
    assert "up to 32 connections" in log.read_text()

    for writer in holders:  # room again: the runners claim and finish the work
        writer.transport.abort()
    direct = HttpStore(url)
    made_rollouts = await direct.enqueue_many(
        [RolloutSpec(input={"duration": 0.01}) for _ in range(16)]
    )
    done = await direct.wait_for_rollouts([r.rollout_id for r in made_rollouts], 60)
    assert all(r.status is RolloutStatus.SUCCEEDED for r in done)
    await direct.close()
