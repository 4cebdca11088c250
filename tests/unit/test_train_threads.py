"""Cores by phase: the engine and the trainer each get every core of the machine, whether they take
turns (K=0) or overlap (K>0: a split measured slower, bench/train_threads.py); the engine leaves a
core to modes whose sandboxed programs run on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollfleet.run.train_options import TrainOptions


@pytest.mark.parametrize(
    ("cores", "mode", "k", "expected"),
    [
        (2, "math", 0, (2, 2)),  # the phases take turns: each gets both cores
        (2, "math", 1, (2, 2)),  # they overlap: still both (a split measured slower)
        (8, "math", 2, (8, 8)),
        (8, "py", 0, (7, 8)),  # sandboxed programs run here: the engine leaves them a core
        (1, "math", 1, (1, 1)),
    ],
)
def test_threads_follow_the_machine_and_the_schedule(
    monkeypatch: pytest.MonkeyPatch, cores: int, mode: str, k: int, expected: tuple[int, int]
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    opts = TrainOptions(mode=mode, data=Path("t.jsonl"), output_dir=Path("o"), max_staleness=k)
    assert opts.cores_by_phase() == expected
    assert opts.run_options().engine_threads == expected[0]


def test_an_engine_thread_count_given_wins_and_threads_leave_the_fingerprint_alone() -> None:
    opts = TrainOptions(
        mode="math", data=Path("t.jsonl"), output_dir=Path("o"), extra={"engine_threads": 3}
    )
    assert opts.run_options().engine_threads == 3
    pinned = TrainOptions(
        mode="math", data=Path("t.jsonl"), output_dir=Path("o"), trainer_threads=1
    )
    assert pinned.fingerprint() == opts.fingerprint()
