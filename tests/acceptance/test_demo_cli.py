"""``rollfleet demo``: the local stack with the echo agent on N runner processes, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)
ROLLFLEET = str(Path(sys.executable).with_name("rollfleet"))


def test_demo_runs_every_bundled_task_on_the_runners_and_stops_them(tmp_path: Path) -> None:
    tasks = Path(__file__).parents[2] / "src/rollfleet/examples/echo_tasks.jsonl"
    expected = len(tasks.read_text().splitlines())
    done = subprocess.run(
        [ROLLFLEET, "demo", "-n", "2", "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Created and enqueued {expected} rollouts" in done.stdout
    assert f"status: SUCCEEDED={expected}" in done.stdout
    assert (tmp_path / "demo.db").exists()
