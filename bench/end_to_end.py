"""End to end: rollouts/s through server + runners, ours vs Agent Lightning 0.3.0, in one run.

Ours: a durable SQLite server (``rollfleet serve``), runners as local processes (LocalFleet) and as Ray
actors (RayFleet), 1 and 4 runners × concurrency 1/16/64, with the echo agent and the 50 ms sleep
agent. Agent Lightning: 4 ``LitAgentRunner`` processes with their defaults (5 s poll, one rollout at a
time) on ``agl store`` (in memory, not durable), the same agents. Rollouts/s is the wall time from
enqueueing a batch to every rollout SUCCEEDED, measured after the runners have started and registered.
Agent Lightning is also measured with all four runners awake (each held busy until one instant, the
batch queued before it), which leaves out its poll sleep; ratios are given against both figures.
Dispatch latency: enqueue one rollout while every runner is idle and waiting; ms until the agent runs.
Run: ``python -m bench end_to_end`` (peers: ``make peers``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from functools import partial
from typing import Any

from bench._common import (
    PEERS_PY,
    PY,
    ROOT,
    console,
    free_port,
    peers_available,
    start,
    stop,
    table,
    write_results,
)

ECHO, SLEEP, STAMP = "rollfleet.agents.echo", "rollfleet.agents.sleep", "bench._e2e_stamp"
AGENTS = {"echo": (ECHO, {"echo": "hello"}), "sleep": (SLEEP, {"duration": 0.05})}
SHAPES = [(1, 1), (1, 16), (1, 64), (4, 1), (4, 16), (4, 64)]
SCALE = float(os.environ.get("BENCH_E2E_SCALE", "1"))
LATENCY_SAMPLES = 30
AGL_SLEEP_N, AGL_ECHO_N, AGL_SAMPLES = 200, 400, 5


def batch_size(agent: str, n: int, c: int) -> int:
    """Rollouts per configuration: one and a half to three seconds of work at the rate that shape reaches here."""
    slots = n * c
    rate = min(slots / 0.05, 500.0) if agent == "sleep" else min(60.0 * slots, 300.0)
    return max(40, int(rate * 1.6 * SCALE))


# --- our fleets --------------------------------------------------------------------------------


class Fleet:
    """One LocalFleet or RayFleet for one configuration: start, wait until registered, stop."""

    def __init__(self, backend: str, url: str, agent: str, n: int, c: int) -> None:
        self.backend, self.n = backend, n
        self.prefix = f"e2e-{backend}-{uuid.uuid4().hex[:6]}"
        if backend == "local":
            from rollfleet.runner.local import LocalFleet

            self.fleet: Any = LocalFleet(
                url, agent, n=n, concurrency=c, prefix=self.prefix, grace_s=5.0
            )
        else:
            from rollfleet.runner.ray_fleet import RayFleet

            # Half a CPU each, so the next configuration's actors can start while these drain.
            self.fleet = RayFleet(
                url, agent, n=n, concurrency=c, prefix=self.prefix, cpus_per_runner=0.5, grace_s=5.0
            )
        self.task = asyncio.create_task(self.fleet.run())

    async def registered(self, store: Any, timeout: float = 120.0) -> None:
        """Wait until every runner has registered (IDLE) with the store, then until its claim is waiting."""
        want = {f"{self.prefix}-{i}" for i in range(self.n)}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.task.done() or self.fleet.agent_error:
                raise RuntimeError(
                    f"{self.backend} fleet did not start: {self.fleet.agent_error or self.task}"
                )
            if want <= await idle_workers(store, self.prefix):
                await asyncio.sleep(
                    0.2
                )  # registered just before the first long-poll claim goes out
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(
            f"{self.backend} runners {sorted(want)} did not register within {timeout:.0f} s"
        )

    async def stop(self) -> None:
        """Drain and stop every runner (each finishes its in-flight long-poll claim first, up to 2 s)."""
        self.fleet.stop()
        try:
            await asyncio.wait_for(self.task, 60)
        except TimeoutError:
            console.print(f"[yellow]{self.backend} fleet {self.prefix} did not stop within 60 s")


class Fleets:
    """Runs configurations one after another; a fleet drains while the next one starts up, and has
    exited before the next batch is enqueued (so it cannot claim that batch's rollouts)."""

    def __init__(self, store: Any, url: str, backend: str) -> None:
        self.store, self.url, self.backend = store, url, backend
        self.draining: asyncio.Task[None] | None = None

    async def run(self, agent: str, n: int, c: int, measure: Any) -> Any:
        """Start a fleet, wait for the last one to be gone and this one registered, measure, stop it."""
        fleet = Fleet(self.backend, self.url, agent, n, c)
        try:
            await self.settle()
            await fleet.registered(self.store)
            return await measure()
        finally:
            self.draining = asyncio.create_task(fleet.stop())

    async def settle(self) -> None:
        """Wait until the previous fleet has stopped."""
        if self.draining is not None:
            await self.draining
            self.draining = None


async def idle_workers(store: Any, prefix: str) -> set[str]:
    """Worker ids under ``prefix`` that the store shows as registered and not offline."""
    found: set[str] = set()
    cursor = None
    while True:
        page = await store.query_workers(cursor=cursor, limit=1000)
        found |= {
            w.worker_id
            for w in page.items
            if w.worker_id.startswith(prefix) and w.status.value != "offline"
        }
        if page.next_cursor is None:
            return found
        cursor = page.next_cursor


async def batch(store: Any, input: Any, count: int, timeout: float = 120.0) -> dict[str, Any]:
    """Enqueue ``count`` rollouts and wait until all are terminal; rollouts/s from enqueue to the last."""
    from rollfleet.model import RolloutSpec

    t0 = time.perf_counter()
    rollouts = await store.enqueue_many([RolloutSpec(input=input) for _ in range(count)])
    ids = [r.rollout_id for r in rollouts]
    # Wait on the tail first: the store re-reads every id it waits on at each completion, so waiting on
    # the whole batch from the start would load the server it measures.
    await store.wait_for_rollouts(ids[-64:], timeout)
    done = await store.wait_for_rollouts(ids, timeout)
    seconds = time.perf_counter() - t0
    ok = sum(1 for r in done if r.status.value == "succeeded")
    if ok != count:
        raise RuntimeError(f"only {ok} of {count} rollouts succeeded within {timeout:.0f} s")
    return {"rollouts": count, "seconds": round(seconds, 3), "rollouts_per_s": count / seconds}


async def dispatch(store: Any, samples: int) -> dict[str, Any]:
    """Enqueue one probe at a time while the runners wait idle; ms from the enqueue call until the agent runs.

    Also split up (p50 of each): the enqueue call itself, enqueue commit → claim (server clock), and
    claim → agent start (the claim's answer reaching the runner and its first heartbeat).
    """
    waits: list[float] = []
    parts: dict[str, list[float]] = {
        "enqueue_call_ms": [],
        "commit_to_claim_ms": [],
        "claim_to_agent_ms": [],
    }
    for i in range(samples):
        await asyncio.sleep(
            0.05
        )  # the runner that ran the last probe is back in its long-poll claim
        t0 = time.time()
        rollout = await store.enqueue_rollout({"probe": i})
        parts["enqueue_call_ms"].append((time.time() - t0) * 1000)
        (done,) = await store.wait_for_rollouts([rollout.rollout_id], 30)
        if done.result is None or not isinstance(done.result.output, dict) or done.attempt is None:
            raise RuntimeError(
                f"probe {rollout.rollout_id} ended {done.status.value}: {done.error}"
            )
        started = float(done.result.output["started"])
        waits.append((started - t0) * 1000)
        parts["commit_to_claim_ms"].append((done.attempt.started_at - done.created_at) * 1000)
        parts["claim_to_agent_ms"].append((started - done.attempt.started_at) * 1000)
    waits.sort()
    return {
        "p50_ms": statistics.median(waits),
        "p95_ms": waits[int(0.95 * (len(waits) - 1))],
        "max_ms": waits[-1],
        "samples": samples,
        "p50_parts": {k: round(statistics.median(v), 2) for k, v in parts.items()},
    }


async def ours_backend(store: Any, url: str, backend: str) -> dict[str, Any]:
    """Every agent × shape on one backend, then the dispatch latency with 1 and 4 idle runners."""
    out: dict[str, Any] = {}
    fleets = Fleets(store, url, backend)
    try:
        for agent, (ref, input) in AGENTS.items():
            for n, c in SHAPES:
                key = f"{agent}_n{n}_c{c}"
                out[key] = await fleets.run(
                    ref, n, c, partial(batch, store, input, batch_size(agent, n, c))
                )
                console.print(
                    f"  {backend:5} {key:14} {out[key]['rollouts']:5d} rollouts "
                    f"{out[key]['rollouts_per_s']:8.1f}/s"
                )
        for n in (1, 4) if backend == "local" else (4,):
            lat = out[f"dispatch_latency_n{n}"] = await fleets.run(
                STAMP, n, 1, partial(dispatch, store, LATENCY_SAMPLES)
            )
            console.print(
                f"  {backend:5} dispatch with {n} idle runner(s): p50 {lat['p50_ms']:.1f} ms "
                f"({', '.join(f'{k} {v}' for k, v in lat['p50_parts'].items())})"
            )
    finally:
        await fleets.settle()
    return out


async def ours(url: str) -> dict[str, Any]:
    """Local processes, then Ray actors (a local Ray started here and shut down after)."""
    from rollfleet.client import HttpStore

    store = HttpStore(url)
    try:
        results: dict[str, Any] = {"local": await ours_backend(store, url, "local")}
        try:
            import ray
        except ImportError:
            results["ray"] = "ray not installed (pip install 'rollfleet[ray]')"
            return results
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=100 * 1024 * 1024,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        try:
            results["ray"] = await ours_backend(store, url, "ray")
        finally:
            ray.shutdown()
        return results
    finally:
        await store.close()


# --- Agent Lightning ---------------------------------------------------------------------------


def agl() -> dict[str, Any] | str:
    """Agent Lightning 0.3.0 in the peers' venv: store, 4 runners, figures as one JSON line."""
    if not peers_available("agentlightning"):
        return "not installed (make peers)"
    argv = [
        str(PEERS_PY),
        str(ROOT / "bench" / "_e2e_agl.py"),
        "--role",
        "drive",
        "--port",
        str(free_port()),
        "--runners",
        "4",
        "--sleep-n",
        str(AGL_SLEEP_N),
        "--echo-n",
        str(AGL_ECHO_N),
        "--samples",
        str(AGL_SAMPLES),
    ]
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"Agent Lightning side failed: {out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# --- report ------------------------------------------------------------------------------------


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each of our rollouts/s over Agent Lightning's (end to end, and once its runners are awake)."""
    peer = results["agentlightning_0_3_0"]
    if not isinstance(peer, dict):
        return {}
    out: dict[str, Any] = {}
    for backend in ("local", "ray"):
        figures = results["ours"].get(backend)
        if not isinstance(figures, dict):
            continue
        for agent in AGENTS:
            theirs, awake = peer[agent]["rollouts_per_s"], peer[f"{agent}_awake"]["rollouts_per_s"]
            for n, c in SHAPES:
                key = f"{agent}_n{n}_c{c}"
                mine = figures[key]["rollouts_per_s"]
                out[f"{backend}_{key}"] = {"vs_agl": mine / theirs, "vs_agl_awake": mine / awake}
    best_key = max((k for k in out if "_sleep_" in k), key=lambda k: out[k]["vs_agl"], default=None)
    if best_key is not None:
        backend, key = best_key.split("_", 1)
        out["best_sleep"] = {
            "config": best_key,
            "rollouts_per_s": results["ours"][backend][key]["rollouts_per_s"],
            **out[best_key],
        }
    return out


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's two targets, met or not, from this run's figures."""
    local = results["ours"]["local"]
    p50 = {
        "local_1_runner": local["dispatch_latency_n1"]["p50_ms"],
        "local_4_runners": local["dispatch_latency_n4"]["p50_ms"],
    }
    if isinstance(results["ours"].get("ray"), dict):
        p50["ray_4_runners"] = results["ours"]["ray"]["dispatch_latency_n4"]["p50_ms"]
    dispatch = {"target_ms": 5.0, "p50_ms": p50, "met": all(v <= 5.0 for v in p50.values())}
    best = results["ratios"].get("best_sleep")
    sleep = {
        "target_ratio": 20.0,
        **(best or {}),
        "met_vs_agl": bool(best and best["vs_agl"] >= 20.0),
        "met_vs_agl_awake": bool(best and best["vs_agl_awake"] >= 20.0),
    }
    return {"sleep_rollouts_per_s_vs_agl": sleep, "dispatch_latency_p50": dispatch}


def _x(ratio: Any) -> str:
    return f"{ratio:.1f}×" if isinstance(ratio, float) else "-"


def show(results: dict[str, Any]) -> None:
    """Print the figures as rich tables."""
    peer, ours_, r = results["agentlightning_0_3_0"], results["ours"], results["ratios"]
    ray = ours_.get("ray") if isinstance(ours_.get("ray"), dict) else None
    rows = []
    for agent in AGENTS:
        for n, c in SHAPES:
            key = f"{agent}_n{n}_c{c}"
            rows.append(
                [
                    agent,
                    f"{n} × {c}",
                    ours_["local"][key]["rollouts_per_s"],
                    ray[key]["rollouts_per_s"] if ray else "-",
                    _x(r.get(f"local_{key}", {}).get("vs_agl")),
                    _x(r.get(f"ray_{key}", {}).get("vs_agl")),
                    _x(r.get(f"local_{key}", {}).get("vs_agl_awake")),
                    _x(r.get(f"ray_{key}", {}).get("vs_agl_awake")),
                ]
            )
    table(
        "ours: rollouts/s, enqueue → all succeeded (higher is better)",
        [
            "agent",
            "runners × concurrency",
            "local",
            "Ray",
            "local/AGL",
            "Ray/AGL",
            "local/AGL awake",
            "Ray/AGL awake",
        ],
        rows,
    )
    if isinstance(peer, dict):
        table(
            "Agent Lightning 0.3.0: 4 runners (poll 5 s), rollouts/s",
            ["agent", "queued to sleeping runners", "all runners awake"],
            [[a, peer[a]["rollouts_per_s"], peer[f"{a}_awake"]["rollouts_per_s"]] for a in AGENTS],
        )
    lat = [
        ["ours local, 1 runner", ours_["local"]["dispatch_latency_n1"]["p50_ms"]],
        ["ours local, 4 runners", ours_["local"]["dispatch_latency_n4"]["p50_ms"]],
    ]
    if ray:
        lat.append(["ours Ray, 4 runners", ray["dispatch_latency_n4"]["p50_ms"]])
    if isinstance(peer, dict):
        lat.append(["AGL 0.3.0, 4 runners", peer["dispatch_latency"]["p50_ms"]])
    table(
        "idle-runner dispatch latency, enqueue → agent runs (lower is better)",
        ["fleet", "p50 ms"],
        lat,
    )


def main() -> dict[str, Any]:
    """Measure ours (local, Ray) and Agent Lightning side by side; write bench/results/end_to_end.json."""
    began, load_before = time.monotonic(), os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="rollfleet-e2e-")
    port = free_port()
    server = start(
        [
            PY,
            "-m",
            "rollfleet.cli",
            "serve",
            "--db",
            f"sqlite:///{tmp}/e2e.db",
            "--port",
            str(port),
        ],
        f"http://127.0.0.1:{port}/health",
    )
    try:
        figures: dict[str, Any] = {"ours": asyncio.run(ours(f"http://127.0.0.1:{port}"))}
    finally:
        stop(server)
    console.print("  Agent Lightning 0.3.0: 4 runners (startup takes a while) ...")
    figures["agentlightning_0_3_0"] = agl()
    figures["ratios"] = ratios(figures)
    figures["targets"] = targets(figures)
    figures["settings"] = {
        "store": "ours: durable SQLite behind rollfleet serve; AGL: agl store (in memory)",
        "sleep_input": AGENTS["sleep"][1],
        "scale": SCALE,
        "agl_runners": "4 × LitAgentRunner defaults (poll 5 s ± 0.5 s, 1 rollout at a time), "
        "no-op tracer",
        "agl_awake": "every AGL runner held busy until one instant T, the batch queued before "
        "T; rollouts/s from T (leaves out AGL's poll sleep)",
        "bench_seconds": round(time.monotonic() - began, 1),
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "note": "one figure per configuration per run, on a 2-core machine shared with other "
        "jobs: compare ratios within one run",
    }
    show(figures)
    return write_results("end_to_end", figures, "python -m bench end_to_end")


if __name__ == "__main__":
    main()
