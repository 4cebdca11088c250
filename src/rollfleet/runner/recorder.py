"""What a runner writes to the store for its attempts: their steps as they come and each one's end
(a completion, batched with the other ends, or a release), counted in :class:`RunnerStats`; and
how such a write rides out a server restart (:func:`until_reached`).

Every write here is idempotent, so retrying it after the server came back costs no finished work.
Reads and control (claims, heartbeats, cancelling agents) stay in :mod:`.runner`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from rollfleet.errors import Conflict, NotFound, RollfleetError, StoreUnavailable
from rollfleet.model import (
    AttemptStatus,
    Completion,
    CompletionOutcome,
    Rollout,
    RolloutResult,
    Step,
    StepIn,
)
from rollfleet.runner.batching import NaturalBatcher
from rollfleet.runner.context import AttemptContext
from rollfleet.store.base import Store, read_all
from rollfleet.web.errors import error_named

log = logging.getLogger("rollfleet.runner")
T = TypeVar("T")
EventFn = Callable[..., None]
Outcome = tuple[AttemptStatus, RolloutResult | None, str | None] | None  # None: not recorded


@dataclass
class RunnerStats:
    """What one runner did."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    stopped_by_store: int = 0
    released: int = 0
    fenced: int = 0


async def until_reached(
    call: Callable[[], Awaitable[T]], within_s: float, what: str, worker_id: str
) -> T:
    """``call()`` (an idempotent write); while the server cannot be reached, again, backing
    off, for ``within_s`` seconds (for an attempt's end: until its lease would have lapsed). A
    server that restarts meanwhile costs no finished work; before, the rollout waited out its
    lease and ran again."""
    give_up = time.monotonic() + within_s
    pause = 0.1
    while True:
        try:
            return await call()
        except StoreUnavailable:
            if time.monotonic() + pause > give_up:
                raise
            log.info("%s: server unreachable; retrying %s in %.1f s", worker_id, what, pause)
        await asyncio.sleep(pause)
        pause = min(2.0, 2 * pause)


@dataclass(frozen=True)
class Refill:
    """How a runner takes the slots of its completions again in the same request: ``wanted(n)``,
    how many rollouts to claim as ``n`` attempts end (0: none, e.g. while stopping); ``start``,
    what to do with those claimed."""

    wanted: Callable[[int], int]
    start: Callable[[list[Rollout]], Awaitable[None]]


class AttemptRecorder:
    """Writes the steps and ends of one runner's attempts, and counts the ends in ``stats``."""

    def __init__(
        self,
        store: Store,
        worker_id: str,
        stats: RunnerStats,
        on_event: EventFn,
        refill: Refill | None = None,
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.stats = stats
        self.on_event = on_event
        self.refill = refill
        self._completions: NaturalBatcher[Completion, CompletionOutcome] = NaturalBatcher(
            self._complete_many
        )

    async def _complete_many(self, items: list[Completion]) -> list[CompletionOutcome]:
        """Send ends; with ``refill``, with the claim of the next rollouts in the same request
        (``complete_and_claim``), which the runner then starts."""
        wanted = 0 if self.refill is None else self.refill.wanted(len(items))
        if self.refill is None or wanted < 1:
            return await self.store.complete_many(items)
        try:
            got = await self.store.complete_and_claim(items, self.worker_id, wanted)
        except RollfleetError as exc:  # its answer may be lost: ends may be sent again, claims not
            log.info("%s: complete-and-claim failed (%s); completing alone", self.worker_id, exc)
            return await self.store.complete_many(items)
        if got.claimed:
            await self.refill.start(got.claimed)
        return got.outcomes

    async def record_steps(self, rollout: Rollout, attempt_id: str, steps: list[StepIn]) -> None:
        """An agent's durable record: written now, through a server restart (within a lease)."""
        await until_reached(
            lambda: self.store.add_steps(attempt_id, steps),
            rollout.config.heartbeat_s,
            f"the steps of {rollout.rollout_id}",
            self.worker_id,
        )

    async def earlier_steps(self, rollout: Rollout, attempt_id: str) -> list[Step]:
        """Every step of ``rollout`` that attempts other than ``attempt_id`` recorded."""
        steps = await until_reached(
            lambda: read_all(
                lambda cursor: self.store.query_steps(rollout.rollout_id, cursor=cursor, limit=1000)
            ),
            rollout.config.heartbeat_s,
            f"the earlier steps of {rollout.rollout_id}",
            self.worker_id,
        )
        return [s for s in steps if s.attempt_id != attempt_id]

    async def flush(self, rollout: Rollout, ctx: AttemptContext) -> None:
        """Send the steps the agent has logged since the last flush (a refused or failed send is
        logged, never raised)."""
        steps = ctx.take_steps()
        if not steps:
            return
        try:
            await self.store.add_steps(ctx.attempt_id, steps)
        except (Conflict, NotFound):
            pass  # the attempt no longer owns the rollout: its steps are refused, as they must be
        except RollfleetError as exc:
            log.warning("%s: steps for %s not saved: %s", self.worker_id, rollout.rollout_id, exc)

    async def record_end(
        self,
        rollout: Rollout,
        attempt_id: str,
        outcome: Outcome,
        *,
        release: bool,
        stopped_by_store: bool,
    ) -> None:
        """Record how an attempt ended: nothing when the store stopped it, a release when the
        runner gave it back (or it has no ``outcome``), else its completion. A refusal (the attempt
        lost the rollout) counts as fenced; a server that stays away is logged (its lease will
        lapse and the rollout is retried)."""
        try:
            if stopped_by_store:
                self.stats.stopped_by_store += 1
            elif release or outcome is None:
                await until_reached(
                    lambda: self.store.release(attempt_id, "runner shutting down"),
                    rollout.config.heartbeat_s,
                    f"the end of {rollout.rollout_id}",
                    self.worker_id,
                )
                self.stats.released += 1
            else:
                await self._complete(rollout, attempt_id, *outcome)
        except (Conflict, NotFound) as exc:
            self.stats.fenced += 1
            log.info("%s: result for %s refused: %s", self.worker_id, rollout.rollout_id, exc)
        except RollfleetError as exc:
            log.warning(
                "%s: could not record the end of %s: %s (its lease will expire and it is retried)",
                self.worker_id,
                rollout.rollout_id,
                exc,
            )

    async def _complete(
        self,
        rollout: Rollout,
        attempt_id: str,
        status: AttemptStatus,
        result: RolloutResult | None,
        error: str | None,
    ) -> None:
        done = Completion(attempt_id=attempt_id, status=status, result=result, error=error)
        answer = await until_reached(
            lambda: self._completions.submit(done),
            rollout.config.heartbeat_s,
            f"the end of {rollout.rollout_id}",
            self.worker_id,
        )
        if answer.rollout_status is None:
            raise error_named(answer.error_type, answer.error or "refused")
        self._count(status)
        self.on_event(
            "rollout_finished",
            worker_id=self.worker_id,
            rollout_id=rollout.rollout_id,
            status=status.value,
            rollout_status=answer.rollout_status.value,
            reward=None if result is None else result.reward,
            error=error,
        )

    def _count(self, status: AttemptStatus) -> None:
        if status is AttemptStatus.SUCCEEDED:
            self.stats.succeeded += 1
        elif status is AttemptStatus.TIMEOUT:
            self.stats.timed_out += 1
        else:
            self.stats.failed += 1
