"""Cores by phase under asynchronous training: ``rollfleet train`` at max_staleness K=1 with its
cores split between the engine and the trainer (half each) against every core given to both
(llama.cpp and torch each take all of them while they overlap: the default,
``TrainOptions.cores_by_phase``, chosen by this measurement).

Equal work for both sides: the same STEPS steps over the bundled arithmetic tasks (math mode,
TASKS x GROUP samples a step, MAX_TOKENS tokens, LoRA r=16 on q/v, lr 5e-4, seed 0), through the
real fleet (embedded control plane, the shared llama.cpp engine, a runner process), no
evaluation; rounds alternate the order (split shared, shared split, ...). Per side: samples
trained per second over the steps, and the median step's split (wait / train / sync) over every
step but each run's first.

Run: ``python -m bench train_threads`` (needs rollfleet[train] and llama-cpp-python).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from bench._common import ROOT, table, write_results
from bench.train import side_figures

ROUNDS, STEPS, TASKS, GROUP, MAX_TOKENS, K = 2, 4, 4, 8, 48, 1
COMMAND = "python -m bench train_threads"
SPLIT = ("seconds/wait", "seconds/train", "seconds/sync")


def one_run(side: str, out: Path) -> list[dict[str, Any]]:
    """Train STEPS steps at K=1, the cores split (``split``) or all given to both (``shared``)."""
    from rollfleet.run.train import train
    from rollfleet.run.train_options import TrainOptions

    cores = len(os.sched_getaffinity(0))
    engine = max(1, cores // 2) if side == "split" else cores
    opts = TrainOptions(
        mode="math",
        data=ROOT / "src" / "rollfleet" / "examples" / "arith.jsonl",
        output_dir=out,
        steps=STEPS,
        tasks_per_step=TASKS,
        group_size=GROUP,
        max_staleness=K,
        max_tokens=MAX_TOKENS,
        trainer_threads=max(1, cores - engine) if side == "split" else cores,
        extra={"engine_threads": engine},
    )
    return asyncio.run(train(opts, Console(quiet=True)))


def main() -> dict[str, Any]:
    """Measure, print, write bench/results/train_threads.json."""
    sides = ("split", "shared")
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in sides}
    orders = [list(sides) if r % 2 == 0 else list(sides)[::-1] for r in range(ROUNDS)]
    for r, order in enumerate(orders):
        for side in order:
            out = Path(tempfile.mkdtemp(prefix=f"bench-threads-{side}-"))
            try:
                steps = one_run(side, out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            runs[side].append(steps)
            print(f"round {r + 1} {side}: " + " ".join(f"{s['seconds/step']:.1f}" for s in steps))
            sys.stdout.flush()
    found = {side: side_figures(runs[side], SPLIT) for side in sides}
    ratio = found["split"]["samples_per_s"]["median"] / found["shared"]["samples_per_s"]["median"]
    cores = len(os.sched_getaffinity(0))
    engine = max(1, cores // 2)
    table(
        f"rollfleet train K={K}, {TASKS} x {GROUP} samples a step, {cores} cores",
        ["side", "samples/s", "step s", "wait / train / sync s"],
        [
            [
                side,
                f"{f['samples_per_s']['median']:.2f}",
                f"{f['step_s']['median']:.1f}",
                " / ".join(f"{f['split_s'][k]:.1f}" for k in SPLIT),
            ]
            for side, f in found.items()
        ],
    )
    settings = {
        "rounds": ROUNDS,
        "orders": orders,
        "steps": STEPS,
        "tasks": TASKS,
        "group": GROUP,
        "max_tokens": MAX_TOKENS,
        "max_staleness": K,
        "cores": cores,
        "split": {"engine_threads": engine, "trainer_threads": max(1, cores - engine)},
        "shared": {"engine_threads": cores, "trainer_threads": cores},
    }
    return write_results(
        "train_threads",
        {"settings": settings, "sides": found, "split_vs_shared": ratio},
        COMMAND,
    )


if __name__ == "__main__":
    main()
