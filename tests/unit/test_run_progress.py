"""The run's progress lines say which reward is the rollout's and which is the running mean."""

from __future__ import annotations

import io

from rich.console import Console

from rollfleet.model import Rollout, RolloutResult, RolloutStatus
from rollfleet.run.progress import RunProgress


def rollout(rid: str, status: RolloutStatus, reward: float | None) -> Rollout:
    """A finished rollout as the store would return it."""
    result = None if reward is None else RolloutResult(reward=reward)
    return Rollout(
        rollout_id=rid, input={}, status=status, result=result, created_at=1.0, updated_at=2.0
    )


def test_each_line_names_the_rollouts_reward_and_the_running_mean() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with RunProgress(console, 3, [], "math") as progress:
        progress.finished(rollout("ro-a", RolloutStatus.SUCCEEDED, 1.0))
        progress.finished(rollout("ro-b", RolloutStatus.SUCCEEDED, 0.0))
        progress.finished(rollout("ro-c", RolloutStatus.FAILED, None))
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/3] ro-a succeeded this rollout's reward 1 · mean reward 1.000 · failed 0"
    assert lines[1] == "[2/3] ro-b succeeded this rollout's reward 0 · mean reward 0.500 · failed 0"
    assert lines[2] == "[3/3] ro-c failed this rollout's reward none · mean reward 0.500 · failed 1"
