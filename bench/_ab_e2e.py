"""One end-to-end measurement for bench/refactor_ab.py, run with the source tree under test first on
PYTHONPATH: a control plane (``rollfleet serve``), 4 local runner processes × concurrency 64 with the
50 ms sleep agent, and a batch of rollouts timed from enqueue to every one SUCCEEDED.

Uses only the public API both trees share. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time

from bench._common import free_port, start, stop

N, CONCURRENCY, ROLLOUTS = 4, 64, 2048


async def main() -> None:
    """Time one batch through a fresh server and a fresh fleet."""
    from rollfleet.client import HttpStore
    from rollfleet.model import RolloutSpec, RolloutStatus
    from rollfleet.runner.local import LocalFleet

    port = free_port()
    server = start(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "serve",
            "--db",
            f"sqlite:///{tempfile.mkdtemp()}/ab.db",
            "--port",
            str(port),
        ],
        f"http://127.0.0.1:{port}/health",
    )
    url = f"http://127.0.0.1:{port}"
    store = HttpStore(url)
    fleet = LocalFleet(url, "rollfleet.agents.sleep", n=N, concurrency=CONCURRENCY, grace_s=5.0)
    running = asyncio.create_task(fleet.run())
    try:
        while len((await store.query_workers()).items) < N:  # every runner registered and polling
            await asyncio.sleep(0.05)
        started = time.perf_counter()
        made = await store.enqueue_many(
            [RolloutSpec(input={"duration": 0.05, "i": i}) for i in range(ROLLOUTS)]
        )
        done = await store.wait_for_rollouts([r.rollout_id for r in made], 300)
        wall = time.perf_counter() - started
        ok = sum(r.status is RolloutStatus.SUCCEEDED for r in done)
        print(json.dumps({"rollouts": ok, "seconds": wall, "rollouts_per_s": ok / wall}))
    finally:
        fleet.stop()
        await running
        await store.close()
        stop(server)


if __name__ == "__main__":
    asyncio.run(main())
