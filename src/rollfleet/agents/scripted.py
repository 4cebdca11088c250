"""The scripted turn agent: a deterministic multi-turn rollout that resumes from its last turn,
for chaos runs of turn-level resume (``rollfleet.chaos``, bench/resume.py).

Each of ``input["turns"]`` turns (default 5) is a scripted "model call" that takes
``input["duration"]`` seconds (default 0.05) and replies with tokens derived from the rollout id
and the turn (:func:`reply_tokens`), then one call of ``write``, a side-effecting tool that
appends ``<rollout id> <turn>`` to the file ``input["ledger"]`` (when given). Replies and tool
results are recorded as :mod:`rollfleet.agents.resume` records them, so a later attempt reuses
every finished turn: no reply is made twice and no line is written twice. The result's
``output["tokens"]`` is the whole trajectory, the same whatever the attempts.
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


async def agent(input: Any, ctx: Any) -> RolloutResult:
    """Play the script's turns, going on from the last turn an earlier attempt finished."""
    settings = input if isinstance(input, dict) else {}
    turns, duration = int(settings.get("turns", 5)), float(settings.get("duration", 0.05))
    resumer = Resumer(ctx, LedgerSession(settings.get("ledger")), ScriptedMode())
    earlier = await resumer.resume()
    tokens: list[int] = []
    for turn in range(turns):
        reused = earlier[turn] if turn < len(earlier) else None
        call = ToolCall("write", {"line": f"{ctx.rollout_id} {turn}"})
        if reused is None:
            await asyncio.sleep(duration)  # the scripted model "generating"
            text = " ".join(map(str, reply_tokens(ctx.rollout_id, turn)))
            await resumer.reply(turn, f"{ctx.attempt_id}/{turn}", text, [call])
        else:
            text = reused.content
        await resumer.run(turn, 0, call, reused)
        tokens.extend(int(t) for t in text.split())
    return RolloutResult(
        reward=1.0, metrics={"turns_reused": float(len(earlier))}, output={"tokens": tokens}
    )
