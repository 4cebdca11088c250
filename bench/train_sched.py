"""The RL scheduler alone, with simulated costs: synchronous training against max_staleness K.

A trainer loop drives the real ``RolloutCoordinator`` over a real embedded SQLite store; a fleet
of asyncio workers claims rollouts (``store.claim``) and completes them after a simulated
generation time. Nothing is generated and nothing is trained: only the scheduling is real.

Per step ``s`` the trainer keeps batches ``s .. s+K+1`` submitted (the coordinator holds back,
``pending``, whatever ``max_staleness`` does not admit yet, and enqueues it when a finalize or a
push makes room), finalizes batch ``s``, "trains" for ``TRAIN_S``, "pushes weights" for
``PUSH_S`` (the engines then serve version ``s+1``) and calls ``set_policy_version(s+1)``. It calls
``set_policy_version(0)`` once before the first submit, as bounded batches require (this bench
found that guessing instead admitted work one version too early). K = 0 is the synchronous loop
(submit, finalize, train, push); K = 1, 2, 4 let the fleet generate ahead.

Costs, chosen so that overlap matters (the figures scale with them; the ratios are the point):

- generation: log-normal, median ``MEDIAN_S`` = 0.1 s, σ = 1 (mean 0.16 s; one task in a hundred
  takes over 1 s). Batches of 64 tasks, 64 workers: a batch alone keeps the fleet busy for a
  moment, then waits on its longest task (about 1 s at the median of 64 draws; 0.96 s on average
  over the 8 seeded batches): the tail that makes synchronous RL slow.
- training ``TRAIN_S`` = 0.8 s and a weight push ``PUSH_S`` = 0.2 s: together about one batch's
  generation time, so a synchronous step is about half generation, half training. If generation
  were wholly hidden a step would take train + push: the ceiling of the speed-up is the
  synchronous step over that (about 2×, reported as ``ceiling_speedup``).
- the push does not stop generation (interruptible swaps): the engines serve the new version from
  the moment it ends. A rollout's version is the one served when it was claimed (its oldest
  token); its measured staleness is the index of the finalize that consumed it minus that.
- ``min_wait_num`` = 90 % of the tasks with the default ``carry_over`` policy: a finalize may stop
  before the slowest tenth and carry it into the next one, where max_staleness allows. Under the
  bound it rarely does: a batch is admitted as soon as it can be consumed within K, so in steady
  state it is consumed at exactly K and its finalize must wait for all of it (only the first K
  batches, admitted at the start, may carry stragglers).

Every configuration runs the same seeded durations, in an order that alternates across rounds
(A B C D, D C B A, ...). After the last step one more finalize (a one-task batch) takes in the
groups still carried, if any (with these costs none are), so every finished sample is consumed;
the speed figures stop at the last step. Figures per configuration (median [min-max] over the
rounds): samples consumed per second, the step split (waiting for generation, training, pushing),
the staleness of consumed samples (measured from the claim version; and as the coordinator
recorded it), how many exceeded K, and the share of finished samples never consumed.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import median_range, write_results
from rollfleet.client import connect
from rollfleet.coordinator import BatchLifecycleState, RolloutCoordinator
from rollfleet.model import AttemptStatus, Rollout, RolloutResult
from rollfleet.store.base import Store

TASKS = 64
WORKERS = 64
STEPS = 8
MEDIAN_S = 0.1
SIGMA = 1.0
TRAIN_S = 0.8
PUSH_S = 0.2
MIN_WAIT = math.ceil(0.9 * TASKS)
KS = (0, 1, 2, 4)
ROUNDS = 3
SEED = 7  # as bench/stragglers.py
AREAL_SPEEDUP = 2.77  # AReaL (arXiv 2505.24298), abstract: "up to 2.77x" over synchronous RL


@dataclass
class Fleet:
    """The simulated engines and workers: the version served and what each rollout did."""

    served: int = 0  # the version the engines serve (set when a push ends)
    claimed_at: dict[str, int] = field(default_factory=dict)  # rollout → version at claim
    finished: set[str] = field(default_factory=set)
    busy_s: float = 0.0

    async def work(self, store: Store, rollout: Rollout) -> None:
        """Generate (sleep) for the task's duration, then complete through the store."""
        assert rollout.attempt is not None
        self.claimed_at[rollout.rollout_id] = self.served
        start = time.monotonic()
        await asyncio.sleep(rollout.input["duration"])
        self.busy_s += time.monotonic() - start
        result = RolloutResult(reward=1.0)
        await store.complete(rollout.attempt.attempt_id, AttemptStatus.SUCCEEDED, result)
        self.finished.add(rollout.rollout_id)

    async def worker(self, store: Store, name: str, done: asyncio.Event) -> None:
        while not done.is_set():
            for rollout in await store.claim(name, wait_s=0.2):
                await self.work(store, rollout)


@dataclass
class Trainer:
    """The simulated trainer: one step at a time, batches submitted ahead as K allows."""

    coord: RolloutCoordinator
    fleet: Fleet
    k: int
    plan: list[list[float]]
    submitted: int = 0
    held: int = 0  # submits answered "pending" (held back by max_staleness)
    consumed: dict[str, tuple[int, int]] = field(default_factory=dict)  # → (index, recorded)
    twice: int = 0
    phases: dict[str, list[float]] = field(
        default_factory=lambda: {"generate_wait": [], "train": [], "push": []}
    )
    carried_out: int = 0

    async def submit(
        self, batch_id: str, durations: list[float], least: int | None = MIN_WAIT
    ) -> None:
        tasks = [{"duration": d} for d in durations]
        info = await self.coord.submit_batch(batch_id, tasks, "train", min_wait_num=least)
        self.held += info.state is BatchLifecycleState.PENDING

    async def finalize(self, batch_id: str, index: int) -> None:
        result = await self.coord.finalize_train_batch(batch_id)
        self.carried_out += result.carried_out_task_count
        for rid, recorded in (await self.coord.get_batch_state(batch_id)).included.items():
            self.twice += rid in self.consumed
            self.consumed[rid] = (index, recorded)

    async def step(self, s: int) -> None:
        while self.submitted < min(len(self.plan), s + self.k + 2):
            await self.submit(f"b{self.submitted}", self.plan[self.submitted])
            self.submitted += 1
        t0 = time.monotonic()
        await self.finalize(f"b{s}", s)
        t1 = time.monotonic()
        await asyncio.sleep(TRAIN_S)
        t2 = time.monotonic()
        await asyncio.sleep(PUSH_S)
        self.fleet.served = s + 1
        await self.coord.set_policy_version(s + 1)
        t3 = time.monotonic()
        for name, span in zip(self.phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            self.phases[name].append(span)


async def run_config(k: int, plan: list[list[float]], workdir: Path) -> dict[str, Any]:
    """Train STEPS steps under max_staleness k, then consume what is still carried."""
    store = connect(f"sqlite:///{workdir}/k{k}.db")
    coord = RolloutCoordinator(
        store,
        experience_dir=workdir / "xp",
        poll_interval_s=0.02,
        collect_tokens=False,
        max_staleness=k,
    )
    fleet = Fleet()
    trainer = Trainer(coord, fleet, k, plan)
    done = asyncio.Event()
    workers = [asyncio.create_task(fleet.worker(store, f"w{i}", done)) for i in range(WORKERS)]
    try:
        await coord.set_policy_version(0)
        start = time.monotonic()
        for s in range(STEPS):
            await trainer.step(s)
        wall = time.monotonic() - start
        busy = fleet.busy_s
        in_steps = len(trainer.consumed)
        await _drain(trainer, store)
    finally:
        done.set()
        await asyncio.gather(*workers)
        await store.close()
    return _figures(trainer, k, wall, in_steps, busy)


async def _drain(trainer: Trainer, store: Store) -> None:
    """Wait for the carried groups, then finalize a one-task batch that takes them in."""
    pool = (await trainer.coord.get_batch_state(f"b{STEPS - 1}")).carry_pool
    if pool:
        await store.wait_for_rollouts([r for c in pool for r in c.rollout_ids], timeout=120)
        await trainer.submit("drain", [0.0], None)
        await trainer.finalize("drain", STEPS)


def _figures(trainer: Trainer, k: int, wall: float, in_steps: int, busy: float) -> dict[str, Any]:
    fleet = trainer.fleet
    measured = [i - fleet.claimed_at[r] for r, (i, _) in trainer.consumed.items()]
    recorded = [rec for _, rec in trainer.consumed.values()]
    never = fleet.finished - set(trainer.consumed)
    return {
        "k": k,
        "wall_s": wall,
        "samples_consumed": in_steps,
        "samples_per_s": in_steps / wall,
        "step_s": wall / STEPS,
        "phase_mean_s": {name: statistics.mean(v) for name, v in trainer.phases.items()},
        "fleet_busy_fraction": busy / (WORKERS * wall),
        "staleness_measured_mean": statistics.mean(measured),
        "staleness_measured_max": max(measured),
        "staleness_recorded_mean": statistics.mean(recorded),
        "staleness_recorded_max": max(recorded),
        "over_k_measured": sum(m > k for m in measured),
        "over_k_recorded": sum(r > k for r in recorded),
        "finished": len(fleet.finished),
        "never_consumed": len(never),
        "never_consumed_fraction": len(never) / max(1, len(fleet.finished)),
        "consumed_twice": trainer.twice,
        "submits_held": trainer.held,
        "groups_carried_out": trainer.carried_out,
        "drain_consumed": len(trainer.consumed) - in_steps,
    }


def durations(rng: random.Random) -> list[list[float]]:
    """Per batch, per task: log-normal generation times (the same for every configuration)."""
    return [
        [MEDIAN_S * math.exp(rng.gauss(0.0, SIGMA)) for _ in range(TASKS)] for _ in range(STEPS)
    ]


def ceiling(sync_run: dict[str, Any]) -> float:
    """The speed-up if generation were wholly hidden: a synchronous step over train + push."""
    phases = sync_run["phase_mean_s"]
    return float(sync_run["step_s"] / (phases["train"] + phases["push"]))


def summarize(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median [min-max] over the rounds; speed-up against K=0 within each round."""
    sync = runs[0]
    ceilings = [ceiling(s) for s in sync]
    out: dict[str, Any] = {}
    for k, rows in runs.items():
        speedups = [
            r["samples_per_s"] / s["samples_per_s"] for r, s in zip(rows, sync, strict=True)
        ]
        phases = {
            p: median_range([r["phase_mean_s"][p] for r in rows]) for p in rows[0]["phase_mean_s"]
        }
        out[str(k)] = {
            "samples_per_s": median_range([r["samples_per_s"] for r in rows]),
            "step_s": median_range([r["step_s"] for r in rows]),
            "speedup_vs_sync": median_range(speedups),
            "speedup_of_ceiling": median_range(
                [u / c for u, c in zip(speedups, ceilings, strict=True)]
            ),
            "phase_mean_s": phases,
            "fleet_busy_fraction": median_range([r["fleet_busy_fraction"] for r in rows]),
            "staleness_measured_mean": median_range([r["staleness_measured_mean"] for r in rows]),
            "staleness_measured_max": max(r["staleness_measured_max"] for r in rows),
            "staleness_recorded_max": max(r["staleness_recorded_max"] for r in rows),
            "over_k": sum(r["over_k_measured"] + r["over_k_recorded"] for r in rows),
            "never_consumed_fraction_max": max(r["never_consumed_fraction"] for r in rows),
            "consumed_twice": sum(r["consumed_twice"] for r in rows),
        }
    return out


async def compare() -> dict[str, Any]:
    """Every K on the same durations, in alternating order, ROUNDS times."""
    plan = durations(random.Random(SEED))
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in KS}
    orders = []
    with tempfile.TemporaryDirectory(prefix="rf-train-sched-") as tmp:
        for rnd in range(ROUNDS):
            order = KS if rnd % 2 == 0 else tuple(reversed(KS))
            orders.append(list(order))
            for k in order:
                workdir = Path(tmp) / f"r{rnd}"
                workdir.mkdir(exist_ok=True)
                runs[k].append(await run_config(k, plan, workdir))
    summary = summarize(runs)
    best = max(KS, key=lambda k: summary[str(k)]["speedup_vs_sync"]["median"])
    return {
        "config": {
            "tasks": TASKS,
            "workers": WORKERS,
            "steps": STEPS,
            "median_duration_s": MEDIAN_S,
            "sigma": SIGMA,
            "train_s": TRAIN_S,
            "push_s": PUSH_S,
            "min_wait_num": MIN_WAIT,
            "policy": "carry_over",
            "ks": list(KS),
            "rounds": ROUNDS,
            "orders": orders,
            "seed": SEED,
            "store": "sqlite (embedded)",
        },
        "plan": {
            "mean_duration_s": statistics.mean(d for b in plan for d in b),
            "longest_task_per_batch_s": [max(b) for b in plan],
        },
        "summary": summary,
        "ceiling_speedup": median_range([ceiling(s) for s in runs[0]]),
        "runs": {str(k): rows for k, rows in runs.items()},
        "areal": {
            "speedup": AREAL_SPEEDUP,
            "source": "AReaL, arXiv 2505.24298 (abstract)",
            "best_k": best,
            "ours_best": summary[str(best)]["speedup_vs_sync"]["median"],
        },
        "checks": {
            "over_k": sum(s["over_k"] for s in summary.values()),
            "never_consumed": sum(r["never_consumed"] for rows in runs.values() for r in rows),
            "consumed_twice": sum(s["consumed_twice"] for s in summary.values()),
        },
    }


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"train_sched: {TASKS} tasks/batch, {WORKERS} workers, log-normal "
        f"median {MEDIAN_S} s σ={SIGMA}, train {TRAIN_S} s, push {PUSH_S} s, "
        f"{ROUNDS} rounds"
    )
    for col in (
        "K",
        "samples/s",
        "speed-up",
        "gen wait s",
        "train s",
        "push s",
        "of ceiling",
        "fleet busy",
        "stale mean",
        "stale max",
        "over K",
        "never consumed",
    ):
        table.add_column(col, justify="right")
    for k, f in report["summary"].items():
        sps, up, ph = f["samples_per_s"], f["speedup_vs_sync"], f["phase_mean_s"]
        table.add_row(
            "sync" if k == "0" else k,
            f"{sps['median']:.1f} [{sps['min']:.1f}-{sps['max']:.1f}]",
            f"{up['median']:.2f}× [{up['min']:.2f}-{up['max']:.2f}]",
            f"{ph['generate_wait']['median']:.2f}",
            f"{ph['train']['median']:.2f}",
            f"{ph['push']['median']:.2f}",
            f"{f['speedup_of_ceiling']['median']:.0%}",
            f"{f['fleet_busy_fraction']['median']:.0%}",
            f"{f['staleness_measured_mean']['median']:.2f}",
            str(f["staleness_measured_max"]),
            str(f["over_k"]),
            f"{f['never_consumed_fraction_max']:.0%}",
        )
    console = Console(width=160)
    console.print(table)
    c, a, checks = report["ceiling_speedup"], report["areal"], report["checks"]
    console.print(
        f"ceiling (generation wholly hidden): {c['median']:.2f}×; best here K={a['best_k']}: "
        f"{a['ours_best']:.2f}×; AReaL reports up to {a['speedup']}× ({a['source']}, GPUs, real "
        f"generation); samples over K: {checks['over_k']}, finished never consumed: "
        f"{checks['never_consumed']}, consumed twice: {checks['consumed_twice']}"
    )


def main() -> dict[str, Any]:
    """Run the comparison, print it, write bench/results/train_sched.json, return the figures."""
    report = asyncio.run(compare())
    _print(report)
    return write_results("train_sched", report, "python -m bench.train_sched")


if __name__ == "__main__":
    main()
