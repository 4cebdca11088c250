"""``--report-to tensorboard``: every number of a step or eval record becomes a scalar in event
files TensorBoard reads back, at the steps done (steps) or the weights version (evals)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from support import require


def test_records_become_tensorboard_scalars(tmp_path: Path) -> None:
    require(bool(importlib.util.find_spec("tensorboard")), "tensorboard (rollfleet[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollfleet.train.report import TensorBoard

    board = TensorBoard(tmp_path)
    board.write({"kind": "step", "step": 0, "reward/mean": 0.25, "trained": True, "note": "x"})
    board.write({"kind": "step", "step": 1, "reward/mean": 0.5, "trained": True})
    board.write({"kind": "eval", "version": 2, "success": 0.75, "pass@1": 0.75})
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "step/reward/mean" in scalars and "eval/success" in scalars
    assert "step/trained" not in scalars and "step/note" not in scalars  # numbers only
    got = [(e.step, e.value) for e in events.Scalars("step/reward/mean")]
    assert got == [(1, 0.25), (2, 0.5)]  # at the steps done
    assert [(e.step, e.value) for e in events.Scalars("eval/success")] == [(2, 0.75)]
