"""Pool throughput: N=5 rollouts share M=3 instances whose task takes T and reset takes R.

Side by side in one run: rollfleet's Pool (reset in the background, per instance) and a
reimplementation of the seed's VMPoolManager design (release resets the VM while holding
the pool's one lock, so resets are serialised and allocations wait behind them). Both are
measured against the bound M/(T+R): every instance busy with a task or its own reset.

Run from the repository root: ``python -m bench.pool``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollfleet.pool.pool import Pool
from rollfleet.pool.providers.memory import MemoryEnv, MemoryProvider

N_ROLLOUTS, M_INSTANCES = 5, 3
CASES = [(0.10, 0.10), (0.05, 0.15), (0.20, 0.05)]  # (T, R) seconds
WARMUP_S, MEASURE_S = 1.0, 6.0
TARGET = 0.95
RESULTS = Path(__file__).resolve().parent / "results" / "pool.json"


class GlobalLockPool:
    """The seed's design: one lock around allocate and release, and release resets under it."""

    def __init__(self, provider: MemoryProvider, size: int) -> None:
        """Hold ``size`` instances of ``provider``."""
        self.provider, self.size = provider, size
        self._free: deque[MemoryEnv] = deque()
        self._cond = asyncio.Condition()

    async def start(self) -> None:
        """Start every instance (as the seed's initialize_pool does)."""
        for i in range(self.size):
            self._free.append(await self.provider.start(f"vm-{i}"))

    async def allocate(self) -> MemoryEnv:
        """Take a free VM under the lock, waiting while none is free."""
        async with self._cond:
            while not self._free:
                await self._cond.wait()
            return self._free.popleft()

    async def release(self, vm: MemoryEnv) -> None:
        """Revert the VM to its snapshot while holding the lock, then return it."""
        async with self._cond:
            await self.provider.reset(vm)
            self._free.append(vm)
            self._cond.notify()


async def _drive(one_task: Callable[[], Awaitable[None]]) -> float:
    """N rollout loops running ``one_task``; tasks/s inside the measuring window.

    Each loop's cycles (wait + task) tile its time; a cycle straddling a window edge counts
    for the fraction of it inside, so the rate is not quantised to whole tasks.
    """
    cycles: list[tuple[float, float]] = []
    begin = time.monotonic()
    window = (begin + WARMUP_S, begin + WARMUP_S + MEASURE_S)

    async def rollout() -> None:
        started = time.monotonic()
        while started < window[1]:
            await one_task()
            ended = time.monotonic()
            cycles.append((started, ended))
            started = ended

    await asyncio.gather(*(rollout() for _ in range(N_ROLLOUTS)))
    inside = sum(
        max(0.0, min(e, window[1]) - max(s, window[0])) / (e - s) for s, e in cycles if e > s
    )
    return inside / MEASURE_S


async def rollfleet_rate(task_s: float, reset_s: float) -> float:
    """Tasks/s through rollfleet's Pool."""
    pool = Pool(MemoryProvider(reset_s=reset_s), M_INSTANCES, name="bench")
    async with pool:
        await pool.wait_for(lambda s: s.states["IDLE"] == M_INSTANCES, 10)

        async def one_task() -> None:
            async with pool.lease():
                await asyncio.sleep(task_s)

        return await _drive(one_task)


async def global_lock_rate(task_s: float, reset_s: float) -> float:
    """Tasks/s through the seed's global-lock design."""
    pool = GlobalLockPool(MemoryProvider(reset_s=reset_s), M_INSTANCES)
    await pool.start()

    async def one_task() -> None:
        vm = await pool.allocate()
        try:
            await asyncio.sleep(task_s)
        finally:
            await pool.release(vm)

    return await _drive(one_task)


def machine() -> dict[str, Any]:
    """Where the figures were taken."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def run_case(task_s: float, reset_s: float) -> dict[str, float]:
    """Both designs for one (T, R), against the bound."""
    bound = M_INSTANCES / (task_s + reset_s)
    ours = asyncio.run(rollfleet_rate(task_s, reset_s))
    seed = asyncio.run(global_lock_rate(task_s, reset_s))
    return {
        "task_s": task_s,
        "reset_s": reset_s,
        "bound_tasks_per_s": round(bound, 3),
        "rollfleet_tasks_per_s": round(ours, 3),
        "global_lock_tasks_per_s": round(seed, 3),
        "rollfleet_vs_bound": round(ours / bound, 3),
        "rollfleet_vs_global_lock": round(ours / seed, 3) if seed else float("inf"),
    }


def main() -> dict[str, Any]:
    """Run every case, print a table, write bench/results/pool.json, return the figures."""
    console = Console()
    rows = [run_case(t, r) for t, r in CASES]
    table = Table(title=f"pool: N={N_ROLLOUTS} rollouts, M={M_INSTANCES} instances (tasks/s)")
    for column in (
        "T (s)",
        "R (s)",
        "bound M/(T+R)",
        "rollfleet",
        "seed global lock",
        "rollfleet / bound",
        "rollfleet / global lock",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            *(
                f"{row[k]:.2f}"
                for k in (
                    "task_s",
                    "reset_s",
                    "bound_tasks_per_s",
                    "rollfleet_tasks_per_s",
                    "global_lock_tasks_per_s",
                    "rollfleet_vs_bound",
                    "rollfleet_vs_global_lock",
                )
            )
        )
    console.print(table)
    result = {
        "bench": "pool",
        "command": "python -m bench.pool",
        "n_rollouts": N_ROLLOUTS,
        "m_instances": M_INSTANCES,
        "warmup_s": WARMUP_S,
        "measure_s": MEASURE_S,
        "target_vs_bound": TARGET,
        "met": all(r["rollfleet_vs_bound"] >= TARGET for r in rows),
        "cases": rows,
        "machine": machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
