"""An agent of your own: one model call through ``ctx.llm``, scored by the task's mode.

    rollfleet train --mode math --agent examples/one_call_agent.py:agent \
        --data src/rollfleet/examples/arith.jsonl --steps 10

Whatever the agent asks ``ctx.llm`` is recorded token by token; the trainer trains on those
calls, with the reward the agent returns.
"""

from typing import Any

from rollfleet.envs import get_mode
from rollfleet.envs.base import Transcript, score_of
from rollfleet.model import RolloutResult


async def agent(input: dict[str, Any], ctx: Any) -> RolloutResult:
    mode = get_mode(ctx.mode)
    session = await mode.open(input, ctx.env)
    messages = [
        {"role": "system", "content": mode.system_prompt(input)},
        {"role": "user", "content": mode.user_prompt(input)},
    ]
    settings = ctx.metadata.get("run") or {}  # the run's --max-tokens, --temperature
    reply = await ctx.llm.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=settings.get("max_tokens", 64),
        temperature=settings.get("temperature", 1.0),
    )
    answer = reply.choices[0].message.content or ""
    score = await score_of(
        session, answer, Transcript([*messages, {"role": "assistant", "content": answer}])
    )
    return RolloutResult(reward=score.reward, output={"answer": answer})
