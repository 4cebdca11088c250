"""An OpenEnv environment through rollfleet's ``openenv`` mode against OpenEnv's own client.

The environment is the guess-the-number server of tests/openenv_env.py (openenv-core's own
server, in a subprocess). A fixed scripted episode, no model: reset with a seed, three wrong
guesses, the right one (done). Driven two ways, alternating A B A B over ROUNDS rounds:
- rollfleet: ``OpenEnvMode(url).open(task)``, ``session.call("step", …)`` per guess,
  ``session.score`` (the episode's reward, summed from the server's observations);
- openenv: ``GenericEnvClient`` (``async with``: connect, ``reset``, ``step`` per guess, close),
  the rewards summed by hand.
Figures: step latency p50 and p99 (ms, each ``call``/``step`` round trip, per round), and
episodes per second with one episode at a time and CONCURRENT at once; medians over the rounds
with their range. Both ways must reach the same reward. Where they differ: the mode's
connections do not compress (OpenEnv's client negotiates permessage-deflate); the mode lets the
server close a finished session, while OpenEnv's client closes first, which makes OpenEnv's
server log a ClientDisconnected traceback per episode (on the same cores: it weighs on the
episode rates, not on the step latencies); and the mode reads the action schema once per
process, turns each observation into the model's text and keeps the rewards. Needs
openenv-core. Run: ``python -m bench envs``.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench._common import ROOT, free_port, median_range, start, stop, table, write_results

ROUNDS, EPISODES, CONCURRENT = 5, 100, 8
SEED = 11
Driver = Callable[[str, list[float]], Awaitable[float]]


def script() -> list[int]:
    """Three wrong guesses, then the right one."""
    sys.path.insert(0, str(ROOT / "tests"))
    from openenv_env import target_of

    right = target_of(SEED)
    return [g for g in range(1, 11) if g != right][:3] + [right]


GUESSES: list[int] = []


async def rollfleet_episode(url: str, steps_ms: list[float]) -> float:
    """One episode through the openenv mode's session; its reward."""
    from rollfleet.envs.openenv import OpenEnvMode

    session = await OpenEnvMode(url).open({"seed": SEED}, None)
    for guess in GUESSES:
        started = time.perf_counter()
        await session.call("step", {"guess": guess})
        steps_ms.append((time.perf_counter() - started) * 1e3)
    return (await session.score("")).reward


async def openenv_episode(url: str, steps_ms: list[float]) -> float:
    """One episode through OpenEnv's own client loop; the sum of its rewards."""
    from openenv.core.generic_client import GenericEnvClient

    async with GenericEnvClient(base_url=url) as env:
        rewards = [(await env.reset(seed=SEED)).reward or 0.0]
        for guess in GUESSES:
            started = time.perf_counter()
            result = await env.step({"guess": guess})
            steps_ms.append((time.perf_counter() - started) * 1e3)
            rewards.append(result.reward or 0.0)
    return math.fsum(rewards)


async def episodes(drive: Driver, url: str, at_once: int) -> tuple[float, list[float], set[float]]:
    """EPISODES episodes, ``at_once`` at a time: (episodes/s, step ms, rewards seen)."""
    steps_ms: list[float] = []
    gate = asyncio.Semaphore(at_once)

    async def one() -> float:
        async with gate:
            return await drive(url, steps_ms)

    started = time.perf_counter()
    rewards = await asyncio.gather(*(one() for _ in range(EPISODES)))
    return EPISODES / (time.perf_counter() - started), steps_ms, {round(r, 9) for r in rewards}


def spread(figure: dict[str, float], digits: int) -> str:
    """``median [min-max]``."""
    return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def measure(url: str) -> dict[str, Any]:
    """Both ways, alternating, each round at one episode at a time and CONCURRENT at once."""
    ways: dict[str, Driver] = {"rollfleet": rollfleet_episode, "openenv": openenv_episode}
    runs: dict[str, Any] = {
        key: {w: [] for w in ways} for key in ("p50_ms", "p99_ms", "eps_1", f"eps_{CONCURRENT}")
    }
    rewards: set[float] = set()
    for drive in ways.values():  # warm both: imports, the schema cache, the server's paths
        await episodes(drive, url, 1)
    for _ in range(ROUNDS):
        for way, drive in ways.items():
            per_s, steps_ms, seen = await episodes(drive, url, 1)
            runs["eps_1"][way].append(per_s)
            runs["p50_ms"][way].append(statistics.median(steps_ms))
            runs["p99_ms"][way].append(p99(steps_ms))
            per_s, _, more = await episodes(drive, url, CONCURRENT)
            runs[f"eps_{CONCURRENT}"][way].append(per_s)
            rewards |= seen | more
    if len(rewards) != 1:
        raise AssertionError(f"the two ways reached different rewards: {sorted(rewards)}")
    return {"runs": runs, "reward": rewards.pop()}


def main() -> dict[str, Any]:
    """Serve the guess environment, drive it both ways, write bench/results/envs.json."""
    GUESSES[:] = script()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start(
        [
            sys.executable,
            str(ROOT / "tests" / "openenv_env.py"),
            "--port",
            str(port),
            "--max-sessions",
            str(CONCURRENT),
        ],
        f"{url}/health",
    )
    try:
        measured = asyncio.run(measure(url))
    finally:
        stop(server)
    runs = measured["runs"]
    figures: dict[str, Any] = {
        "rounds": ROUNDS,
        "episodes": EPISODES,
        "steps_per_episode": len(GUESSES),
        "concurrent": CONCURRENT,
        "reward": measured["reward"],
    }
    rows = []
    for key, label, digits in (
        ("p50_ms", "step ms, p50", 3),
        ("p99_ms", "step ms, p99", 3),
        ("eps_1", "episodes/s, one at a time", 1),
        (f"eps_{CONCURRENT}", f"episodes/s, {CONCURRENT} at once", 1),
    ):
        ours, theirs = median_range(runs[key]["rollfleet"]), median_range(runs[key]["openenv"])
        figures[key] = {"rollfleet": ours, "openenv": theirs, "runs": runs[key]}
        rows.append(
            [
                label,
                spread(ours, digits),
                spread(theirs, digits),
                f"{ours['median'] / theirs['median']:.2f}x",
            ]
        )
    table(
        f"an OpenEnv server, {len(GUESSES)}-step scripted episodes ({ROUNDS} alternating rounds)",
        ["figure", "rollfleet openenv mode", "OpenEnv GenericEnvClient", "rollfleet / openenv"],
        rows,
    )
    return write_results("envs", figures, "python -m bench envs")


if __name__ == "__main__":
    main()
