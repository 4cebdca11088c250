"""Chaos runs: sleep rollouts through ``rollfleet serve`` and a local fleet whose runners are
SIGKILLed at random intervals, and whose server is killed and restarted once.

What an operator on preemptible machines sees, measured: how many rollouts succeed, how many
attempts die with their runners, and the throughput next to the same run without kills
(``bench/chaos.py``; the acceptance test in tests/acceptance/test_runner_chaos.py).

With ``llm``, each turn of the scripted agent is a real model call: a llama.cpp engine (the
bundled model unless one is given) behind a gateway that records every call as an ``llm`` step of
its attempt, as ``rollfleet run`` does; what the calls cost is counted (:class:`LlmFigures`),
resumed by turn or, with ``resume="restart"``, restarted from scratch (``bench/resume.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.client import HttpStore
from rollfleet.errors import RollfleetError
from rollfleet.model import RolloutConfig, RolloutSpec
from rollfleet.runner.local import LocalFleet
from rollfleet.runner.spec import LlmAccess
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
    llm: bool = False  # with turns: each turn's reply a real model call (llama.cpp, recorded)
    max_tokens: int = 8  # with llm: tokens each model call may generate
    resume: str = "replay"  # with turns: "restart" plays the script in a mode declaring restart
    max_lost: int = 10  # attempts a rollout may lose with its runner before it fails
    reuse: bool = True  # with llm: the gateway answers a call asked again (engines.gateway.repeats)


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
class LlmCall:
    """One model call the engine answered for a rollout, as the gateway saw it."""

    rollout_id: str
    attempt_id: str
    request_id: str
    turn: int  # the assistant replies already in its prompt
    completion_tokens: int
    recorded: bool = True  # False: the store refused its step (the attempt was fenced)
    prompt_tokens: int = 0
    reuses: str | None = None  # answered with the tokens of this earlier call: none generated


@dataclass
class LlmFigures:
    """What the model calls of a chaos run with ``llm`` cost, counted at the gateway (every call
    the engine answered, recorded or refused) and, for comparison, in the store's ``llm`` steps."""

    calls: int  # model calls the engine generated
    tokens_generated: int  # their completion tokens
    trajectory_calls: int  # calls the finished rollouts' trajectories are made of
    tokens_in_trajectories: int  # those calls' completion tokens
    tokens_regenerated: int  # generated, less what the trajectories are made of
    calls_repeated: int  # calls beyond the first for the same (rollout, turn)
    turns_repeated: int  # (rollout, turn) whose model call was made more than once
    steps_refused: int  # calls whose llm step the store refused (a fenced attempt's)
    store_llm_steps: int  # llm steps in the store, every attempt
    store_tokens: int  # their completion tokens
    prompt_tokens: int = 0  # prompt tokens of every call (what the engine did not prefill included)
    calls_answered: int = 0  # calls asked again and answered with tokens generated before

    @property
    def regenerated_share(self) -> float:
        """Tokens regenerated over tokens generated."""
        return self.tokens_regenerated / self.tokens_generated if self.tokens_generated else 0.0


class LlmTally:
    """The gateway's recorder for a chaos run: every call noted here, then stored as an ``llm``
    step of its attempt (a fenced attempt's step is refused by the store, as it must be)."""

    def __init__(self, store: HttpStore) -> None:
        """Store the steps through ``store``."""
        self.store = store
        self.calls: list[LlmCall] = []

    async def __call__(self, rollout_id: str, attempt_id: str, step: Any) -> None:
        """Note the call, then store its step."""
        payload = step.payload
        messages = payload.get("messages") or []
        call = LlmCall(
            rollout_id,
            attempt_id,
            str(payload.get("request_id")),
            sum(isinstance(m, dict) and m.get("role") == "assistant" for m in messages),
            len(payload.get("completion_token_ids") or []),
            prompt_tokens=len(payload.get("prompt_token_ids") or []),
            reuses=payload.get("reuses"),
        )
        self.calls.append(call)
        try:
            await self.store.add_steps(attempt_id, [step])
        except RollfleetError:
            call.recorded = False


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
    llm: LlmFigures | None = None  # with ``llm``: what the model calls cost

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


async def run_chaos(options: ChaosOptions, workdir: Path, engine: Any = None) -> ChaosReport:
    """Run the scenario on a fresh SQLite store in ``workdir``; return what happened. With
    ``options.llm``, the model calls go to ``engine`` (started, left running), else to a
    llama.cpp engine on the bundled model started and stopped here."""
    db = workdir / "chaos.db"
    rng = random.Random(options.seed)
    ledger = workdir / "ledger.txt"
    config = RolloutConfig(max_lost=options.max_lost)
    specs = [
        RolloutSpec(input=_input(options, rng, ledger), rollout_id=f"c-{i}", config=config)
        for i in range(options.rollouts)
    ]
    agent = SCRIPTED_AGENT if options.turns else SLEEP_AGENT
    servers = [ServeProcess(f"sqlite:///{db}").start()]  # the last one is the one running
    tally: LlmTally | None = None
    try:
        async with _llm_for(options, servers[0].url, engine) as (llm, llm_token, tally):
            fleet = LocalFleet(
                servers[0].url,
                agent,
                n=options.runners,
                concurrency=options.concurrency,
                grace_s=5,
                llm=llm,
                llm_token=llm_token,
            )
            seconds, kills, restarts = await _chaos(options, db, servers, specs, fleet, rng)
    finally:
        servers[-1].kill()
    report = _report(db, seconds, kills, restarts)
    if options.turns:
        report.resume = resume_figures(db, ledger, options.turns, llm=options.llm)
    if tally is not None:
        report.llm = llm_figures(db, tally.calls)
    return report


@contextlib.asynccontextmanager
async def _llm_for(
    options: ChaosOptions, store_url: str, engine: Any
) -> AsyncIterator[tuple[LlmAccess, str | None, LlmTally | None]]:
    """The runners' access and LLM token for ``ctx.llm`` (none without ``llm``): a gateway over
    ``engine`` (or the bundled model's, started here) recording to the store at ``store_url``."""
    if not (options.llm and options.turns):
        yield LlmAccess(), None, None
        return
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway

    own = engine is None
    if own:
        from rollfleet.engines.llamacpp.engine import LlamaCppEngine

        slots = max(2, options.runners * options.concurrency)
        engine = LlamaCppEngine(slots=slots, threads=max(1, len(os.sched_getaffinity(0)) - 1))
        await engine.start()
    recorder_store = HttpStore(store_url, timeout=10)
    tally = LlmTally(recorder_store)
    gateway = Gateway(tally, reuse=options.reuse)
    replica = gateway.add_replica(engine)
    secret = secrets.token_urlsafe(32)  # runners mint each attempt its capability from it
    try:
        async with running_gateway(gateway, token=secret) as url:
            yield LlmAccess(url=url, mint=True), secret, tally
    finally:
        await gateway.remove_replica(replica, abort=True, stop=own)
        await recorder_store.close()


async def _chaos(
    options: ChaosOptions,
    db: Path,
    servers: list[ServeProcess],
    specs: list[RolloutSpec],
    fleet: LocalFleet,
    rng: random.Random,
) -> tuple[float, int, dict[str, int]]:
    """Enqueue ``specs``, kill runners (and the server once: its successor is appended to
    ``servers``) until every rollout is terminal; return the seconds it took, the kills and the
    runners' restarts."""
    server = servers[-1]
    store = HttpStore(server.url, timeout=10)
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
            servers.append(ServeProcess(f"sqlite:///{db}", port=server.port).start())
        await _until_done(store, len(specs), deadline, None)
        seconds = time.monotonic() - started
    finally:
        stop.set()
        if monkey is not None:
            await monkey
        fleet.stop()
        await running
        await store.close()
    return seconds, len(kills), restarts


def _input(options: ChaosOptions, rng: random.Random, ledger: Path) -> dict[str, Any]:
    """One rollout's input: a sleep, or a scripted turn's duration (the whole rollout's over
    ``turns``) and the ledger its writes go to."""
    duration = round(rng.uniform(options.min_s, options.max_s), 3)
    if not options.turns:
        return {"duration": duration}
    scripted: dict[str, Any] = {
        "turns": options.turns,
        "duration": duration / options.turns,
        "ledger": str(ledger),
    }
    if options.llm:
        scripted.update(llm=True, max_tokens=options.max_tokens)
    if options.resume != "replay":
        scripted["resume"] = options.resume
    return scripted


def resume_figures(db: Path, ledger: Path, turns: int, llm: bool = False) -> ResumeFigures:
    """Turn-level resume, checked from the database and the ledger of side effects (with
    ``llm``, a trajectory is right when it names one model call per turn)."""
    from rollfleet.agents.resume import LOST, REPLY_STEP, TOOL_RESULT_STEP
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
        if not _right_trajectory(
            rollout_id, json.loads(result or "{}").get("output", {}), turns, llm
        )
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


def _right_trajectory(rollout_id: str, output: Any, turns: int, llm: bool) -> bool:
    """Whether a rollout's output is the uninterrupted run's (with ``llm``: one call a turn)."""
    from rollfleet.agents.scripted import reply_tokens

    if not isinstance(output, dict):
        return False
    if llm:
        return len(output.get("calls") or []) == turns
    return output.get("tokens") == [
        t for turn in range(turns) for t in reply_tokens(rollout_id, turn)
    ]


def llm_figures(db: Path, calls: list[LlmCall]) -> LlmFigures:
    """What the model calls cost: every call the engine answered, what the finished rollouts'
    trajectories are made of, what was generated again, and the store's ``llm`` steps."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        results = conn.execute("SELECT result FROM rollouts WHERE status = 'succeeded'").fetchall()
        stored = conn.execute("SELECT payload FROM steps WHERE kind = 'llm'").fetchall()
    kept = {
        str(request_id)
        for (raw,) in results
        for request_id in (json.loads(raw or "{}").get("output") or {}).get("calls") or []
    }
    kept |= {c.reuses for c in calls if c.reuses and c.request_id in kept}  # their generation
    made = [c for c in calls if not c.reuses]  # the calls the engine generated
    per_turn = Counter((c.rollout_id, c.turn) for c in made)
    generated = sum(c.completion_tokens for c in made)
    in_trajectories = sum(c.completion_tokens for c in made if c.request_id in kept)
    return LlmFigures(
        calls=len(made),
        tokens_generated=generated,
        trajectory_calls=sum(c.request_id in kept for c in made),
        tokens_in_trajectories=in_trajectories,
        tokens_regenerated=generated - in_trajectories,
        calls_repeated=sum(n - 1 for n in per_turn.values()),
        turns_repeated=sum(n > 1 for n in per_turn.values()),
        steps_refused=sum(not c.recorded for c in calls),
        store_llm_steps=len(stored),
        store_tokens=sum(
            len(json.loads(raw).get("completion_token_ids") or []) for (raw,) in stored
        ),
        prompt_tokens=sum(c.prompt_tokens for c in made),
        calls_answered=len(calls) - len(made),
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
