"""What isolation costs: the py sandbox under bubblewrap against rlimits only (``--unsafe-sandbox``),
and what capping each sandbox as a whole (a cgroup and a tmpfs work dir) adds.

Every figure is measured on each side in alternating rounds (A B A B ...), medians with their range:

- a trivial program (``print('ok')``) run by ``Sandbox.run_code``: p50 of the wall time per run,
  so the difference is bubblewrap's start-up overhead (goal: at most 30 ms);
- scoring a correct solution against 3 tests, as the py mode does on every rollout: with the
  judge under bubblewrap, with the judge without it, and with what the sandbox did before the
  judge (one ``python -m unittest`` run reading the reward from unittest's own summary, which the
  solution could forge), so the price of an unforgeable reward is visible too;
- per sandbox caps: the same scoring, and a sandbox's start + reset + stop, with a cgroup
  (memory, pids, cpu) and a tmpfs work dir per sandbox (the default where the host allows: root,
  writable cgroups) against the same bubblewrap sandbox with both switched off (``cgroup=False,
  work_tmpfs=False``: per-process rlimits only). ``trivial/bwrap`` and ``score/judge+bwrap`` are
  that switched-off side, as before the caps existed.

Run: ``python -m bench sandbox``.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._common import table, write_results
from rollfleet.pool.providers.sandbox import Sandbox, SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxLimits

ROUNDS, RUNS = 7, 15
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = ["add(2, 3) == 5", "add(-1, 1) == 0", "add(0, 0) == 0"]
UNITTEST = (
    "import unittest\nfrom solution import *\n\n\nclass T(unittest.TestCase):\n"
    + "".join(
        f"    def test_{i}(self):\n        self.assertTrue({t})\n\n" for i, t in enumerate(TESTS)
    )
    + "\nif __name__ == '__main__':\n    unittest.main()\n"
)


async def timed(step: Callable[[], Awaitable[None]]) -> list[float]:
    """ms of each of RUNS calls of ``step``."""
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        await step()
        times.append((time.perf_counter() - started) * 1000)
    return times


async def trivial(box: Sandbox) -> list[float]:
    """ms per run of a program that prints ok."""

    async def step() -> None:
        result = await box.run_code("print('ok')")
        assert result.stdout == "ok\n", result

    return await timed(step)


async def judged(box: Sandbox) -> list[float]:
    """ms per scoring of the solution by the judge."""

    async def step() -> None:
        report = await box.run_tests(SOLUTION, TESTS)
        assert report.all_passed, report

    return await timed(step)


async def lifecycle(provider: SandboxProvider) -> list[float]:
    """ms per sandbox started, reset once and stopped."""

    async def step() -> None:
        box = await provider.start("life")
        await provider.reset(box)
        await provider.stop(box)

    return await timed(step)


async def plain_unittest(box: Sandbox) -> list[float]:
    """ms per scoring the old way: one unittest run, its summary on stderr read as the reward."""
    box.write_files({"solution.py": SOLUTION, "test_solution.py": UNITTEST})

    async def step() -> None:
        result = await box.run(box.python("-m", "unittest", "test_solution"))
        assert "Ran 3 tests" in result.stderr, result

    return await timed(step)


def spread(runs: list[float], rounds: list[float]) -> dict[str, float]:
    """p50 over every run, and the range of the rounds' p50s."""
    return {"p50": statistics.median(runs), "min": min(rounds), "max": max(rounds)}


async def measure() -> dict[str, Any]:
    """Alternate the sides over ROUNDS rounds."""
    root = Path(tempfile.mkdtemp(prefix="rollfleet-bench-sandbox-"))
    bwrap = SandboxProvider(
        SandboxLimits(isolation="bwrap", cgroup=False, work_tmpfs=False), root=root
    )
    capped = SandboxProvider(SandboxLimits(isolation="bwrap"), root=root)
    bare = SandboxProvider(
        SandboxLimits(isolation="none", cgroup=False, work_tmpfs=False), root=root
    )
    boxes = {
        "bwrap": await bwrap.start("b"),
        "capped": await capped.start("c"),
        "none": await bare.start("n"),
    }
    sides: dict[str, Callable[[], Awaitable[list[float]]]] = {
        "trivial/bwrap": lambda: trivial(boxes["bwrap"]),
        "trivial/none": lambda: trivial(boxes["none"]),
        "score/judge+bwrap": lambda: judged(boxes["bwrap"]),
        "score/judge+bwrap+cgroup": lambda: judged(boxes["capped"]),
        "score/judge+none": lambda: judged(boxes["none"]),
        "score/unittest+none": lambda: plain_unittest(boxes["none"]),
        "lifecycle/bwrap": lambda: lifecycle(bwrap),
        "lifecycle/bwrap+cgroup": lambda: lifecycle(capped),
    }
    runs: dict[str, list[float]] = {name: [] for name in sides}
    rounds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(ROUNDS):
        for name, side in sides.items():
            times = await side()
            runs[name] += times
            rounds[name].append(statistics.median(times))
    await bwrap.stop(boxes["bwrap"])
    await capped.stop(boxes["capped"])
    await bare.stop(boxes["none"])
    root.rmdir()
    return {
        "per_sandbox": capped.host_line,  # what the +cgroup side got on this host
        "cases": {
            name: {"round_p50_ms": rounds[name], **spread(runs[name], rounds[name])}
            for name in sides
        },
    }


def main() -> dict[str, Any]:
    """Measure, print and write bench/results/sandbox.json."""
    measured = asyncio.run(measure())
    figures = measured["cases"]
    overhead = figures["trivial/bwrap"]["p50"] - figures["trivial/none"]["p50"]
    caps = {
        "score_ms": figures["score/judge+bwrap+cgroup"]["p50"]
        - figures["score/judge+bwrap"]["p50"],
        "lifecycle_ms": figures["lifecycle/bwrap+cgroup"]["p50"]
        - figures["lifecycle/bwrap"]["p50"],
    }
    rows = [
        [name, f"{f['p50']:.1f} [{f['min']:.1f}-{f['max']:.1f}]"] for name, f in figures.items()
    ]
    rows.append(["bubblewrap start-up overhead (p50 difference)", f"{overhead:.1f}"])
    rows.append(["cgroup + tmpfs work dir, scoring (p50 difference)", f"{caps['score_ms']:.1f}"])
    rows.append(["cgroup + tmpfs work dir, start+reset+stop", f"{caps['lifecycle_ms']:.1f}"])
    title = f"sandbox, p50 ms per run, range of round p50s ({ROUNDS} alternating rounds x {RUNS})"
    table(title, ["case", "ms"], rows)
    print(measured["per_sandbox"])
    return write_results(
        "sandbox",
        {
            "rounds": ROUNDS,
            "runs_per_round": RUNS,
            "per_sandbox": measured["per_sandbox"],
            "cases": figures,
            "overhead_ms": overhead,
            "per_sandbox_caps_overhead_ms": caps,
        },
        "python -m bench sandbox",
    )


if __name__ == "__main__":
    main()
