"""``RolloutContext``: what an agent gets beside its input."""

from __future__ import annotations

import asyncio
from typing import Any

from rollfleet.model import Resources, Rollout, StepIn


class RolloutContext:
    """The running rollout's ids, resources, step recorder, cancellation flag and hooks."""

    def __init__(
        self, rollout: Rollout, resources: Resources | None, llm: Any = None, env: Any = None
    ) -> None:
        assert rollout.attempt is not None
        self.rollout = rollout
        self.rollout_id = rollout.rollout_id
        self.attempt_id = rollout.attempt.attempt_id
        self.mode = rollout.mode
        self.metadata = rollout.metadata
        self.resources = resources
        self.llm = llm
        self.env = env
        self._cancelled = asyncio.Event()
        self._steps: list[StepIn] = []

    @property
    def cancelled(self) -> bool:
        """True once the store said this rollout was cancelled or the attempt lost its lease."""
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        """Return when the rollout is cancelled (for agents that wait on something long)."""
        await self._cancelled.wait()

    def emit(self, kind: str | StepIn, payload: dict[str, Any] | None = None) -> None:
        """Record one trajectory step; sent to the store in batches."""
        step = kind if isinstance(kind, StepIn) else StepIn(kind=kind, payload=payload or {})
        self._steps.append(step)

    def take_steps(self) -> list[StepIn]:
        """Hand over the steps recorded since the last call (used by the runner)."""
        steps, self._steps = self._steps, []
        return steps

    def mark_cancelled(self) -> None:
        """Set the cancellation flag (used by the runner)."""
        self._cancelled.set()
