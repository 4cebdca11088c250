"""``rollfleet run --store URL``: only enqueue and follow; runners elsewhere do the work.

Everything is a separate process, as in distributed use: a control plane (``rollfleet
serve``), a runner process with its own llama.cpp engine (``rollfleet.runner.child``, its
spec's ``llm.own_engine``), and the run command pointed at the control plane.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from support import ServeProcess, require

from rollfleet.runner.spec import LlmAccess, RunnerSpec

pytestmark = pytest.mark.timeout(150)


def test_store_mode_enqueues_follows_and_writes_outputs(tmp_path: Path) -> None:
    require(importlib.util.find_spec("llama_cpp") is not None, "llama-cpp-python")
    data = Path(str(resources.files("rollfleet.examples").joinpath("math.jsonl")))
    server = ServeProcess(f"sqlite:///{tmp_path}/remote.db").start()
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollfleet.runner.child",
            "--spec",
            RunnerSpec(
                store=server.url,
                agent="rollfleet.agents.loop:agent",
                worker_id="remote-0",
                concurrency=2,
                llm=LlmAccess(own_engine=True),
            ).model_dump_json(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollfleet.cli",
                "run",
                "--mode",
                "math",
                "--data",
                str(data),
                "--store",
                server.url,
                "--limit",
                "3",
                "--max-tokens",
                "32",
                "--output-dir",
                str(tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        runner.terminate()
        events, _ = runner.communicate(timeout=60)
        server.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"] == {"succeeded": 3} and summary["ran_now"] == 3
    assert not (tmp_path / "out" / "store.db").exists()  # the command started no store of its own
    assert "engine llama.cpp" not in done.stdout  # nor an engine
    lines = [
        json.loads(line)
        for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()
    ]
    assert [line["line"] for line in lines] == [1, 2, 3]
    finished = [json.loads(e) for e in events.splitlines() if '"rollout_finished"' in e]
    assert sorted(e["rollout_id"] for e in finished) == sorted(line["rollout_id"] for line in lines)
