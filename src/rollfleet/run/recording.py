"""A finished rollout as the store recorded it, and what a replay gives the agent from it: the
recorded calls to answer with (``RecordedLLM``), a context that checks each step
(``ReplayContext``), and the token checker for its engine."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollfleet.coordinator.experiences import training_calls
from rollfleet.engines.llamacpp.model import (
    bundled_gguf,
)
from rollfleet.engines.llamacpp.vocab import EngineTokens
from rollfleet.errors import InvalidInput, NotFound, RollfleetError
from rollfleet.model import (
    CALL_REWARD_STEP,
    DISCARD_STEP,
    LLM_STEP,
    RESUME_STEP,
    Rollout,
    RolloutStatus,
    Step,
)
from rollfleet.store.base import Store, read_all
from rollfleet.store.blobs import image_refs

LOOP_OUTPUT = {"answer", "messages", "score"}  # what the loop agent's result holds


# -- the recording ----------------------------------------------------------------------------


def served_calls(steps: Sequence[Step], attempt_id: str) -> list[Step]:
    """The recorded LLM calls a replay answers with, in order: those that earned the reward
    (:func:`~rollfleet.coordinator.experiences.training_calls` of ``attempt_id``) and the replies
    the agent discarded in their turns (asked again: it must discard them again)."""
    trained = {id(s) for s in training_calls(steps, attempt_id)}
    reused = {
        rid
        for s in steps
        if s.kind == RESUME_STEP and s.attempt_id == attempt_id
        for rid in s.payload.get("reused_calls") or []
    }
    last_reused: dict[str, int] = {}  # per earlier attempt: the sequence of its last reused call
    for s in steps:
        if s.kind == LLM_STEP and s.payload.get("request_id") in reused:
            last_reused[s.attempt_id] = s.sequence
    discarded = {
        (s.attempt_id, s.payload.get("request_id")) for s in steps if s.kind == DISCARD_STEP
    }

    def thrown_away(s: Step) -> bool:
        mine = s.attempt_id == attempt_id or s.sequence < last_reused.get(s.attempt_id, -1)
        return mine and (s.attempt_id, s.payload.get("request_id")) in discarded

    return [
        s
        for s in steps
        if s.kind == LLM_STEP
        and s.payload.get("finish_reason") != "abort"
        and (id(s) in trained or thrown_away(s))
    ]


@dataclass
class Recording:
    """A finished rollout of the loop agent as the store holds it, indexed for the checks."""

    rollout: Rollout
    steps: list[Step]
    attempt_id: str  # the attempt that completed the rollout
    calls: list[Step] = field(default_factory=list)  # served, in order
    llm: dict[str, Step] = field(default_factory=dict)  # every LLM call by request id
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)  # by request id
    turns: dict[int, dict[str, Any]] = field(default_factory=dict)  # the completing attempt's
    # the tool results of the trajectory's turns (the completing attempt's, and those of the turns
    # it took over from earlier attempts), by (turn, call); ``durable``: the mode records them
    results: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    durable: bool = False
    discards: set[str] = field(default_factory=set)
    call_rewards: dict[str, list[float]] = field(default_factory=dict)
    snapshots: dict[int, Any] = field(default_factory=dict)
    reward: dict[str, Any] | None = None  # the completing attempt's reward step

    @classmethod
    async def load(cls, store: Store, rollout_id: str) -> Recording:
        """Read a rollout and its steps; InvalidInput when it cannot be replayed (unknown, not
        finished, not succeeded, or not run by the loop agent)."""
        try:
            rollout = await store.get_rollout(rollout_id)
        except NotFound:
            raise InvalidInput(f"no rollout {rollout_id!r} in this store") from None
        status = rollout.status.value
        if not rollout.terminal:
            raise InvalidInput(
                f"rollout {rollout_id} is {status}, not finished: replay a finished rollout"
            )
        if rollout.status is not RolloutStatus.SUCCEEDED or rollout.attempt is None:
            raise InvalidInput(
                f"rollout {rollout_id} ended {status}: replay checks a rollout that succeeded"
                " (its reward and trajectory are what it reproduces)"
            )
        attempt_id = rollout.attempt.attempt_id
        steps = await read_all(
            lambda cursor: store.query_steps(rollout_id, cursor=cursor, limit=500)
        )
        steps.sort(key=lambda s: s.sequence)
        rec = cls(rollout, steps, attempt_id)
        rec._index()
        output = rollout.result.output if rollout.result is not None else None
        if (
            not rollout.mode
            or not isinstance(output, dict)
            or set(output) != LOOP_OUTPUT
            or rec.reward is None
        ):
            raise InvalidInput(
                f"rollout {rollout_id} was not run by the built-in loop agent (a custom --agent):"
                " replay re-drives only rollfleet.agents.loop:agent"
            )
        if rec.turns and not rec.calls:
            raise InvalidInput(
                f"rollout {rollout_id} has no recorded model calls to answer its agent with (a run"
                " with --engine URL or --engine-per-runner records none)"
            )
        return rec

    def _index(self) -> None:
        from rollfleet.agents.resume import (
            REPLY_STEP,
            SNAPSHOT_STEP,
            TOOL_RESULT_STEP,
            recorded_turns,
        )

        self.calls = served_calls(self.steps, self.attempt_id)
        self.durable = any(s.kind == TOOL_RESULT_STEP for s in self.steps)
        for record in recorded_turns(self.steps):  # as the completing attempt went on from them
            for index, call in enumerate(record.calls):
                if call.observation is not None:
                    result = {"tool": call.name, "observation": call.observation, "done": call.done}
                    self.results[(record.turn, index)] = result
        for s in self.steps:
            p, mine = s.payload, s.attempt_id == self.attempt_id
            turn = p.get("turn")
            if s.kind == LLM_STEP:
                self.llm[str(p.get("request_id"))] = s
            elif s.kind == REPLY_STEP:
                self.replies[str(p.get("request_id"))] = p
            elif s.kind == "turn" and mine and isinstance(turn, int):
                self.turns[turn] = p
            elif s.kind == DISCARD_STEP:
                self.discards.add(str(p.get("request_id")))
            elif s.kind == CALL_REWARD_STEP and mine:
                rewards = self.call_rewards.setdefault(str(p.get("request_id")), [])
                rewards.append(float(p.get("reward") or 0.0))
            elif s.kind == SNAPSHOT_STEP and isinstance(turn, int):
                if mine or turn not in self.snapshots:
                    self.snapshots[turn] = p.get("state")
            elif s.kind == "reward" and mine:
                self.reward = p


# -- token ids --------------------------------------------------------------------------------


def token_checker(rec: Recording, model: Path | None) -> tuple[EngineTokens | None, str | None]:
    """The token checker for a recording's calls, or None and why their ids are not checked."""
    engines = {str(s.payload.get("engine")) for s in rec.calls}
    if not rec.calls:
        return None, "the rollout made no model call"
    if engines != {"llamacpp"}:
        return None, f"engine {', '.join(sorted(engines))}: only llama.cpp prompts are rebuilt"
    if any(image_refs(s.payload.get("messages")) for s in rec.calls):
        return None, "calls with images: their prompts come from llama.cpp's vision projector"
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed here"
    names = {str(s.payload.get("model")) for s in rec.calls}
    if model is None:
        try:
            model = bundled_gguf()
        except RollfleetError as exc:
            return None, f"{exc.message}; or pass --model FILE.gguf"
        if names != {model.stem}:
            return None, (
                f"model {', '.join(sorted(names))} is not the bundled {model.stem}: pass"
                " --model FILE.gguf (the GGUF the run served)"
            )
    elif not model.is_file():
        raise InvalidInput(f"--model {model}: no such file")
    return EngineTokens(model), None


# -- what the agent is given ------------------------------------------------------------------


class _Completions:
    def __init__(self, answer: Callable[[dict[str, Any]], Any]) -> None:
        self._answer = answer

    async def create(self, **kwargs: Any) -> Any:
        """Answer one chat completion with the next recorded call."""
        return await self._answer(kwargs)


class RecordedLLM:
    """``ctx.llm`` of a replay: the OpenAI client's shape (``chat.completions.create``), each
    call answered with the next recorded one."""

    def __init__(self, answer: Callable[[dict[str, Any]], Any]) -> None:
        """Calls go to ``answer(kwargs)``."""
        self.chat = SimpleNamespace(completions=_Completions(answer))


class ReplayContext:
    """The :class:`~rollfleet.runner.context.RolloutContext` of a replay: the recorded rollout's
    ids and settings, a first attempt (nothing to resume from), every step checked as it is
    emitted."""

    def __init__(
        self, rec: Recording, llm: Any, on_step: Callable[[str, dict[str, Any]], None]
    ) -> None:
        """For ``rec``, with ``llm``; ``on_step(kind, payload)`` sees each step."""
        rollout = rec.rollout
        self.rollout_id, self.attempt_id = rollout.rollout_id, rec.attempt_id
        self.mode, self.metadata = rollout.mode, rollout.metadata
        self.resources, self.llm = None, llm
        self.env: Any = None
        self._on_step = on_step

    @property
    def cancelled(self) -> bool:
        """Never: a replay runs to its end or to its first divergence."""
        return False

    @property
    def attempt_number(self) -> int:
        """1: the replay goes through every turn itself."""
        return 1

    def emit(self, kind: Any, payload: dict[str, Any] | None = None) -> None:
        """Check one step against the recording (Diverged at the first difference)."""
        if not isinstance(kind, str):  # a StepIn
            kind, payload = kind.kind, kind.payload
        self._on_step(kind, json.loads(json.dumps(payload or {})))

    async def record(self, kind: str, payload: dict[str, Any]) -> None:
        """As :meth:`emit`."""
        self.emit(kind, payload)

    async def earlier_steps(self) -> list[Step]:
        """None: the replay is a first attempt."""
        return []
