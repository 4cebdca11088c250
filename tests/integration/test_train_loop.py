"""The training loop through the real fleet: GRPO steps on the bundled SmolLM2 with arithmetic
tasks, runner processes generating through the shared engine, batches generated ahead
(max_staleness 1). Every step trains on the engine's experiences, checkpoints, pushes its weights
(the versions advance), no consumed sample is staler than the bound, the eval split is answered
by each evaluated version and the run ends with metrics.jsonl and reward.png."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sqlite3
import time
from pathlib import Path

import pytest
from rich.console import Console
from support import TRAIN_NEEDS, require

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(900)]
NEEDS = TRAIN_NEEDS
EXAMPLES = Path(__file__).parents[2] / "src" / "rollfleet" / "examples"


def small(tmp_path: Path, **changes: object) -> object:
    """Options for a short run: 2 tasks x 2 samples, 16 tokens, 4 eval tasks."""
    from rollfleet.run.train_options import TrainOptions

    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join((EXAMPLES / "arith_eval.jsonl").read_text().splitlines(True)[:4]))
    base = {
        "mode": "math",
        "data": EXAMPLES / "arith.jsonl",
        "output_dir": tmp_path / "out",
        "steps": 3,
        "tasks_per_step": 2,
        "group_size": 2,
        "max_staleness": 1,
        "max_tokens": 16,
        "eval_data": evals,
        "eval_every": 2,
    }
    return TrainOptions(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["llamacpp", "hf"])
async def test_steps_train_push_evaluate_and_stay_within_the_bound(
    tmp_path: Path, engine: str
) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    from rollfleet.run.train import train

    records = await train(small(tmp_path, engine=engine), Console(quiet=True))  # type: ignore[arg-type]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["experiences"] == 4 for r in steps)  # 2 tasks x 2 samples, each with logprobs
    # asynchronous (K = 1): some batch was generated ahead, none consumed staler than K
    assert all(r["staleness/max"] <= 1 for r in steps)
    assert all(int(k) <= 1 for r in steps for k in r["staleness"])
    assert sum(sum(r["staleness"].values()) for r in steps) == 12
    trained = [r for r in steps if r["trained"]]
    assert all(0.5 < r["ratio_mean"] < 2.0 for r in trained)  # the engine's logprobs vs ours
    assert all(r["kl_initial"] >= 0 and r["entropy"] > 0 for r in trained)
    assert [r["version"] for r in evals] == [0, 2, 3]  # before, every 2 steps, after the last
    assert all(r["tasks"] == 4 and 0 <= r["reward"] <= 1 for r in evals)
    out = tmp_path / "out"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == records
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "latest").read_text() == "step-2"


async def test_the_next_batch_is_generated_while_a_step_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 1: batch step-2, submitted as step 1 begins, is generated to its end while step 1
    trains (the training step leaves free the event loop that serves the engine's gateway)."""
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    from rollfleet.run import train as loop
    from rollfleet.train.policy import Policy

    real = Policy.step
    seen: dict[str, int] = {}

    def step(self: Policy, rows: list) -> object:  # type: ignore[type-arg]
        if rows[0].batch_id == "step-1":
            seen["step-2 done"] = wait_for_batch(tmp_path / "out" / "store.db", "step-2", 4)
        return real(self, rows)

    monkeypatch.setattr(Policy, "step", step)
    monkeypatch.setattr(loop, "_signal", lambda rows: True)  # every step trains, even on ties
    records = await loop.train(small(tmp_path, eval_data=None), Console(quiet=True))  # type: ignore[arg-type]
    assert [r["version"] for r in records if r["kind"] == "step"] == [1, 2, 3]
    assert seen == {"step-2 done": 4}


def wait_for_batch(db: Path, batch: str, rollouts: int, timeout: float = 120.0) -> int:
    """How many rollouts of ``batch`` have succeeded in the store ``db``, once all ``rollouts``
    have or ``timeout`` seconds have passed (read from another connection, as the WAL allows)."""
    deadline = time.monotonic() + timeout
    done = 0
    while done < rollouts and time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            (done,) = conn.execute(
                "SELECT count(*) FROM rollouts WHERE batch_id = ? AND status = 'succeeded'",
                (batch,),
            ).fetchone()
        time.sleep(0.05)  # the polling interval; the condition is what ends the wait
    return int(done)
