"""Straggler policies side by side: step time and finished work kept for wait, cancel and carry_over.

Each policy runs the same sequence of train batches (64 tasks, log-normal durations with σ = 1,
the same durations for every policy) on its own embedded SQLite store, executed by 64 concurrent
asyncio workers that claim, work for the task's duration, and complete through the real store.
Cancelled rollouts are stopped at once through the coordinator's abort hook (as the gateway would).
``cancel`` and ``carry_over`` finalize at min_wait_num = 90 % of the tasks; ``wait`` waits for all.

Figures per policy: step time (submit → finalize returned), tasks delivered per step, the fraction
of executed work (worker-seconds) whose result was kept, and the fraction of finished results kept.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rollfleet.client import connect
from rollfleet.coordinator import RolloutCoordinator, StragglerPolicy
from rollfleet.errors import Conflict
from rollfleet.model import AttemptStatus, RolloutResult, RolloutStatus
from rollfleet.store.base import Store

TASKS = 64
STEPS = 12
WORKERS = 64
MEDIAN_S = 0.2
SIGMA = 1.0
MIN_WAIT = math.ceil(0.9 * TASKS)
SEED = 7
POLICIES = (StragglerPolicy.WAIT, StragglerPolicy.CANCEL, StragglerPolicy.CARRY_OVER)
RESULT = Path(__file__).parent / "results" / "stragglers.json"


@dataclass
class Ledger:
    """What the workers did: seconds worked per rollout, and which ended with a stored result."""

    worked: dict[str, float] = field(default_factory=dict)
    succeeded: set[str] = field(default_factory=set)
    aborts: dict[str, asyncio.Event] = field(default_factory=dict)

    async def abort(self, rollout_id: str) -> None:
        """The abort hook: stop the worker running this rollout now."""
        self.aborts.setdefault(rollout_id, asyncio.Event()).set()


async def _work(store: Store, ledger: Ledger, rollout: Any) -> None:
    rid = rollout.rollout_id
    stop = ledger.aborts.setdefault(rid, asyncio.Event())
    start = time.monotonic()
    try:
        await asyncio.wait_for(stop.wait(), rollout.input["duration"])
    except TimeoutError:
        pass
    ledger.worked[rid] = ledger.worked.get(rid, 0.0) + time.monotonic() - start
    if stop.is_set():
        return
    try:
        await store.complete(
            rollout.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
        )
        ledger.succeeded.add(rid)
    except Conflict:  # cancelled while finishing: the work is lost
        pass


async def _worker(store: Store, ledger: Ledger, name: str, done: asyncio.Event) -> None:
    while not done.is_set():
        for rollout in await store.claim(name, wait_s=0.2):
            await _work(store, ledger, rollout)


def durations(rng: random.Random) -> list[list[float]]:
    """Per step, per task: log-normal durations with the configured median and σ."""
    return [
        [MEDIAN_S * math.exp(rng.gauss(0.0, SIGMA)) for _ in range(TASKS)] for _ in range(STEPS)
    ]


async def run_policy(
    policy: StragglerPolicy, plan: list[list[float]], workdir: Path
) -> dict[str, Any]:
    """Run every step under one policy; return its figures."""
    store = connect(f"sqlite:///{workdir}/{policy.value}.db")
    ledger = Ledger()
    coord = RolloutCoordinator(
        store, abort_hook=ledger.abort, poll_interval_s=0.02, collect_tokens=False
    )
    done = asyncio.Event()
    workers = [asyncio.create_task(_worker(store, ledger, f"w{i}", done)) for i in range(WORKERS)]
    steps, delivered, staleness, used = [], [], [], set()
    try:
        for step, plan_step in enumerate(plan):
            t0 = time.monotonic()
            batch_id = f"{policy.value}-{step}"
            await coord.submit_batch(
                batch_id,
                [{"duration": d} for d in plan_step],
                "train",
                min_wait_num=None if policy is StragglerPolicy.WAIT else MIN_WAIT,
                policy=policy,
            )
            result = await coord.finalize_train_batch(batch_id)
            steps.append(time.monotonic() - t0)
            batch = await coord.get_batch_state(batch_id)
            used.update(batch.included)
            delivered.append(result.rollouts_by_status[RolloutStatus.SUCCEEDED])
            staleness.extend(batch.included.values())
        pending = {
            r
            for c in (await coord.get_batch_state(f"{policy.value}-{STEPS - 1}")).carry_pool
            for r in c.rollout_ids
        }
        await _drain(store, pending)
    finally:
        done.set()
        await asyncio.gather(*workers)
        await store.close()
    executed = sum(ledger.worked.values())
    kept = sum(ledger.worked[r] for r in ledger.succeeded)
    finished_kept = len(ledger.succeeded & (used | pending)) / max(1, len(ledger.succeeded))
    return {
        "policy": policy.value,
        "step_time_mean_s": statistics.mean(steps),
        "step_time_p50_s": statistics.median(steps),
        "step_time_max_s": max(steps),
        "total_s": sum(steps),
        "results_per_step_mean": statistics.mean(delivered),
        "work_executed_s": executed,
        "work_kept_s": kept,
        "work_kept_fraction": kept / executed,
        "finished_results_kept_fraction": finished_kept,
        "carried_results_pending_at_end": len(pending),
        "staleness_mean": statistics.mean(staleness) if staleness else 0.0,
    }


async def _drain(store: Store, pending: set[str]) -> None:
    """Let carried stragglers finish so their work is counted (they would join the next step)."""
    if pending:
        rollouts = await store.wait_for_rollouts(sorted(pending), timeout=120)
        assert all(r.status is RolloutStatus.SUCCEEDED for r in rollouts)


async def compare() -> dict[str, Any]:
    """Run the three policies on the same durations, one after another."""
    plan = durations(random.Random(SEED))
    with tempfile.TemporaryDirectory(prefix="rf-stragglers-") as tmp:
        rows = [await run_policy(p, plan, Path(tmp)) for p in POLICIES]
    by = {r["policy"]: r for r in rows}
    wait = by["wait"]["step_time_mean_s"]
    for r in rows:
        r["speedup_vs_wait"] = wait / r["step_time_mean_s"]
    return {
        "benchmark": "stragglers",
        "command": "python -m bench.stragglers",
        "config": {
            "tasks": TASKS,
            "steps": STEPS,
            "workers": WORKERS,
            "median_duration_s": MEDIAN_S,
            "sigma": SIGMA,
            "min_wait_num": MIN_WAIT,
            "seed": SEED,
            "store": "sqlite (embedded)",
        },
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "results": rows,
        "target": {
            "carry_over_speedup_vs_wait_at_least": 2.0,
            "carry_over_work_kept_fraction": 1.0,
            "met": by["carry_over"]["speedup_vs_wait"] >= 2.0
            and by["carry_over"]["work_kept_fraction"] == 1.0,
        },
    }


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"stragglers: {TASKS} tasks/step, log-normal σ={SIGMA}, min_wait_num={MIN_WAIT}"
    )
    for col in (
        "policy",
        "step mean s",
        "step p50 s",
        "step max s",
        "speedup",
        "results/step",
        "work kept",
        "finished kept",
        "staleness",
    ):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            r["policy"],
            f"{r['step_time_mean_s']:.2f}",
            f"{r['step_time_p50_s']:.2f}",
            f"{r['step_time_max_s']:.2f}",
            f"{r['speedup_vs_wait']:.2f}×",
            f"{r['results_per_step_mean']:.1f}",
            f"{r['work_kept_fraction']:.1%}",
            f"{r['finished_results_kept_fraction']:.0%}",
            f"{r['staleness_mean']:.2f}",
        )
    Console(width=130).print(table)


def main() -> dict[str, Any]:
    """Run the comparison, print it, write bench/results/stragglers.json and return the figures."""
    report = asyncio.run(compare())
    _print(report)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report


if __name__ == "__main__":
    main()
