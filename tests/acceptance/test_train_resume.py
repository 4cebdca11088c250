"""``rollfleet train`` killed with SIGKILL (the trainer, its control plane, engine and runners: the
whole process group, as a machine dies) and run again with the same command resumes from the last
checkpointed step: every step trained exactly once, each on its own batch of samples (none lost,
none used twice), the versions go on where they stopped. A different setting on the same output
directory is refused by name instead of mixing two runs."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import TRAIN_NEEDS, require

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(900)]
NEEDS = TRAIN_NEEDS
EXAMPLES = Path(__file__).parents[2] / "src" / "rollfleet" / "examples"


def command(out: Path, evals: Path, *more: str) -> list[str]:
    """A short run: 3 steps of 2 tasks x 2 samples, 16 tokens, K = 1."""
    return [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "train",
        "--mode",
        "math",
        "--data",
        str(EXAMPLES / "arith.jsonl"),
        "--eval-data",
        str(evals),
        "--steps",
        "3",
        "--tasks-per-step",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "16",
        "--max-staleness",
        "1",
        "--eval-every",
        "2",
        "--output-dir",
        str(out),
        *more,
    ]


def test_a_run_killed_mid_training_resumes_with_no_sample_lost_or_used_twice(
    tmp_path: Path,
) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join((EXAMPLES / "arith_eval.jsonl").read_text().splitlines(True)[:4]))
    out = tmp_path / "out"
    latest = out / "checkpoints" / "latest"
    first = subprocess.Popen(
        command(out, evals),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (latest.is_file() and latest.read_text() == "step-0"):
            if first.poll() is not None:
                raise AssertionError(first.stderr.read().decode()[-3000:])  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no checkpoint of step 0 within 600 s"
            time.sleep(0.05)  # polling a file the run writes, not waiting for time to pass
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL

    moved = subprocess.run(
        command(out, evals, "--lr", "0.001"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert moved.returncode == 2 and "a checkpoint of a run with other settings" in moved.stderr
    assert "lr 0.0005 (now 0.001)" in moved.stderr

    again = subprocess.run(
        command(out, evals), capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming after step" in again.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2]  # each trained once, in order
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["experiences"] == 4 for r in steps)  # every step its whole batch, nothing lost
    assert all(r["staleness/max"] <= 1 for r in steps)
    evaluated = [r["version"] for r in records if r["kind"] == "eval"]
    assert evaluated == sorted(set(evaluated)) and evaluated[0] == 0 and evaluated[-1] == 3
    assert latest.read_text() == "step-2"
    assert (out / "reward.png").is_file()
