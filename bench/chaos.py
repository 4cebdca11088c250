"""Throughput under chaos (issue 21): the same 1,000 sleep rollouts (0.2–1.5 s) on 4 runners x 4,
without kills and with a runner SIGKILLed after each random interval (exponential, mean 2 s) plus
the server killed and restarted once at 20 % done. Alternating rounds (calm, chaos, calm, chaos…),
the same rollout durations for both sides of a round; medians with their range.

``python -m bench chaos [rounds]`` writes bench/results/chaos.json.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._common import table, write_results
from rollfleet.chaos import ChaosOptions, ChaosReport, run_chaos

ROUNDS = 3
SIDES = {
    "calm": ChaosOptions(kill_mean_s=0.0, restart_server_at=None),
    "chaos": ChaosOptions(kill_mean_s=2.0, restart_server_at=0.2),
}


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(runs: list[ChaosReport]) -> dict[str, Any]:
    """One side's figures over its rounds."""
    return {
        "throughput_per_s": spread([r.throughput for r in runs]),
        "seconds": spread([r.seconds for r in runs]),
        "succeeded": [r.succeeded for r in runs],
        "failed": [len(r.failed) for r in runs],
        "not_finished": [r.open for r in runs],
        "succeeded_twice": [len(r.succeeded_twice) for r in runs],
        "lost_attempts": [r.lost for r in runs],
        "kills": [r.kills for r in runs],
        "max_lost_one_rollout": [r.max_lost_one_rollout for r in runs],
        "restarts": [r.restarts for r in runs],
        "runs": [{**asdict(r), "throughput": r.throughput} for r in runs],
    }


async def measure(rounds: int) -> dict[str, Any]:
    """Alternate the sides ``rounds`` times; the seed changes per round, not per side."""
    runs: dict[str, list[ChaosReport]] = {name: [] for name in SIDES}
    for i in range(rounds):
        for name, options in SIDES.items():
            with tempfile.TemporaryDirectory() as tmp:
                opts = ChaosOptions(**{**asdict(options), "seed": i})
                report = await run_chaos(opts, Path(tmp))
            runs[name].append(report)
            print(
                f"round {i + 1} {name}: {report.succeeded} succeeded in {report.seconds:.1f} s "
                f"({report.throughput:.1f}/s), {report.kills} kills, {report.lost} lost attempts, "
                f"{len(report.failed)} failed",
                flush=True,
            )
    sides = {name: summary(r) for name, r in runs.items()}
    ratio = (
        sides["chaos"]["throughput_per_s"]["median"] / sides["calm"]["throughput_per_s"]["median"]
    )
    return {
        "settings": {**asdict(SIDES["chaos"]), "rounds": rounds},
        "sides": sides,
        "chaos_vs_calm": ratio,
    }


def main() -> None:
    """Run, print and write bench/results/chaos.json."""
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else ROUNDS
    figures = asyncio.run(measure(rounds))
    doc = write_results("chaos", figures, f"python -m bench chaos {rounds}")
    rows = [
        [
            name,
            f"{s['throughput_per_s']['median']:.1f} [{s['throughput_per_s']['min']:.1f}–"
            f"{s['throughput_per_s']['max']:.1f}]",
            f"{s['seconds']['median']:.0f}",
            sum(s["failed"]),
            sum(s["succeeded_twice"]),
            sum(s["kills"]),
            sum(s["lost_attempts"]),
        ]
        for name, s in doc["sides"].items()
    ]
    table(
        "chaos: 1,000 rollouts, 4 runners x 4",
        ["side", "rollouts/s median [range]", "s", "failed", "twice", "kills", "lost"],
        rows,
    )
    print(f"chaos / calm throughput: {doc['chaos_vs_calm']:.2f}")


if __name__ == "__main__":
    main()
