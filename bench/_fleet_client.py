"""One client process of ``bench/fleet.py``: N simulated runners, and the tally of its window.

Each simulated runner is an asyncio task holding its own ``HttpStore`` (so its own keep-alive
connection, kept open across its agent time): it long-polls ``POST /claims`` (``wait_s`` 2, one
rollout, as ``Runner`` does), "runs the agent" by sleeping uniform 0.5–2 s, and sends its result
with ``POST /attempts/complete`` (``complete_many``, one item, as ``Runner`` batches them). A
failed claim waits as ``Runner`` does: ``Backoff`` (0.5 s doubling to 10 s, full jitter, reset by
a claim that succeeds). Run by the parent as ``python -m bench._fleet_client N OFFSET URLS``: it
prints ``ready``, reads the window ``START END`` (wall clock) from stdin and prints its tally.

``python -m bench._fleet_client memory`` measures what a held connection costs a replica: the RSS
of one ``rollfleet serve`` on PostgreSQL holding 2,000, 5,000 and 10,000 long-poll claims on an
empty queue (``connection_memory`` in bench/results/fleet.json; it sizes ``--max-connections``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from rollfleet.client import HttpStore
from rollfleet.client.endpoints import Backoff
from rollfleet.model import AttemptStatus, Completion, CompletionOutcome, RolloutResult
from rollfleet.web.serving import raise_fd_limit

CLAIM_WAIT_S = 2.0
AGENT_S = (0.5, 2.0)
# complete-and-claim in one request, as Runner sends it (FLEET_HANDOVER=0: a claim and a
# completion apart, as runners did before it)
HANDOVER = os.environ.get("FLEET_HANDOVER", "1") == "1"


class Tally:
    """What one client process saw inside the window."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.claim_ms: list[float] = []
        self.complete_ms: list[float] = []
        self.completions = 0
        self.empty = 0
        self.refused = 0  # completions answered with an error (a lapsed lease)
        self.errors: dict[str, int] = {}

    def inside(self, t: float) -> bool:
        """Whether wall time ``t`` falls in the window."""
        return self.start <= t < self.end

    def error(self, exc: BaseException, what: str) -> None:
        """Count a failed call by kind."""
        if self.inside(time.time()):
            key = f"{what}: {type(exc).__name__} {str(exc)[:60]}"
            self.errors[key] = self.errors.get(key, 0) + 1

    def as_json(self) -> str:
        """The tally as the parent reads it."""
        keys = ("claim_ms", "complete_ms", "completions", "empty", "refused", "errors")
        return json.dumps({k: getattr(self, k) for k in keys})


async def one_runner(index: int, urls: list[str], tally: Tally) -> None:
    """Claim, sleep the agent's time, complete; forever (cancelled at the end). With
    ``HANDOVER``, the completion claims the next rollout in the same request (as ``Runner``
    does), and a separate claim is sent only when that one brought nothing."""
    order = urls[index % len(urls) :] + urls[: index % len(urls)]
    store = HttpStore(order)
    worker = f"sim-{os.getpid()}-{index}"
    rng, backoff = random.Random(index), Backoff(rng=random.Random(-index - 1).random)
    handed: list[Any] = []
    while True:
        t0, claimed = time.time(), not handed  # a handed-over rollout needed no claim
        try:
            docs, handed = handed or await store.claim_documents(worker, CLAIM_WAIT_S, 1), []
        except Exception as exc:
            tally.error(exc, "claim")
            await asyncio.sleep(backoff.delay())
            continue
        backoff.reset()
        t1 = time.time()
        if not docs:
            tally.empty += tally.inside(t1)
            continue
        if tally.inside(t1) and claimed:
            tally.claim_ms.append((t1 - t0) * 1000)
        await asyncio.sleep(rng.uniform(*AGENT_S))
        done = Completion(
            attempt_id=docs[0]["attempt"]["attempt_id"],
            status=AttemptStatus.SUCCEEDED,
            result=RolloutResult(reward=1.0),
        )
        t2 = time.time()
        try:
            if HANDOVER:
                got = await store.complete_and_claim_documents([done], worker, 1)
                outcome = CompletionOutcome.model_validate(got["outcomes"][0])
                handed = got["claimed"]
            else:
                outcome = (await store.complete_many([done]))[0]
        except Exception as exc:
            tally.error(exc, "complete")
            continue
        t3 = time.time()
        if tally.inside(t3):
            tally.completions += 1
            tally.complete_ms.append((t3 - t2) * 1000)
            tally.refused += outcome.error_type is not None


async def client_main(n: int, offset: int, urls: list[str]) -> None:
    """Start n runners over a ramp, wait for the window from stdin, print the tally."""
    raise_fd_limit()
    print("ready", flush=True)
    start, end = (float(x) for x in (await asyncio.to_thread(sys.stdin.readline)).split())
    tally = Tally(start, end)
    ramp = max(0.5, n / 2000)
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one_runner(offset + i, urls, tally)))
        if i % 100 == 99:
            await asyncio.sleep(ramp / (n / 100))
    await asyncio.sleep(max(0.0, end - time.time()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(tally.as_json(), flush=True)


async def _hold(port: int, i: int) -> asyncio.StreamWriter:
    """One connection holding a 120 s long-poll claim."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"worker_id": f"hold-{i}", "wait_s": 120, "max_n": 1}).encode()
    head = "POST /claims HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return writer


async def held_memory(counts: tuple[int, ...] = (2000, 5000, 10000)) -> list[dict[str, Any]]:
    """A replica's RSS holding each count of long-poll claims, and KiB per connection."""
    from bench.fleet import drop_schema, new_schema, start_replicas  # the parent's helpers

    schema, db_url = new_schema()
    servers, urls, _ = start_replicas(db_url, 1, Path(tempfile.mkdtemp(prefix="rollfleet-conn-")))
    server, held, out = psutil.Process(servers[0].pid), [], []
    port = int(urls[0].rsplit(":", 1)[1])
    try:
        base = server.memory_info().rss
        for n in counts:
            while len(held) < n:
                held += await asyncio.gather(*(_hold(port, len(held) + k) for k in range(200)))
            for _ in range(600):  # until the server has accepted every one
                if server.num_fds() >= n:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)  # and read every claim into its long-poll
            rss = server.memory_info().rss
            out.append(
                {
                    "connections": n,
                    "rss_mib": rss / 2**20,
                    "base_mib": base / 2**20,
                    "kib_each": (rss - base) / n / 1024,
                }
            )
            print(json.dumps(out[-1]), flush=True)
    finally:
        for writer in held:
            writer.transport.abort()
        servers[0].terminate()
        servers[0].wait(30)
        drop_schema(schema)
    return out


def memory_main() -> None:
    """Measure :func:`held_memory` and store it in bench/results/fleet.json."""
    from bench._common import RESULTS

    raise_fd_limit()
    path = RESULTS / "fleet.json"
    doc = json.loads(path.read_text())
    figures = asyncio.run(held_memory())
    doc["connection_memory"] = {
        "command": "python -m bench._fleet_client memory",
        "date": time.strftime("%Y-%m-%d"),
        "points": figures,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "memory":
        memory_main()
    else:
        asyncio.run(client_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")))
