"""Chaos runs: sleep rollouts through ``rollfleet serve`` and a local fleet whose runners are
SIGKILLed at random intervals, and whose server is killed and restarted once.

What an operator on preemptible machines sees, measured: how many rollouts succeed, how many
attempts die with their runners, and the throughput next to the same run without kills
(``bench/chaos.py``; the acceptance test in tests/acceptance/test_runner_chaos.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.client import HttpStore
from rollfleet.model import RolloutSpec
from rollfleet.runner.local import LocalFleet
from rollfleet.testing import ServeProcess

SLEEP_AGENT = "rollfleet.agents.sleep"
SCRIPTED_AGENT = "rollfleet.agents.scripted"


@dataclass(frozen=True)
class ChaosOptions:
    """One chaos run: the work, the fleet and what is killed."""

    rollouts: int = 1000
    min_s: float = 0.2  # each rollout sleeps a uniform time in [min_s, max_s]
    max_s: float = 1.5
    runners: int = 4
    concurrency: int = 4
    kill_mean_s: float = 2.0  # mean of the exponential intervals between kills; 0: no kills
    restart_server_at: float | None = 0.2  # fraction succeeded when the server is killed once
    timeout_s: float = 240.0
    seed: int = 0
    turns: int = 0  # > 0: the scripted turn agent (rollfleet.agents.scripted), resumed by turn


@dataclass
class ResumeFigures:
    """What a chaos run of the scripted turn agent shows of turn-level resume."""

    resumed: int  # attempts that took over at least one turn of an earlier attempt
    turns_reused: int  # turns taken over, summed over attempts
    replies_repeated: int  # (rollout, turn) whose scripted model call was made more than once
    writes_twice: int  # (rollout, turn) whose side-effecting write ran more than once
    lost_writes: int  # writes whose outcome a kill lost (not run again: at most once)
    restarted_after_a_turn: int  # attempts that started from turn 0 though a turn had finished
    wrong_trajectories: list[str]  # rollouts whose tokens differ from an uninterrupted run


@dataclass
class ChaosReport:
    """What a chaos run did and what came of it."""

    seconds: float  # from enqueue until every rollout was terminal (or the timeout)
    succeeded: int
    failed: dict[str, str]  # rollout id -> its error (why it failed)
    open: int  # rollouts still not terminal at the timeout
    succeeded_twice: list[str]  # rollouts with more than one SUCCEEDED attempt (must be none)
    attempts: int
    lost: int  # attempts that died with their runner
    kills: int
    restarts: dict[str, int] = field(default_factory=dict)  # 'at once' / 'backed off': counts
    max_lost_one_rollout: int = 0
    resume: ResumeFigures | None = None  # with ``turns``: what turn-level resume did

    @property
    def throughput(self) -> float:
        """Rollouts succeeded per second."""
        return self.succeeded / self.seconds if self.seconds else 0.0


async def _monkey(
    fleet: LocalFleet, stop: asyncio.Event, mean_s: float, rng: random.Random, kills: list[str]
) -> None:
    """SIGKILL a random runner after each exponentially distributed interval until ``stop``."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):  # the chaos cadence, not a synchronisation
            await asyncio.wait_for(stop.wait(), rng.expovariate(1.0 / mean_s))
        pids = fleet.pids()
        if pids and not stop.is_set():
            victim = rng.choice(sorted(pids))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[victim], signal.SIGKILL)
            kills.append(victim)


async def _until_done(store: HttpStore, n: int, deadline: float, at: float | None) -> bool:
    """Poll the counts until every rollout is terminal; True once ``at`` × n have succeeded."""
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the server may be down for its restart
            counts = (await store.statistics()).rollouts
            if at is not None and counts["succeeded"] >= at * n:
                return True
            if counts["succeeded"] + counts["failed"] + counts["cancelled"] >= n:
                return False
        await asyncio.sleep(0.2)  # a progress poll: each pass re-reads the real counts
    return False


async def run_chaos(options: ChaosOptions, workdir: Path) -> ChaosReport:
    """Run the scenario on a fresh SQLite store in ``workdir``; return what happened."""
    db = workdir / "chaos.db"
    rng = random.Random(options.seed)
    ledger = workdir / "ledger.txt"
    specs = [
        RolloutSpec(input=_input(options, rng, ledger), rollout_id=f"c-{i}")
        for i in range(options.rollouts)
    ]
    agent = SCRIPTED_AGENT if options.turns else SLEEP_AGENT
    server = ServeProcess(f"sqlite:///{db}").start()
    store = HttpStore(server.url, timeout=10)
    fleet = LocalFleet(
        server.url, agent, n=options.runners, concurrency=options.concurrency, grace_s=5
    )
    restarts: dict[str, int] = {}

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "worker_crashed":
            kind = "at once" if "at once" in str(event.get("reason")) else "backed off"
            restarts[kind] = restarts.get(kind, 0) + 1

    fleet.on_event = on_event
    stop, kills = asyncio.Event(), []  # type: ignore[var-annotated]
    running = asyncio.create_task(fleet.run())
    monkey = None
    if options.kill_mean_s > 0:
        monkey = asyncio.create_task(_monkey(fleet, stop, options.kill_mean_s, rng, kills))
    started = time.monotonic()
    deadline = started + options.timeout_s
    try:
        await store.enqueue_many(specs)
        if options.restart_server_at is not None and await _until_done(
            store, len(specs), deadline, options.restart_server_at
        ):
            server.kill()
            server = ServeProcess(f"sqlite:///{db}", port=server.port).start()
        await _until_done(store, len(specs), deadline, None)
        seconds = time.monotonic() - started
    finally:
        stop.set()
        if monkey is not None:
            await monkey
        fleet.stop()
        await running
        await store.close()
        server.kill()
    report = _report(db, seconds, len(kills), restarts)
    if options.turns:
        report.resume = resume_figures(db, ledger, options.turns)
    return report


def _input(options: ChaosOptions, rng: random.Random, ledger: Path) -> dict[str, Any]:
    """One rollout's input: a sleep, or a scripted turn's duration (the whole rollout's over
    ``turns``) and the ledger its writes go to."""
    duration = round(rng.uniform(options.min_s, options.max_s), 3)
    if not options.turns:
        return {"duration": duration}
    return {"turns": options.turns, "duration": duration / options.turns, "ledger": str(ledger)}


def resume_figures(db: Path, ledger: Path, turns: int) -> ResumeFigures:
    """Turn-level resume, checked from the database and the ledger of side effects."""
    from rollfleet.agents.resume import LOST, REPLY_STEP, TOOL_RESULT_STEP
    from rollfleet.agents.scripted import reply_tokens
    from rollfleet.model import RESUME_STEP

    with contextlib.closing(sqlite3.connect(db)) as conn:
        steps = conn.execute(
            "SELECT rollout_id, attempt_id, kind, payload FROM steps WHERE kind IN (?, ?, ?)"
            " ORDER BY rollout_id, sequence",
            (REPLY_STEP, TOOL_RESULT_STEP, RESUME_STEP),
        ).fetchall()
        results = conn.execute("SELECT rollout_id, result FROM rollouts").fetchall()
    replies: dict[tuple[str, int], set[str]] = {}
    finished: dict[str, int] = {}  # rollout -> turns whose write has a result, so far
    resumed = reused = restarted = lost = 0
    for rollout_id, _attempt, kind, raw in steps:
        payload = json.loads(raw)
        if kind == REPLY_STEP:
            replies.setdefault((rollout_id, payload["turn"]), set()).add(payload["request_id"])
        elif kind == TOOL_RESULT_STEP:
            finished[rollout_id] = max(finished.get(rollout_id, 0), payload["turn"] + 1)
            lost += payload["observation"] == LOST
        else:
            resumed += payload["from_turn"] > 0
            reused += payload["from_turn"]
            restarted += payload["from_turn"] == 0 and finished.get(rollout_id, 0) > 0
    written = Counter(ledger.read_text().splitlines()) if ledger.exists() else Counter()
    wrong = [
        rollout_id
        for rollout_id, result in results
        if json.loads(result or "{}").get("output", {}).get("tokens")
        != [t for turn in range(turns) for t in reply_tokens(rollout_id, turn)]
    ]
    return ResumeFigures(
        resumed=resumed,
        turns_reused=reused,
        replies_repeated=sum(len(ids) > 1 for ids in replies.values()),
        writes_twice=sum(n > 1 for n in written.values()),
        lost_writes=lost,
        restarted_after_a_turn=restarted,
        wrong_trajectories=wrong,
    )


def _report(db: Path, seconds: float, kills: int, restarts: dict[str, int]) -> ChaosReport:
    """Read the outcome straight from the database file."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT rollout_id, status, error, attempts_lost FROM rollouts"
        ).fetchall()
        twice = conn.execute(
            "SELECT rollout_id FROM attempts WHERE status = 'succeeded' GROUP BY rollout_id"
            " HAVING COUNT(*) > 1"
        ).fetchall()
        attempts, lost = conn.execute(
            "SELECT COUNT(*), SUM(status = 'lost') FROM attempts"
        ).fetchone()
    return ChaosReport(
        seconds=seconds,
        succeeded=sum(r[1] == "succeeded" for r in rows),
        failed={r[0]: r[2] for r in rows if r[1] == "failed"},
        open=sum(r[1] not in ("succeeded", "failed", "cancelled") for r in rows),
        succeeded_twice=[r[0] for r in twice],
        attempts=int(attempts),
        lost=int(lost or 0),
        kills=kills,
        restarts=restarts,
        max_lost_one_rollout=max((r[3] for r in rows), default=0),
    )
