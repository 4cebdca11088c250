"""The live view of a run: a rich progress bar with mean reward and failures.

On a terminal it is a live bar; elsewhere (logs, CI, a test reading stdout) it prints one
line per finished rollout instead, which is also what tools can follow.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from rollfleet.errors import failure_kind
from rollfleet.model import Rollout, RolloutStatus


class RunProgress:
    """Counts finished rollouts, their rewards and failures, and shows them."""

    def __init__(self, console: Console, total: int, already: list[Rollout], label: str) -> None:
        """Start at the rollouts finished before this run."""
        self.console, self.total, self.label = console, total, label
        self.rewards: list[float] = []
        self.failed = 0
        self.infrastructure = 0
        self.done = 0
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self._task = self._progress.add_task(label, total=total, stats="")
        for rollout in already:
            self._count(rollout)
        self._refresh()

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def _count(self, rollout: Rollout) -> None:
        self.done += 1
        if rollout.status is not RolloutStatus.SUCCEEDED:
            self.failed += 1
            if failure_kind(rollout.status.value, rollout.error) == "infrastructure":
                self.infrastructure += 1
        elif rollout.result is not None and rollout.result.reward is not None:
            self.rewards.append(rollout.result.reward)

    def stats(self) -> str:
        """``mean reward 0.250 · failed 1``: the running mean over the rollouts finished so far."""
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else 0.0
        infra = f" ({self.infrastructure} infrastructure)" if self.infrastructure else ""
        return f"mean reward {mean:.3f} · failed {self.failed}{infra}"

    def _refresh(self) -> None:
        self._progress.update(self._task, completed=self.done, stats=self.stats())

    def finished(self, rollout: Rollout) -> None:
        """Count one more finished rollout."""
        self._count(rollout)
        self._refresh()
        if not self.console.is_terminal:
            reward = rollout.result.reward if rollout.result is not None else None
            shown = "none" if reward is None else f"{reward:g}"
            self.console.print(
                f"[{self.done}/{self.total}] {rollout.rollout_id} {rollout.status.value} "
                f"this rollout's reward {shown} · {self.stats()}",
                highlight=False,
                soft_wrap=True,
            )
