"""What an agent gets beside its input: :class:`RolloutContext`, the contract (a Protocol), and
:class:`AttemptContext`, the runner's.

An agent is ``async def agent(input, ctx: RolloutContext) -> float | RolloutResult | dict |
None`` (:data:`rollfleet.runner.agent.Agent`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from rollfleet.model import Resources, Rollout, Step, StepIn

Writer = Callable[[Sequence[StepIn]], Awaitable[Any]]
Reader = Callable[[], Awaitable[list[Step]]]


class RolloutContext(Protocol):
    """What an agent may use: the rollout's ids and settings, ``llm`` (an ``openai.AsyncOpenAI``
    client bound to this attempt: what it is asked is recorded, and trained on), ``env`` (the
    environment instance leased for this attempt, or None), and the step recorder."""

    rollout_id: str
    attempt_id: str
    mode: str | None
    metadata: dict[str, Any]
    resources: Resources | None
    llm: Any
    env: Any

    @property
    def cancelled(self) -> bool:
        """True once the rollout was cancelled or the attempt lost its lease."""
        ...

    @property
    def attempt_number(self) -> int:
        """1 for the first attempt, 2 for the first retry, and so on."""
        ...

    def emit(self, kind: str | StepIn, payload: dict[str, Any] | None = None) -> None:
        """Record one step (sent in batches)."""
        ...

    async def record(self, kind: str, payload: dict[str, Any]) -> None:
        """Record one step durably before going on."""
        ...

    async def earlier_steps(self) -> list[Step]:
        """The steps earlier attempts of this rollout recorded."""
        ...


class AttemptContext:
    """The runner's :class:`RolloutContext`: the running attempt's ids, resources, step
    recorder, cancellation flag and hooks."""

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
        self._writer: Writer | None = None  # the runner's: this attempt's steps, to the store now
        self._reader: Reader | None = None  # the runner's: the steps of earlier attempts

    @property
    def attempt_number(self) -> int:
        """1 for a rollout's first attempt, 2 for its first retry, and so on."""
        assert self.rollout.attempt is not None
        return self.rollout.attempt.sequence

    def bind(self, writer: Writer, reader: Reader) -> None:
        """Give the context its store (used by the runner)."""
        self._writer, self._reader = writer, reader

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

    async def record(self, kind: str, payload: dict[str, Any]) -> None:
        """Record one step, with every step emitted before it, in the store now: what a later
        attempt of this rollout may resume from. Conflict or NotFound when this attempt no
        longer holds the rollout (nothing it does from now on counts)."""
        self.emit(kind, payload)
        if self._writer is not None:
            steps = self.take_steps()
            await self._writer(steps)

    async def earlier_steps(self) -> list[Step]:
        """The steps the earlier attempts of this rollout recorded, in order (none for a first
        attempt, or outside a runner)."""
        if self._reader is None or self.attempt_number <= 1:
            return []
        return await self._reader()

    def take_steps(self) -> list[StepIn]:
        """Hand over the steps recorded since the last call (used by the runner)."""
        steps, self._steps = self._steps, []
        return steps

    def mark_cancelled(self) -> None:
        """Set the cancellation flag (used by the runner)."""
        self._cancelled.set()
