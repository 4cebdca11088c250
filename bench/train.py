"""``rollfleet train`` on the real model: step time and its split, synchronous vs asynchronous.

Equal work for every side: the same steps over the same bundled arithmetic tasks (math mode,
TASKS tasks x GROUP samples a step, MAX_TOKENS tokens, LoRA r=16 on q/v, lr 5e-4, seed 0),
through the real fleet (embedded control plane, the shared llama.cpp engine, a runner process),
no evaluation. Sides: max_staleness K = 0 (synchronous: the fleet waits for the trainer), 1 and 2
(the fleet generates up to K batches ahead while the trainer trains). Rounds alternate the order
(0 1 2, 2 1 0, ...). Per side: the median step time over every step but each run's first (which
includes generating the first batches from cold), its split (waiting for the batch, training,
checkpoint, weights push and report), and samples trained per second over the whole run.

RL is not deterministic: a batch in which every group's samples scored alike has nothing to train
on and its step is short, so the sides' work differs by such steps; ``untrained_steps`` counts
them per side.

On this 2-core machine generation (llama.cpp) and training (torch) share the same two cores, so
an overlap hides at most what the other side leaves idle; the scheduler alone, with simulated
costs and nothing competing for cores, is bench/train_sched.py.

Run: ``python -m bench train`` (needs rollfleet[train] and llama-cpp-python).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench._common import ROOT, table, write_results

ROUNDS, STEPS, TASKS, GROUP, MAX_TOKENS = 2, 6, 4, 8, 48
KS = (0, 1, 2)
COMMAND = "python -m bench train"
SPLIT = ("seconds/wait", "seconds/train", "seconds/checkpoint", "seconds/sync")


def one_run(k: int, out: Path) -> dict[str, Any]:
    """Train STEPS steps with max_staleness ``k``; the step records and the run's wall time."""
    from rollfleet.run.train import train
    from rollfleet.run.train_options import TrainOptions

    opts = TrainOptions(
        mode="math",
        data=ROOT / "src" / "rollfleet" / "examples" / "arith.jsonl",
        output_dir=out,
        steps=STEPS,
        tasks_per_step=TASKS,
        group_size=GROUP,
        max_staleness=k,
        max_tokens=MAX_TOKENS,
    )
    began = time.perf_counter()
    records = asyncio.run(train(opts, Console(quiet=True)))
    return {"wall_s": time.perf_counter() - began, "steps": records}


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def side_figures(runs: list[list[dict[str, Any]]], split: tuple[str, ...]) -> dict[str, Any]:
    """One side's figures from its runs' step records: samples trained per second over each run,
    and the step time and its ``split`` over every step but each run's first (the cold one)."""
    later = [s for run in runs for s in run[1:]]
    trained = [sum(s["experiences"] for s in run) for run in runs]
    loop_s = [sum(s["seconds/step"] for s in run) for run in runs]
    return {
        "step_s": spread([s["seconds/step"] for s in later]),
        "split_s": {key: statistics.median(s[key] for s in later) for key in split},
        "samples_per_s": spread([n / t for n, t in zip(trained, loop_s, strict=True)]),
        # a batch whose groups all scored alike trains nothing: a short step, less work
        "untrained_steps": sum(not s["trained"] for run in runs for s in run),
        "runs": [[round(s["seconds/step"], 2) for s in run] for run in runs],
    }


def main() -> dict[str, Any]:
    """Measure, print, write bench/results/train.json."""
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in KS}
    orders = [list(KS) if r % 2 == 0 else list(KS)[::-1] for r in range(ROUNDS)]
    for r, order in enumerate(orders):
        for k in order:
            out = Path(tempfile.mkdtemp(prefix=f"bench-train-k{k}-"))
            try:
                found = one_run(k, out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            runs[k].append(found)
            steps = found["steps"]
            print(
                f"round {r + 1} K={k}: "
                + " ".join(f"{s['seconds/step']:.1f}" for s in steps)
                + f" s/step, wall {found['wall_s']:.0f} s"
            )
    sides: dict[str, Any] = {}
    for k in KS:
        steps = [run["steps"] for run in runs[k]]
        sides[str(k)] = {
            **side_figures(steps, SPLIT),
            "staleness_max": max(s["staleness/max"] for run in steps for s in run),
        }
    sync = sides["0"]["samples_per_s"]["median"]
    for side in sides.values():
        side["vs_sync"] = side["samples_per_s"]["median"] / sync
    table(
        f"rollfleet train, {TASKS} x {GROUP} samples a step, {MAX_TOKENS} tokens, LoRA, 2 cores",
        ["K", "step s median (min-max)", "wait / train / ckpt / sync s", "samples/s", "vs K=0"],
        [
            [
                k,
                f"{s['step_s']['median']:.1f} ({s['step_s']['min']:.1f}-{s['step_s']['max']:.1f})",
                " / ".join(f"{s['split_s'][key]:.1f}" for key in SPLIT),
                f"{s['samples_per_s']['median']:.2f}",
                f"{s['vs_sync']:.2f}x",
            ]
            for k, s in sides.items()
        ],
    )
    settings = {
        "rounds": ROUNDS,
        "orders": orders,
        "steps": STEPS,
        "tasks": TASKS,
        "group": GROUP,
        "max_tokens": MAX_TOKENS,
        "lora_rank": 16,
    }
    return write_results("train", {"settings": settings, "sides": sides}, COMMAND)


if __name__ == "__main__":
    main()
