"""One benchmark client process for bench/store_throughput.py; runs under our venv or the peers' venv.

Prints one JSON line. ``--impl ours|agl``; ``--op seed|enqueue|claim|claim_batch[_seq]|handover[_batch]|latency``; ``--inproc N`` runs N
concurrent tasks against an in-process store instead of one client of a server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any


class Ours:
    def __init__(self, url: str) -> None:
        from rollfleet.client import connect

        self.store = connect(url)

    async def seed(self, n: int) -> None:
        from rollfleet.model import RolloutSpec

        for i in range(0, n, 5000):
            await self.store.enqueue_many(
                [RolloutSpec(input={"i": j}) for j in range(i, min(n, i + 5000))]
            )

    async def enqueue(self, i: int) -> None:
        await self.store.enqueue_rollout({"i": i})

    async def claim_complete(self, worker: str) -> bool:
        from rollfleet.model import AttemptStatus, RolloutResult

        got = await self.store.claim(worker, max_n=1)
        if not got:
            return False
        await self.store.complete(
            got[0].attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
        )
        return True

    async def claim_complete_batch(self, worker: str) -> int:
        from rollfleet.model import AttemptStatus, Completion, RolloutResult

        got = await self.store.claim(worker, max_n=BATCH)
        if got:
            await self.store.complete_many(
                [
                    Completion(
                        attempt_id=r.attempt.attempt_id,
                        status=AttemptStatus.SUCCEEDED,
                        result=RolloutResult(reward=1.0),
                    )
                    for r in got
                ]
            )
        return len(got)

    async def handover(self, worker: str, held: list[Any], n: int) -> int:
        """Complete what ``held`` holds and claim the next ``n`` in one request (the first call
        only claims); returns how many were completed."""
        from rollfleet.model import AttemptStatus, Completion, RolloutResult

        if not held:
            held.extend(await self.store.claim(worker, max_n=n))
            return -1 if held else 0
        done = [
            Completion(
                attempt_id=r.attempt.attempt_id,
                status=AttemptStatus.SUCCEEDED,
                result=RolloutResult(reward=1.0),
            )
            for r in held
        ]
        got = await self.store.complete_and_claim(done, worker, n)
        held[:] = got.claimed
        return len(done)

    async def wait_claim(self, worker: str, idle: asyncio.Event) -> Any:
        while True:
            idle.set()  # the long-poll is about to wait: the worker is idle from here on
            got = await self.store.claim(worker, wait_s=30, max_n=1)
            if got:
                return got[0]

    async def close(self) -> None:
        await self.store.close()


class Agl:
    POLL_S = 5.0  # Agent Lightning runners' default poll interval

    def __init__(self, url: str) -> None:
        if url == "memory":
            from agentlightning.store.memory import InMemoryLightningStore

            self.store = InMemoryLightningStore()
        else:
            from agentlightning.store.client_server import LightningStoreClient

            self.store = LightningStoreClient(url)

    async def seed(self, n: int) -> None:
        from agentlightning.types import EnqueueRolloutRequest

        for i in range(0, n, 1000):
            await self.store.enqueue_many_rollouts(
                [EnqueueRolloutRequest(input={"i": j}) for j in range(i, min(n, i + 1000))]
            )

    async def enqueue(self, i: int) -> None:
        await self.store.enqueue_rollout({"i": i})

    async def claim_complete(self, worker: str) -> bool:
        got = await self.store.dequeue_rollout(worker_id=worker)
        if got is None:
            return False
        await self.store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")
        return True

    async def claim_complete_batch_seq(self, worker: str) -> int:
        """AGL's batch claim, then its completions one after another (its runner's own way)."""
        got = await self.store.dequeue_many_rollouts(limit=BATCH, worker_id=worker)
        for r in got:
            await self.store.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
        return len(got)

    async def claim_complete_batch(self, worker: str) -> int:
        got = await self.store.dequeue_many_rollouts(limit=BATCH, worker_id=worker)
        await asyncio.gather(
            *(
                self.store.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
                for r in got
            )
        )
        return len(got)

    async def wait_claim(self, worker: str, idle: asyncio.Event) -> Any:
        while True:
            got = await self.store.dequeue_rollout(worker_id=worker)
            if got is not None:
                return got
            idle.set()  # found nothing: the runner now sleeps its poll interval
            await asyncio.sleep(self.POLL_S)

    async def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            await close()


BATCH = 16


WARMUP = 0.0  # seconds run before the counted window (--warmup)


async def timed_loop(fn: Any, seconds: float) -> int:
    """Ops finished inside the window ``[start + WARMUP, start + WARMUP + seconds]``; the ops of
    the warm-up run in full but are not counted. A negative answer is work that completed nothing
    (a first claim)."""
    n, total = 0, 0
    start = time.perf_counter()
    counted_from, end = start + WARMUP, start + WARMUP + seconds
    while time.perf_counter() < end:
        done = await fn(total)
        if done is False or done == 0:
            break
        k = 1 if done is True or done is None else max(0, done)
        total += k
        if counted_from <= time.perf_counter() <= end:
            n += k
    TOTALS.append(total)
    return n


TOTALS: list[int] = []  # every loop's ops, warm-up included (how far the queue was drained)


async def latency(client: Any, make: Any, samples: int) -> dict[str, float]:
    claimer = make()
    waits: list[float] = []
    for i in range(samples):
        idle = asyncio.Event()
        task = asyncio.create_task(claimer.wait_claim("lat", idle))
        await idle.wait()
        await asyncio.sleep(0.05)  # the claim request is in flight and waiting on the server
        t0 = time.perf_counter()
        await client.enqueue(i)
        await task
        waits.append((time.perf_counter() - t0) * 1000)
    await claimer.close()
    waits.sort()
    return {
        "p50_ms": statistics.median(waits),
        "p95_ms": waits[int(0.95 * (len(waits) - 1))],
        "samples": samples,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    make = (lambda: Ours(args.url)) if args.impl == "ours" else (lambda: Agl(args.url))
    store = make()
    try:
        if args.op == "seed":
            await store.seed(args.n)
            return {"seeded": args.n}
        if args.op == "latency":
            return await latency(store, make, args.n)
        if args.inproc:
            await store.seed(args.n) if args.op in ("claim", "claim_batch") else None
            stores = [store] * args.inproc
        else:
            stores = [store]
        if (
            args.barrier
        ):  # every client starts its timed loop at once, after all of them have set up
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        t0 = time.perf_counter()
        if args.op == "enqueue":
            counts = await asyncio.gather(*[timed_loop(s.enqueue, args.seconds) for s in stores])
        elif args.op in ("claim_batch", "claim_batch_seq"):
            batch = "claim_complete_batch" + args.op.removeprefix("claim_batch")
            counts = await asyncio.gather(
                *[
                    timed_loop(lambda _n, s=s, w=f"w{k}": getattr(s, batch)(w), args.seconds)
                    for k, s in enumerate(stores)
                ]
            )
        elif args.op in ("handover", "handover_batch"):
            size = BATCH if args.op == "handover_batch" else 1
            counts = await asyncio.gather(
                *[
                    timed_loop(
                        lambda _n, s=s, w=f"w{k}", h=[]: s.handover(w, h, size),  # type: ignore[misc]
                        args.seconds,
                    )
                    for k, s in enumerate(stores)
                ]
            )
        else:
            counts = await asyncio.gather(
                *[
                    timed_loop(lambda _n, s=s, w=f"w{k}": s.claim_complete(w), args.seconds)
                    for k, s in enumerate(stores)
                ]
            )
        seconds = args.seconds if WARMUP else time.perf_counter() - t0
        return {"ops": sum(counts), "seconds": seconds, "total": sum(TOTALS)}
    finally:
        await store.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ours", "agl"], required=True)
    p.add_argument("--url", required=True)
    p.add_argument(
        "--op",
        choices=[
            "seed",
            "enqueue",
            "claim",
            "claim_batch",
            "claim_batch_seq",
            "handover",
            "handover_batch",
            "latency",
        ],
        required=True,
    )
    p.add_argument("--warmup", type=float, default=0.0, help="seconds run before counting")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--n", type=int, default=0)
    p.add_argument("--inproc", type=int, default=0)
    p.add_argument(
        "--barrier", action="store_true", help="print 'ready', wait for a line on stdin, then start"
    )
    parsed = p.parse_args()
    WARMUP = parsed.warmup
    print(json.dumps(asyncio.run(main(parsed))))
