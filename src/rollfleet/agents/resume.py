"""Turn-level resume: a later attempt of a rollout goes on from the last turn an earlier one
finished, instead of from the prompt.

An agent that resumes records, durably (``ctx.record``: in the store before it goes on), what a
later attempt needs:

- ``reply`` (:data:`REPLY_STEP`): a model reply it acted on, ``{"turn", "request_id", "content",
  "calls": [{"name", "args", "call_id"}]}``, right after the call returned;
- ``tool_start`` (:data:`TOOL_START_STEP`): ``{"turn", "index", "tool"}`` before a tool the mode
  marks side-effecting runs;
- ``tool_result`` (:data:`TOOL_RESULT_STEP`): ``{"turn", "index", "tool", "observation",
  "done"}`` as soon as a tool ran, before the model sees it.

A later attempt reads them (:func:`recorded_turns`) and continues: a recorded reply is reused (no
model call that completed is made again), a recorded tool result is reused (never run again), a
side-effecting tool that started but whose result was lost is not run again either: its call
gets :data:`LOST` as its observation (at most once). What the attempt reused is one ``resume``
step (:data:`RESUME_STEP`), which the trainer reads to take the reused calls' tokens into the
rollout's row.

How the environment's state comes back is the mode's declared ``resume`` strategy
(:class:`Strategy`): ``replay`` runs the reused calls of tools that are not side-effecting again
in the fresh environment (deterministic modes) and checks each observation against the recorded
one (a difference restarts the rollout, and the step says so); ``snapshot`` restores the state
the session saved after the last finished turn; ``restart`` (the default, for environments that
can do neither) starts from turn 0 and says so in the step.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollfleet.envs.base import Observation, observation_of
from rollfleet.errors import AgentError
from rollfleet.model import RESUME_STEP, Step

REPLY_STEP = "reply"
TOOL_START_STEP = "tool_start"
TOOL_RESULT_STEP = "tool_result"
SNAPSHOT_STEP = "snapshot"
LOST = (
    "error: this call's outcome was lost when the runner stopped, and the tool has side effects,"
    " so it was not run again"
)


class Strategy(str, enum.Enum):
    """How a mode's environment comes back when a rollout resumes."""

    REPLAY = "replay"  # run the recorded calls again in a fresh environment (deterministic)
    SNAPSHOT = "snapshot"  # the session's snapshot() after the last finished turn, restored
    RESTART = "restart"  # from turn 0: the environment cannot be brought back


def strategy_of(mode: Any) -> Strategy:
    """A mode's declared ``resume`` strategy (``restart`` when it declares none)."""
    return Strategy(getattr(mode, "resume", Strategy.RESTART))


@dataclass
class ToolRecord:
    """One tool call of a recorded turn, and what is known of its run."""

    name: str
    args: dict[str, Any]
    call_id: str | None = None
    started: bool = False
    observation: str | None = None  # None: no result was recorded
    done: bool = False


@dataclass
class TurnRecord:
    """One recorded turn: the reply acted on and its tool calls."""

    turn: int
    request_id: str
    content: str
    attempt_id: str
    calls: list[ToolRecord] = field(default_factory=list)
    snapshot: Any = None  # the session's state after this turn, when the mode snapshots

    @property
    def finished(self) -> bool:
        """Every tool call of the turn has its result."""
        return all(c.observation is not None for c in self.calls)


def recorded_turns(steps: Sequence[Step]) -> list[TurnRecord]:
    """The turns the steps of earlier attempts hold, in order: each attempt's replies replace the
    turns from theirs on (a restart, or a resume from turn ``t``, rewrites what follows)."""
    turns: list[TurnRecord] = []
    for step in steps:
        p = step.payload
        turn = p.get("turn")
        if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
            continue
        if step.kind == REPLY_STEP and turn <= len(turns):
            del turns[turn:]
            turns.append(
                TurnRecord(
                    turn,
                    str(p.get("request_id") or ""),
                    str(p.get("content") or ""),
                    step.attempt_id,
                    [_tool(c) for c in p.get("calls") or [] if isinstance(c, dict)],
                )
            )
        elif turn < len(turns):
            _update(turns[turn], step)
    return turns


def _tool(call: dict[str, Any]) -> ToolRecord:
    args = call.get("args")
    return ToolRecord(
        str(call.get("name") or ""),
        args if isinstance(args, dict) else {},
        call.get("call_id") if isinstance(call.get("call_id"), str) else None,
    )


def _update(record: TurnRecord, step: Step) -> None:
    """A later step of a recorded turn: a tool's start or result, or the state after it."""
    if step.kind == SNAPSHOT_STEP:
        record.snapshot = step.payload.get("state")
        return
    index = step.payload.get("index")
    if not isinstance(index, int) or not 0 <= index < len(record.calls):
        return
    call = record.calls[index]
    if step.kind == TOOL_START_STEP:
        call.started = True
    elif step.kind == TOOL_RESULT_STEP:
        call.started = True
        call.observation = str(step.payload.get("observation") or "")
        call.done = bool(step.payload.get("done"))


def reusable(turns: list[TurnRecord], strategy: Strategy) -> list[TurnRecord]:
    """The recorded turns a new attempt takes over: none under ``restart``; under ``replay`` all
    of them; under ``snapshot`` those up to the last one with a snapshot and the one after it
    (its tools replayed on the restored state). The last turn taken over may be unfinished: its
    reply and recorded results are reused, the rest of its tools run."""
    if strategy is Strategy.RESTART:
        return []
    if strategy is Strategy.SNAPSHOT:
        return turns[: _last_snapshot(turns) + 2]
    return turns


def _last_snapshot(turns: list[TurnRecord]) -> int:
    """The index of the last turn with a snapshot (-1 when none has one)."""
    saved = [i for i, t in enumerate(turns) if t.snapshot is not None]
    return saved[-1] if saved else -1


def resume_payload(
    turns: list[TurnRecord], strategy: Strategy, attempt: int, reason: str | None = None
) -> dict[str, Any]:
    """The ``resume`` step: where this attempt started and what it reused."""
    return {
        "attempt": attempt,
        "strategy": strategy.value,
        "from_turn": len(turns),
        "reused_calls": [t.request_id for t in turns if t.request_id],
        "reused_results": sum(c.observation is not None for t in turns for c in t.calls),
        "from_attempts": sorted({t.attempt_id for t in turns}),
        **({"reason": reason} if reason else {}),
    }


MAX_SNAPSHOT_CHARS = 1_000_000  # of a session's saved state, as JSON


class Resumer:
    """One attempt's side of resuming: what it takes over from earlier attempts, and the durable
    records a later attempt will take over from it (none under ``restart``)."""

    def __init__(self, ctx: Any, session: Any, mode: Any) -> None:
        """For the attempt ``ctx`` runs, on ``session`` of ``mode``."""
        self.ctx, self.session = ctx, session
        self.strategy = strategy_of(mode)
        self.mode_name = str(getattr(mode, "name", "?"))
        self.durable = self.strategy is not Strategy.RESTART
        self.side_effects = {t.name for t in session.tools if getattr(t, "side_effects", False)}

    async def resume(self) -> list[TurnRecord]:
        """The turns this attempt takes over (none on a first attempt), the environment brought
        back to where they left it; a later attempt records a ``resume`` step either way."""
        attempt = int(getattr(self.ctx, "attempt_number", 1))
        if attempt <= 1:
            return []
        if self.strategy is Strategy.RESTART:
            why = f"mode {self.mode_name} declares no resume: restarted from turn 0"
            self.ctx.emit(RESUME_STEP, resume_payload([], self.strategy, attempt, why))
            return []
        turns = reusable(recorded_turns(await self.ctx.earlier_steps()), self.strategy)
        reason = await self._bring_back(turns)
        if reason is not None:
            turns = []
        await self.ctx.record(RESUME_STEP, resume_payload(turns, self.strategy, attempt, reason))
        return turns

    async def _bring_back(self, turns: list[TurnRecord]) -> str | None:
        """Put the fresh environment where ``turns`` left it; why it cannot be, or None."""
        start = 0
        if self.strategy is Strategy.SNAPSHOT and _last_snapshot(turns) >= 0:
            start = _last_snapshot(turns) + 1
            await self.session.restore(turns[start - 1].snapshot)
        for record in turns[start:]:
            for index, call in enumerate(record.calls):
                if call.observation is None or call.name in self.side_effects:
                    continue
                seen = observation_of(await self.session.call(call.name, call.args))
                if seen.text != call.observation:
                    return (
                        f"replay diverged at turn {record.turn}, call {index} ({call.name}): "
                        "the environment answered otherwise than recorded; restarted from turn 0"
                    )
        return None

    async def reply(self, turn: int, request_id: str, text: str, calls: Sequence[Any]) -> None:
        """Record the reply of ``turn`` the agent acts on, before its tools run."""
        if self.durable:
            shown = [{"name": c.name, "args": c.args, "call_id": c.call_id} for c in calls]
            payload = {"turn": turn, "request_id": request_id, "content": text, "calls": shown}
            await self.ctx.record(REPLY_STEP, payload)

    async def run(self, turn: int, index: int, call: Any, reused: TurnRecord | None) -> Any:
        """The observation of call ``index`` of ``turn``: recorded, else run now (a
        side-effecting tool that may have run already is not run again: :data:`LOST`)."""
        known = reused.calls[index] if reused is not None and index < len(reused.calls) else None
        if known is not None and known.observation is not None:
            return Observation(known.observation, done=known.done)
        side = call.name in self.side_effects
        if known is not None and known.started and side:
            result = Observation(LOST)
        else:
            if side and self.durable:
                await self.ctx.record(
                    TOOL_START_STEP, {"turn": turn, "index": index, "tool": call.name}
                )
            result = observation_of(await self.session.call(call.name, call.args))
        if self.durable:
            payload = {
                "turn": turn,
                "index": index,
                "tool": call.name,
                "observation": result.text,
                "done": result.done,
            }
            await self.ctx.record(TOOL_RESULT_STEP, payload)
        return result

    async def turn_done(self, turn: int, reused: TurnRecord | None) -> None:
        """Under ``snapshot``, record the session's state after ``turn`` (unless an earlier
        attempt recorded it)."""
        if self.strategy is not Strategy.SNAPSHOT or (reused and reused.snapshot is not None):
            return
        state = await self.session.snapshot()
        if len(json.dumps(state)) > MAX_SNAPSHOT_CHARS:
            raise AgentError(
                f"mode {self.mode_name}: a snapshot of more than {MAX_SNAPSHOT_CHARS:,} characters"
            )
        await self.ctx.record(SNAPSHOT_STEP, {"turn": turn, "state": state})
