"""The scripted turn agent: a deterministic multi-turn rollout that resumes from its last turn,
for chaos runs of turn-level resume (``rollfleet.chaos``, bench/resume.py).

Each of ``input["turns"]`` turns (default 5) is a scripted "model call" that takes
``input["duration"]`` seconds (default 0.05) and replies with tokens derived from the rollout id
and the turn (:func:`reply_tokens`), then one call of ``write``, a side-effecting tool that
appends ``<rollout id> <turn>`` to the file ``input["ledger"]`` (when given). Replies and tool
results are recorded as :mod:`rollfleet.agents.resume` records them, so a later attempt reuses
every finished turn: no reply is made twice and no line is written twice. The result's
``output["tokens"]`` is the whole trajectory, the same whatever the attempts.

With ``input["llm"]`` true, each turn's reply is a real model call instead
(``ctx.llm.chat.completions.create``: the task and the turns so far as messages, exactly
``input["max_tokens"]`` tokens at temperature 0, a seed derived from the rollout and the turn);
the result's ``output`` then holds the replies (``"replies"``) and the request ids of the calls
the trajectory is made of (``"calls"``). ``input["resume"] = "restart"`` plays a mode that
declares ``restart`` (:class:`RestartMode`): every attempt starts from turn 0, the
restart-from-scratch side of bench/resume.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from rollfleet.agents.resume import Resumer
from rollfleet.agents.toolcalls import ToolCall
from rollfleet.envs.base import Score, Tool
from rollfleet.model import RolloutResult

TOKENS_PER_REPLY = 8


def reply_tokens(rollout_id: str, turn: int) -> list[int]:
    """The scripted model's reply at ``turn`` of ``rollout_id``."""
    digest = hashlib.sha256(f"{rollout_id}/{turn}".encode()).digest()
    return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") for i in range(TOKENS_PER_REPLY)]


class LedgerSession:
    """One tool, ``write``: appends a line to the ledger file (a side effect)."""

    tools = [Tool("write", "append a line to the ledger", {"line": "the line"}, side_effects=True)]

    def __init__(self, ledger: str | None) -> None:
        """Write to ``ledger`` (nowhere when None)."""
        self.ledger = ledger

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Append ``args["line"]`` (one atomic O_APPEND write)."""
        line = f"{args.get('line', '')}\n".encode()
        if self.ledger:
            fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return f"wrote {len(line)} bytes"

    async def score(self, answer: str) -> Score:
        """Every finished rollout scores 1.0."""
        return Score(1.0, True)


class ScriptedMode:
    """The mode the scripted agent plays: replayed on resume (its only tool is recorded)."""

    name = "scripted"
    uses_tools = True
    resume = "replay"


class RestartMode:
    """The same script, in a mode that declares ``restart``: a later attempt starts again."""

    name = "scripted-restart"
    uses_tools = True
    resume = "restart"


SYSTEM = "You are a terse assistant. Answer in a few words."


def turn_seed(rollout_id: str, turn: int) -> int:
    """The sampling seed of the model call at ``turn`` of ``rollout_id``."""
    digest = hashlib.sha256(f"seed/{rollout_id}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def turn_messages(rollout_id: str, replies: list[str]) -> list[dict[str, str]]:
    """The messages of the model call after ``replies``: the task, then each turn's reply and the
    write that followed it."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {rollout_id}: name one colour per turn."},
    ]
    for turn, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": f"Noted as line {turn}. Next colour?"})
    return messages


async def _model_reply(
    ctx: Any, settings: dict[str, Any], turn: int, replies: list[str]
) -> tuple[str, str]:
    """One real model call: its request id and its text."""
    response = await ctx.llm.chat.completions.create(
        model="default",
        messages=turn_messages(ctx.rollout_id, replies),
        max_tokens=int(settings.get("max_tokens", TOKENS_PER_REPLY)),
        temperature=0.0,
        seed=turn_seed(ctx.rollout_id, turn),
        extra_body={"ignore_eos": True},  # every reply exactly max_tokens long
    )
    return str(response.id), response.choices[0].message.content or ""


async def agent(input: Any, ctx: Any) -> RolloutResult:
    """Play the script's turns, going on from the last turn an earlier attempt finished."""
    settings = input if isinstance(input, dict) else {}
    turns, duration = int(settings.get("turns", 5)), float(settings.get("duration", 0.05))
    llm = bool(settings.get("llm"))
    mode = RestartMode() if settings.get("resume") == "restart" else ScriptedMode()
    resumer = Resumer(ctx, LedgerSession(settings.get("ledger")), mode)
    earlier = await resumer.resume()
    tokens: list[int] = []
    replies: list[str] = []
    calls: list[str] = []
    for turn in range(turns):
        reused = earlier[turn] if turn < len(earlier) else None
        call = ToolCall("write", {"line": f"{ctx.rollout_id} {turn}"})
        if reused is not None:
            request_id, text = reused.request_id, reused.content
        elif llm:
            request_id, text = await _model_reply(ctx, settings, turn, replies)
            await resumer.reply(turn, request_id, text, [call])
        else:
            await asyncio.sleep(duration)  # the scripted model "generating"
            request_id = f"{ctx.attempt_id}/{turn}"
            text = " ".join(map(str, reply_tokens(ctx.rollout_id, turn)))
            await resumer.reply(turn, request_id, text, [call])
        await resumer.run(turn, 0, call, reused)
        replies.append(text)
        calls.append(request_id)
        if not llm:
            tokens.extend(int(t) for t in text.split())
    output: dict[str, Any] = {"replies": replies, "calls": calls} if llm else {"tokens": tokens}
    return RolloutResult(reward=1.0, metrics={"turns_reused": float(len(earlier))}, output=output)
