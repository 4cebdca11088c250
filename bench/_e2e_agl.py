"""Agent Lightning 0.3.0 side of bench/end_to_end.py; runs under the peers' venv (.venv-peers).

``--role drive`` starts ``agl store``, four ``--role runner`` processes (each one ``LitAgentRunner``
with its defaults: poll every 5 s ± 0.5 s when the queue is empty, one rollout at a time), then
measures rollouts/s for the 50 ms sleep and the echo agent (a batch queued while the runners sleep
between polls, as ours are measured, and the same batch with all four runners awake) and the
idle-runner dispatch latency, and prints one JSON line. Every runner prints ``{"id": rollout_id, "t": unix time}`` when an agent
starts, which gives the dispatch latency and the first start of a batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench._common import wait_healthy  # noqa: E402  (the peers' venv has httpx and rich)

HERE = Path(__file__).resolve()
# LiteLLM (imported by agentlightning) otherwise fetches its model cost map from the network at import
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
AGL_BIN = Path(sys.executable).parent / "agl"


# --- runner process ----------------------------------------------------------------------------


def make_agent() -> Any:
    """One Agent Lightning agent: sleeps ``duration`` seconds (or ``until`` a unix time), else echoes."""
    import agentlightning as agl

    @agl.rollout  # type: ignore[untyped-decorator]
    async def bench_agent(task: Any, llm: Any, rollout: Any) -> float:
        sys.stdout.write(json.dumps({"id": rollout.rollout_id, "t": time.time()}) + "\n")
        sys.stdout.flush()
        if isinstance(task, dict) and "duration" in task:
            await asyncio.sleep(float(task["duration"]))
        if isinstance(task, dict) and "until" in task:
            await asyncio.sleep(max(0.0, float(task["until"]) - time.time()))
        return 1.0

    return bench_agent


def make_tracer() -> Any:
    """The lightest tracer possible: AGL's DummyTracer with a no-op trace context (it has none of its own)."""
    import contextlib

    from agentlightning.tracer.dummy import DummyTracer

    class NoopTracer(DummyTracer):  # type: ignore[misc]
        @contextlib.asynccontextmanager
        async def trace_context(self, name: Any = None, **kwargs: Any) -> Any:
            yield None

        def get_last_trace(self) -> list[Any]:
            return []

    return NoopTracer()


async def run_runner(url: str, worker_id: int) -> None:
    """Run one LitAgentRunner with its default settings until SIGTERM."""
    from agentlightning.execution.events import ThreadingEvent
    from agentlightning.runner.agent import LitAgentRunner
    from agentlightning.store.client_server import LightningStoreClient

    store = LightningStoreClient(url)
    runner: LitAgentRunner[Any] = LitAgentRunner(tracer=make_tracer())
    runner.init(agent=make_agent())
    runner.init_worker(worker_id, store)
    stop = ThreadingEvent()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    sys.stdout.write(json.dumps({"ready": worker_id}) + "\n")
    sys.stdout.flush()
    try:
        await runner.iter(event=stop)
    finally:
        runner.teardown_worker(worker_id)
        runner.teardown()
        await store.close()


# --- driver ------------------------------------------------------------------------------------


class Runners:
    """N runner processes and the agent start times they report (runner index, unix time) by rollout id."""

    def __init__(self, url: str, n: int) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE),
                    "--role",
                    "runner",
                    "--url",
                    url,
                    "--worker-id",
                    str(i),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for i in range(n)
        ]
        self.ready = 0
        self.starts: dict[str, tuple[int, float]] = {}
        self.cond = threading.Condition()
        self.threads = [
            threading.Thread(target=self._read, args=(k, p), daemon=True)
            for k, p in enumerate(self.procs)
        ]
        for t in self.threads:
            t.start()

    def _read(self, k: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                if "ready" in msg:
                    self.ready += 1
                else:
                    self.starts[msg["id"]] = (k, msg["t"])
                self.cond.notify_all()

    def wait(self, pred: Any, timeout: float) -> bool:
        """Wait until ``pred()`` holds (under the lock) or the timeout passes."""
        with self.cond:
            return bool(self.cond.wait_for(pred, timeout))

    def stop(self) -> None:
        """SIGTERM every runner, then kill what is left."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def wait_all(store: Any, ids: list[str], timeout: float) -> list[Any]:
    """Wait until every rollout finished; the client refuses waits over 0.1 s, so wait in 50 ms slices."""
    remaining, done = list(ids), []
    deadline = time.monotonic() + timeout
    while remaining and time.monotonic() < deadline:
        finished = await store.wait_for_rollouts(rollout_ids=remaining, timeout=0.05)
        ended = {r.rollout_id for r in finished}
        done += finished
        remaining = [i for i in remaining if i not in ended]
    return done


async def throughput(
    store: Any, runners: Runners, inputs: list[Any], timeout: float
) -> dict[str, Any]:
    """Enqueue a batch while the runners sleep between polls; rollouts/s from enqueue to all succeeded."""
    from agentlightning.types import EnqueueRolloutRequest

    t0 = time.time()
    rollouts = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=x) for x in inputs])
    ids = [r.rollout_id for r in rollouts]
    done = await wait_all(store, ids, timeout)
    t1 = time.time()
    ok = sum(1 for r in done if r.status == "succeeded")
    firsts: dict[int, float] = {}
    with runners.cond:
        for k, t in (runners.starts[i] for i in ids if i in runners.starts):
            firsts[k] = min(t, firsts.get(k, t))
    return {
        "rollouts": len(ids),
        "succeeded": ok,
        "seconds": t1 - t0,
        "rollouts_per_s": ok / (t1 - t0),
        "runner_first_start_after_s": sorted(round(t - t0, 3) for t in firsts.values()),
    }


async def throughput_awake(
    store: Any, runners: Runners, inputs: list[Any], timeout: float
) -> dict[str, Any]:
    """The same batch with every runner awake: each first takes a hold task that ends at one instant T
    (all of them wake within one poll interval, 5.5 s), the batch is queued before T; rollouts/s from T."""
    from agentlightning.types import EnqueueRolloutRequest

    n = len(runners.procs)
    until = time.time() + 6.5
    holds = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input={"until": until}) for _ in range(n)]
    )
    hold_ids = [r.rollout_id for r in holds]
    if not runners.wait(lambda: all(i in runners.starts for i in hold_ids), 15):
        raise RuntimeError("the hold tasks did not all start within 15 s")
    holders = len({runners.starts[i][0] for i in hold_ids})
    rollouts = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=x) for x in inputs])
    ids = [r.rollout_id for r in rollouts]
    if time.time() >= until:
        raise RuntimeError("the batch was queued after the hold tasks ended")
    done = await wait_all(store, ids, timeout)
    t1 = time.time()
    ok = sum(1 for r in done if r.status == "succeeded")
    return {
        "rollouts": len(ids),
        "succeeded": ok,
        "seconds": t1 - until,
        "rollouts_per_s": ok / (t1 - until),
        "runners_awake": holders,
    }


async def dispatch(store: Any, runners: Runners, samples: int) -> dict[str, Any]:
    """Enqueue one rollout at a time to the idle fleet; ms until an agent starts it."""
    rng = random.Random(7)
    waits: list[float] = []
    for i in range(samples):
        await asyncio.sleep(
            rng.uniform(0.3, 1.3)
        )  # every runner has found the queue empty and sleeps
        t0 = time.time()
        rollout = await store.enqueue_rollout(input={"probe": i})
        rid = rollout.rollout_id
        if not runners.wait(lambda rid=rid: rid in runners.starts, 30):
            raise RuntimeError(f"probe {rid} did not start within 30 s")
        waits.append((runners.starts[rid][1] - t0) * 1000)
        await wait_all(store, [rid], 10)
    waits.sort()
    return {
        "p50_ms": statistics.median(waits),
        "max_ms": waits[-1],
        "samples": samples,
        "all_ms": [round(w, 1) for w in waits],
    }


def start_store(port: int) -> subprocess.Popen[bytes]:
    """Start ``agl store`` (its in-memory store) on a port."""
    return subprocess.Popen(
        [
            str(AGL_BIN),
            "store",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def log(msg: str) -> None:
    """Progress on stderr (the bench shows it)."""
    print(f"[agl] {msg}", file=sys.stderr, flush=True)


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Start the store and the runners, measure, stop everything."""
    import agentlightning as agl
    from agentlightning.store.client_server import LightningStoreClient

    began = time.monotonic()
    url = f"http://127.0.0.1:{args.port}"
    server = start_store(args.port)
    runners: Runners | None = None
    store = None
    try:
        wait_healthy(f"{url}/v1/agl/health", server)
        log(f"store up after {time.monotonic() - began:.1f}s")
        store = LightningStoreClient(url)
        await store.add_resources(
            {"main_llm": agl.LLM(endpoint="http://127.0.0.1:9/v1", model="unused")}
        )
        runners = Runners(url, args.runners)
        if not runners.wait(lambda: runners is not None and runners.ready == args.runners, 120):
            raise RuntimeError("Agent Lightning runners did not start")
        log(f"runners up after {time.monotonic() - began:.1f}s")
        await asyncio.sleep(1.0)  # each runner's first poll found the queue empty: all are idle now
        out: dict[str, Any] = {"runners": args.runners, "poll_interval_s": 5.0}
        out["sleep"] = await throughput(
            store, runners, [{"duration": 0.05, "i": i} for i in range(args.sleep_n)], args.timeout
        )
        out["sleep_awake"] = await throughput_awake(
            store, runners, [{"duration": 0.05, "i": i} for i in range(args.sleep_n)], args.timeout
        )
        out["echo"] = await throughput(
            store, runners, [{"echo": i} for i in range(args.echo_n)], args.timeout
        )
        out["echo_awake"] = await throughput_awake(
            store, runners, [{"echo": i} for i in range(args.echo_n)], args.timeout
        )
        out["dispatch_latency"] = await dispatch(store, runners, args.samples)
        return out
    finally:
        if runners is not None:
            runners.stop()
        if store is not None:
            await store.close()
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    """Parse arguments and run one role."""
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["drive", "runner"], required=True)
    p.add_argument("--url", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--runners", type=int, default=4)
    p.add_argument("--sleep-n", type=int, default=200)
    p.add_argument("--echo-n", type=int, default=200)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--timeout", type=float, default=90.0)
    args = p.parse_args()
    if args.role == "runner":
        asyncio.run(run_runner(args.url, args.worker_id))
    else:
        print(json.dumps(asyncio.run(drive(args))))


if __name__ == "__main__":
    main()
