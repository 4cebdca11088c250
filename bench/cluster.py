"""Cluster layer benchmark: rollfleet.cluster vs raw Ray vs RLinf 0.3.0, side by side in one run.

Figures: group no-op call latency (ours vs a raw Ray actor call on the same actor), Channel
throughput for small items (items/s) and 1 MiB items (MB/s), ours vs RLinf's Channel with the
same producer/consumer pattern. RLinf runs in a subprocess with ``<repo>/.venv-peers/bin/python``
(RAY_ADDRESS=local, a private RAY_TMPDIR); when it is missing the peer is recorded as not installed.

Both sides move the same number of items (N_SMALL small, N_BIG big) in every flow, and the sides
alternate: a round measures ours (a fresh cluster), then RLinf (a fresh subprocess), ROUNDS times;
the figures are medians over the rounds with their range.

Run: ``python -m bench.cluster`` from the repository root.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "cluster.json"
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
SMALL = b"x" * 64
BIG_BYTES = 1 << 20
N_CALLS = 1500  # group calls, alternating with as many raw Ray calls
N_SMALL, N_BIG = 1000, 100  # items per flow, the same for both sides
ROUNDS = 3  # ours, RLinf, ours, RLinf, ...

# The same producer/consumer pattern, in RLinf's API, run by the peer venv's python.
RLINF_SCRIPT = r"""
import json, sys, time
from rlinf.scheduler import Channel, Cluster, NodePlacementStrategy, Worker

class Producer(Worker):
    def __init__(self):
        super().__init__()
    def noop(self):
        return None
    def produce(self, channel, n, size):
        payload = b"x" * size
        for _ in range(n):
            channel.put(payload)

class Consumer(Worker):
    def __init__(self):
        super().__init__()
    def consume(self, channel, n):
        for _ in range(n):
            channel.get()

def flow(p, c, ch, n, size):
    start = time.perf_counter()
    r1, r2 = p.produce(ch, n, size), c.consume(ch, n)
    r1.wait(); r2.wait()
    return time.perf_counter() - start

n_small, n_big, n_calls = (int(a) for a in sys.argv[1:4])
cluster = Cluster(num_nodes=1)
placement = NodePlacementStrategy(node_ranks=[0])
p = Producer.create_group().launch(cluster, name="bench_producer", placement_strategy=placement)
c = Consumer.create_group().launch(cluster, name="bench_consumer", placement_strategy=placement)
ch = Channel.create(name="bench_channel")
p.noop().wait()
calls = []
for _ in range(n_calls):
    start = time.perf_counter()
    p.noop().wait()
    calls.append(time.perf_counter() - start)
call_ms = sorted(calls)[len(calls) // 2] * 1e3
flow(p, c, ch, 20, 64)
flow(p, c, ch, 20, 1 << 20)
small = n_small / flow(p, c, ch, n_small, 64)
big = n_big * 1.048576 / flow(p, c, ch, n_big, 1 << 20)
print("RESULT " + json.dumps({"group_call_ms": call_ms, "small_items_per_s": small,
      "big_mb_per_s": big, "n_small": n_small, "n_big": n_big}), flush=True)
"""


def _ours() -> dict[str, Any]:
    """Measure rollfleet.cluster and raw Ray in this process."""
    import ray

    from rollfleet.cluster import Cluster, CpuPlacement, Worker, create_channel

    class Node(Worker):
        def noop(self) -> None:
            return None

        def produce(self, channel: Any, n: int, size: int) -> None:
            payload = b"x" * size
            for _ in range(n):
                channel.put(payload)

        def consume(self, channel: Any, n: int) -> None:
            for _ in range(n):
                channel.get()

    cluster = Cluster()
    try:
        producer = Node.create_group().launch(cluster, CpuPlacement(1), name="bench_producer")
        consumer = Node.create_group().launch(cluster, CpuPlacement(1), name="bench_consumer")
        raw = producer.handles[0]
        ours_ms, raw_ms = _paired(
            lambda: producer.noop().wait(), lambda: ray.get(raw.noop.remote()), N_CALLS
        )
        channel = create_channel("bench_channel")
        _flow(producer, consumer, channel, 20, 64)
        _flow(producer, consumer, channel, 20, BIG_BYTES)
        small = N_SMALL / _flow(producer, consumer, channel, N_SMALL, 64)
        big = N_BIG * BIG_BYTES / 1e6 / _flow(producer, consumer, channel, N_BIG, BIG_BYTES)
        by_ref = create_channel(
            "bench_channel_by_ref", inline_limit=64 * 1024
        )  # every 1 MiB item by reference
        _flow(producer, consumer, by_ref, 20, BIG_BYTES)
        big_ref = N_BIG * BIG_BYTES / 1e6 / _flow(producer, consumer, by_ref, N_BIG, BIG_BYTES)
        return {
            "group_call_ms": ours_ms,
            "raw_ray_call_ms": raw_ms,
            "small_items_per_s": small,
            "big_mb_per_s": big,
            "big_by_reference_mb_per_s": big_ref,
            "n_small": N_SMALL,
            "n_big": N_BIG,
        }
    finally:
        cluster.shutdown()


def _paired(ours: Any, raw: Any, n: int) -> tuple[float, float]:
    """Median milliseconds per call of ``ours`` and ``raw``, called alternately ``n`` times each.

    Alternating call by call puts both under the same machine load; the median ignores the
    bursts of a shared 2-core machine.
    """
    ours(), raw()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(n):
        for side, fn in ((i % 2, (ours, raw)[i % 2]), (1 - i % 2, (ours, raw)[1 - i % 2])):
            start = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def _flow(producer: Any, consumer: Any, channel: Any, n: int, size: int) -> float:
    """Seconds for one producer rank to put and one consumer rank to get ``n`` items."""
    start = time.perf_counter()
    put, got = producer.produce(channel, n, size), consumer.consume(channel, n)
    put.wait()
    got.wait()
    return time.perf_counter() - start


def _rlinf() -> dict[str, Any]:
    """Run the RLinf side in the peer venv; a dict with ``status`` and its figures."""
    if not PEER_PYTHON.exists():
        return {"status": f"not installed ({PEER_PYTHON} missing)"}
    version = subprocess.run(
        [str(PEER_PYTHON), "-c", "import importlib.metadata as m; print(m.version('rlinf'))"],
        capture_output=True,
        text=True,
    )
    if version.returncode != 0:
        return {"status": "not installed (rlinf missing from .venv-peers)"}
    with tempfile.TemporaryDirectory(prefix="rfb", dir="/tmp") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
        env |= {"RAY_ADDRESS": "local", "RAY_TMPDIR": tmp}
        args = [str(PEER_PYTHON), "-c", RLINF_SCRIPT, str(N_SMALL), str(N_BIG), str(N_CALLS)]
        proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"status": f"failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"}
    return {"status": f"rlinf {version.stdout.strip()}", **json.loads(lines[-1][len("RESULT ") :])}


def _machine() -> dict[str, Any]:
    import ray
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "ray": ray.__version__,
        "torch": torch.__version__,
    }


def _ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"group_call_vs_raw_ray": ours["group_call_ms"] / ours["raw_ray_call_ms"]}
    if "small_items_per_s" in peer:
        out["small_items_vs_rlinf"] = ours["small_items_per_s"] / peer["small_items_per_s"]
        out["big_mb_vs_rlinf"] = ours["big_mb_per_s"] / peer["big_mb_per_s"]
        out["big_by_reference_mb_vs_rlinf"] = (
            ours["big_by_reference_mb_per_s"] / peer["big_mb_per_s"]
        )
    out["targets"] = {
        "group_call_within_10pct_of_raw_ray": out["group_call_vs_raw_ray"] <= 1.10,
        "small_items_10x_rlinf": out.get("small_items_vs_rlinf", 0) >= 10,
        "big_mb_3x_rlinf": out.get("big_mb_vs_rlinf", 0) >= 3,
    }
    return out


def _table(ours: dict[str, Any], peer: dict[str, Any], ratios: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollfleet.cluster vs raw Ray vs RLinf 0.3.0")
    for col in ("figure", "rollfleet", "raw Ray", "RLinf", "ratio"):
        table.add_column(col)

    def fmt(v: Any) -> str:
        return f"{v:,.2f}" if isinstance(v, float) else "-"

    table.add_row(
        "group no-op call (ms)",
        fmt(ours["group_call_ms"]),
        fmt(ours["raw_ray_call_ms"]),
        fmt(peer.get("group_call_ms")),
        f"{ratios['group_call_vs_raw_ray']:.2f}x raw",
    )
    table.add_row(
        "channel small items/s",
        fmt(ours["small_items_per_s"]),
        "-",
        fmt(peer.get("small_items_per_s")),
        f"{ratios.get('small_items_vs_rlinf', 0):.1f}x RLinf",
    )
    table.add_row(
        "channel 1 MiB items MB/s",
        fmt(ours["big_mb_per_s"]),
        "-",
        fmt(peer.get("big_mb_per_s")),
        f"{ratios.get('big_mb_vs_rlinf', 0):.1f}x RLinf",
    )
    table.add_row(
        "  same, forced by reference",
        fmt(ours["big_by_reference_mb_per_s"]),
        "-",
        fmt(peer.get("big_mb_per_s")),
        f"{ratios.get('big_by_reference_mb_vs_rlinf', 0):.1f}x RLinf",
    )
    Console().print(table)
    Console().print(f"RLinf: {peer['status']}")


FIGURES = (
    "group_call_ms",
    "raw_ray_call_ms",
    "small_items_per_s",
    "big_mb_per_s",
    "big_by_reference_mb_per_s",
)


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, and its range under ``<figure>_range``."""
    out: dict[str, Any] = {"rounds": rounds}
    for key in FIGURES:
        values = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_range"] = [min(values), max(values)]
    return out


def main() -> dict[str, Any]:
    """Alternate both sides over ROUNDS rounds, print the table, write bench/results/cluster.json."""
    from rich.progress import Progress

    ours_rounds: list[dict[str, Any]] = []
    peer_rounds: list[dict[str, Any]] = []
    with Progress(transient=True) as progress:
        task = progress.add_task("rollfleet.cluster / RLinf rounds", total=2 * ROUNDS)
        for _ in range(ROUNDS):
            ours_rounds.append(_ours())
            progress.update(task, advance=1)
            peer_rounds.append(_rlinf())
            progress.update(task, advance=1)
    ours = {**_medians(ours_rounds), "n_small": N_SMALL, "n_big": N_BIG}
    peer = {
        **_medians([r for r in peer_rounds if "small_items_per_s" in r]),
        "status": peer_rounds[-1]["status"],
        "n_small": N_SMALL,
        "n_big": N_BIG,
    }
    ratios = _ratios(ours, peer)
    result = {
        "ours": ours,
        "rlinf": peer,
        "ratios": ratios,
        "rounds": ROUNDS,
        "machine": _machine(),
        "command": "python -m bench.cluster",
        "peer_install": ".venv-peers/bin/pip install torch==2.13.0 'ray[default]' omegaconf hydra-core numpy pyyaml "
        "aiohttp requests filelock packaging sortedcontainers && .venv-peers/bin/pip install --no-deps rlinf==0.3.0",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _table(ours, peer, ratios)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
