"""``rollfleet train`` checks the mode's reward (and per-turn reward) before it starts anything: one
that raises is one InvalidInput naming the mode and the error, and the output directory is never
created."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from support import require

from rollfleet.envs.math import MathMode, MathSession
from rollfleet.errors import InvalidInput


class BrokenSession(MathSession):
    """A math session whose reward function has a bug."""

    async def score(self, answer: str) -> Any:
        """Fails on every answer, as a buggy user reward would."""
        raise KeyError("expected")


class BrokenMode(MathMode):
    """Math, with the broken reward."""

    async def open(self, task: dict[str, Any], env: Any) -> MathSession:
        """A session that cannot score."""
        return BrokenSession(task)


class BrokenTurnSession(MathSession):
    """A math session whose per-turn reward has a bug."""

    async def turn_reward(self, text: str, calls: list[dict[str, Any]]) -> float:
        """Fails on every turn, as a buggy user shaping would."""
        raise ZeroDivisionError("per turn")


class BrokenTurnMode(MathMode):
    """Math, with the broken per-turn reward."""

    async def open(self, task: dict[str, Any], env: Any) -> MathSession:
        """A session whose turns cannot be scored."""
        return BrokenTurnSession(task)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (BrokenMode, r"mode math: its reward raised KeyError: 'expected'"),
        (BrokenTurnMode, r"mode math: its per-turn reward raised ZeroDivisionError"),
    ],
)
async def test_a_reward_that_raises_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: type[MathMode], message: str
) -> None:
    require(bool(importlib.util.find_spec("torch")), "torch")
    import rollfleet.run.train as run_train
    from rollfleet.run.train import train
    from rollfleet.run.train_options import TrainOptions

    monkeypatch.setattr(run_train, "get_mode", lambda name: broken())
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": 2}\n')
    out = tmp_path / "out"
    with pytest.raises(InvalidInput, match=message):
        await train(TrainOptions(mode="math", data=data, output_dir=out), Console(quiet=True))
    assert not out.exists()
