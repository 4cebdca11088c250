"""The lean client's answer handling against bare httptools, on the claim answer shape.

The client parses with httptools and adds its bounds and RFC 9112 checks in the callbacks; this
measures what those cost over httptools alone. (Measured on 2026-11-24 before the switch, the
client's hand-written parser took 3.89 µs per Content-Length answer and 5.92 µs per chunked one,
against httptools' 1.62 and 1.59: the reason for the switch.) Each round parses the same answers
(a 16-rollout claim, ~6 KiB; Content-Length, then chunked) both ways, alternating A B A B; medians
of µs per answer with their range. Run: ``python -m bench wire_parse``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httptools
import orjson

from bench._common import table, write_results
from rollfleet.client.wire import _Connection

ROUNDS, N = 5, 20_000
BODY = orjson.dumps(
    [
        {
            "rollout_id": f"ro-{i:030x}",
            "input": {"q": "x" * 200},
            "status": "preparing",
            "attempt": {"attempt_id": f"at-{i:030x}", "worker_id": "w-1"},
        }
        for i in range(16)
    ]
)
PLAIN = (
    b"HTTP/1.1 200 OK\r\ndate: Tue, 24 Nov 2026 01:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ntransfer-encoding: chunked\r\n\r\n"
    b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
)


class _Sink:
    def write(self, data: bytes) -> None:
        pass


def ours(answer: bytes, loop: asyncio.AbstractEventLoop) -> float:
    """µs per answer through the lean client's protocol object."""
    conn = _Connection()
    conn.transport = _Sink()  # type: ignore[assignment]
    started = time.perf_counter()
    for _ in range(N):
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        conn.send(b"", fut)
        conn.data_received(answer)
        assert fut.result()[0] == 200
    return (time.perf_counter() - started) / N * 1e6


class _Collect:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done = False

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def theirs(answer: bytes, loop: asyncio.AbstractEventLoop) -> float:
    """µs per answer through httptools, collecting the body the same way."""
    started = time.perf_counter()
    for _ in range(N):
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        sink = _Collect()
        parser = httptools.HttpResponseParser(sink)
        parser.feed_data(answer)
        assert sink.done
        fut.set_result((parser.get_status_code(), b"".join(sink.parts)))
    return (time.perf_counter() - started) / N * 1e6


def main() -> dict[str, Any]:
    """Alternate both parsers over ROUNDS rounds per answer shape."""
    loop = asyncio.new_event_loop()
    figures: dict[str, Any] = {}
    rows = []
    for shape, answer in (("content-length", PLAIN), ("chunked", CHUNKED)):
        runs: dict[str, list[float]] = {"ours": [], "httptools": []}
        for _ in range(ROUNDS):
            runs["ours"].append(ours(answer, loop))
            runs["httptools"].append(theirs(answer, loop))
        med = {k: statistics.median(v) for k, v in runs.items()}
        figures[shape] = {
            "us_per_answer": runs,
            "median": med,
            "ratio": med["httptools"] / med["ours"],
        }
        rows.append(
            [
                shape,
                f"{med['ours']:.2f} [{min(runs['ours']):.2f}-{max(runs['ours']):.2f}]",
                f"{med['httptools']:.2f} [{min(runs['httptools']):.2f}-{max(runs['httptools']):.2f}]",
                f"{med['httptools'] / med['ours']:.2f}x",
            ]
        )
    loop.close()
    table(
        f"answer handling, µs per {len(BODY)}-byte claim answer",
        ["framing", "lean client", "bare httptools", "httptools / lean"],
        rows,
    )
    return write_results("wire_parse", figures, "python -m bench wire_parse")


if __name__ == "__main__":
    main()
