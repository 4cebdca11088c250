"""The multi-turn tool-calling agent behind ``rollfleet run``.

Per turn: ask the model (``ctx.llm``, an OpenAI client) with the environment's tools, in
OpenAI's ``tools`` format and described in the prompt as plain text for models that do not
emit native calls; run the tool it calls and feed back the observation; stop at a final answer
or after ``max_turns``. A turn is retried up to ``max_retries`` times on an engine error or an
unreadable tool call. Every turn is one Step (``ctx.emit("turn", …)``); the reward is computed
by the mode's session from the final answer.

Screenshots (OSWorld's, or web pages rendered in Chromium) reach the model as OpenAI image
content parts: what the environment showed before any action goes with the task in the first
user message; a step's screenshots follow its tool results in a user message of their own
(``tool`` messages take text only).

Settings come from ``ctx.metadata["run"]``: ``max_turns``, ``max_retries``, ``max_tokens``,
``temperature``, ``model``, ``observation`` (what web and osworld show the model).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from rollfleet.agents.resume import Resumer
from rollfleet.agents.toolcalls import (
    ToolCall,
    Unparseable,
    final_answer,
    parse_native,
    parse_text,
    tool_instructions,
)
from rollfleet.envs import get_mode
from rollfleet.envs.base import (
    Observation,
    Session,
    Transcript,
    first_observation,
    image_part,
    score_of,
    turn_reward,
)
from rollfleet.errors import AgentError, EngineError
from rollfleet.model import CALL_REWARD_STEP, DISCARD_STEP, RolloutResult
from rollfleet.runner.context import RolloutContext

HISTORY_BUDGET_CHARS = 4500  # keeps prompts inside the bundled model's per-sequence context
# A reply ends where the model starts writing the next turn itself: the bundled 135M model follows
# its one-line call with a made-up "User: ..." line until max_tokens (on the 3-turn lookup run, 20
# of every 32 tokens it generated and trained on). The tokens sampled up to the cut stay in the
# call's completion ids (token-in keeps them); the reply's text stops before it.
TURN_STOPS = ("\nUser:",)
IMAGE_CHARS = 1000  # what an image counts for against that budget


@dataclass(frozen=True)
class LoopSettings:
    """How the loop runs (from the rollout's metadata)."""

    max_turns: int = 100
    max_retries: int = 3
    max_tokens: int = 256
    temperature: float = 0.7
    model: str | None = None
    observation: str | None = None

    @classmethod
    def of(cls, metadata: dict[str, Any]) -> LoopSettings:
        """Settings from ``metadata['run']`` (defaults for what is absent)."""
        run = metadata.get("run") or {}
        return cls(**{k: run[k] for k in cls.__dataclass_fields__ if k in run})


@dataclass
class Usage:
    """Tokens and LLM time across a rollout."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_s: float = 0.0
    retries: int = 0
    turns: int = 0
    tool_errors: int = 0  # observations that report an error (they start with "error")
    discarded: int = 0  # replies thrown away (an unreadable tool call, asked again)
    calls: list[str] = field(default_factory=list)


def rollout_seed(rollout_id: str) -> int:
    """A sampling seed derived from the rollout id (re-running a rollout samples the same way)."""
    return int(hashlib.sha256(rollout_id.encode()).hexdigest()[:8], 16)


def message_size(message: dict[str, Any]) -> int:
    """A message's size against the history budget: its text, and IMAGE_CHARS an image."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return len(content)
    return sum(
        len(str(part.get("text") or "")) if part.get("type") == "text" else IMAGE_CHARS
        for part in content
    )


def fit_history(
    messages: list[dict[str, Any]], budget: int = HISTORY_BUDGET_CHARS
) -> list[dict[str, Any]]:
    """Keep the system and task messages and as many recent turns as fit in ``budget``
    characters (an image counting IMAGE_CHARS)."""
    head, tail = messages[:2], messages[2:]
    size = sum(message_size(m) for m in head)
    kept: list[dict[str, Any]] = []
    for message in reversed(tail):
        size += message_size(message)
        if size > budget and kept:
            break
        kept.append(message)
    kept.reverse()
    while kept and kept[0].get("role") == "tool":  # a tool result must follow its call
        kept.pop(0)
    return head + kept


class Turn:
    """One model call (with retries) and what it produced."""

    def __init__(self, ctx: Any, session: Session, settings: LoopSettings, usage: Usage) -> None:
        self.ctx, self.session, self.settings, self.usage = ctx, session, settings, usage

    async def ask(
        self, messages: list[dict[str, Any]], turn: int
    ) -> tuple[str, list[ToolCall], str]:
        """Call the model until its reply is readable; (text, tool calls, the call's id). A
        reply thrown away for another try is marked discarded: it earns no training row."""
        errors: list[str] = []
        for attempt in range(self.settings.max_retries + 1):
            try:
                message, call_id = await self._call(messages, turn, attempt)
            except EngineError as exc:
                errors.append(str(exc))
                if attempt == self.settings.max_retries:
                    raise EngineError(  # infrastructure: the attempt is retried, never scored
                        f"turn {turn}: the engine failed {attempt + 1} times: {errors[-1]}"
                    ) from exc
                self.usage.retries += 1
                await asyncio.sleep(min(4.0, 0.25 * 2**attempt))
                continue
            text = message.content or ""
            try:
                calls = (
                    parse_native(message.tool_calls, self.session.tools)
                    if message.tool_calls
                    else [c for c in [parse_text(text, self.session.tools)] if c is not None]
                )
                return text, calls, call_id
            except Unparseable as exc:
                errors.append(str(exc))
                if attempt == self.settings.max_retries:
                    return text, [], call_id  # give up on the call: the reply is the answer
                self.usage.retries += 1
                self.usage.discarded += 1
                self.ctx.emit(DISCARD_STEP, {"request_id": call_id, "reason": str(exc)[:500]})
        raise AssertionError("unreachable")

    async def _call(
        self, messages: list[dict[str, Any]], turn: int, attempt: int
    ) -> tuple[Any, str]:
        import openai

        # The tools reach the model as text in the system prompt (tool_instructions), and its
        # calls are read from its text: the protocol the bundled model learned on. A served
        # model (--engine URL, settings.model set) gets them as OpenAI `tools=` too and may
        # answer with native tool_calls; the gateway's own tool section (engines/tool_calls.py)
        # is left out for the bundled model, whose prompt it would change.
        kwargs: dict[str, Any] = {}
        if self.session.tools and self.settings.model:
            kwargs["tools"] = [t.openai() for t in self.session.tools]
        started = time.perf_counter()
        try:
            response = await self.ctx.llm.chat.completions.create(
                model=self.settings.model or "default",
                messages=fit_history(messages),
                max_tokens=self.settings.max_tokens,
                temperature=self.settings.temperature,
                stop=list(TURN_STOPS),
                seed=rollout_seed(self.ctx.rollout_id) + 1000 * turn + attempt,
                **kwargs,
            )
        except openai.OpenAIError as exc:
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc
        self.usage.llm_s += time.perf_counter() - started
        if response.usage is not None:
            self.usage.prompt_tokens += response.usage.prompt_tokens
            self.usage.completion_tokens += response.usage.completion_tokens
        return response.choices[0].message, str(response.id)


def _assistant(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    native = [c for c in calls if c.call_id]
    if native:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.args)},
            }
            for c in native
        ]
    return message


def _observation(call: ToolCall, text: str) -> dict[str, Any]:
    if call.call_id:
        return {"role": "tool", "tool_call_id": call.call_id, "content": text}
    return {"role": "user", "content": f"Observation from {call.name}:\n{text}"}


def _screenshots(seen: list[tuple[str, Observation]]) -> list[dict[str, Any]]:
    """One user message carrying the turn's screenshots (none when there are none)."""
    parts: list[dict[str, Any]] = []
    for name, observation in seen:
        if observation.images:
            parts.append({"type": "text", "text": f"Screenshot after {name}:"})
            parts.extend(image_part(png) for png in observation.images)
    return [{"role": "user", "content": parts}] if parts else []


def task_message(prompt: str, first: Observation | None) -> dict[str, Any]:
    """The first user message: the task, with what the environment shows before any action
    (its text, and its screenshots as image parts)."""
    if first is None:
        return {"role": "user", "content": prompt}
    text = f"{prompt}\n\n{first.text}" if first.text else prompt
    if not first.images:
        return {"role": "user", "content": text}
    images = [image_part(png) for png in first.images]
    return {"role": "user", "content": [{"type": "text", "text": text}, *images]}


async def agent(input: Any, ctx: RolloutContext) -> RolloutResult:
    """Run one task of ``ctx.mode`` to a final answer and score it; a later attempt goes on
    from the turns an earlier one finished (:mod:`rollfleet.agents.resume`)."""
    if ctx.llm is None:
        raise AgentError("the loop agent needs ctx.llm (start the runner with --llm-url)")
    settings = LoopSettings.of(ctx.metadata)
    mode = get_mode(ctx.mode, settings.observation)
    session = await mode.open(input, ctx.env)
    if ctx.env is not None:
        ctx.emit(
            "env",
            {
                "pool": getattr(ctx.env, "pool", None),
                "instance_id": getattr(ctx.env, "instance_id", None),
                "endpoint": getattr(ctx.env, "endpoint", None),
            },
        )
    system = mode.system_prompt(input) + (tool_instructions(session.tools) if session.tools else "")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        task_message(mode.user_prompt(input), first_observation(session)),
    ]
    usage, answer, transcript = Usage(), "", Transcript(messages)
    turn_runner = Turn(ctx, session, settings, usage)
    resumer = Resumer(ctx, session, mode)
    earlier = await resumer.resume()
    for turn in range(settings.max_turns):
        if ctx.cancelled:
            raise asyncio.CancelledError()
        started = time.perf_counter()
        reused = earlier[turn] if turn < len(earlier) else None
        if reused is None:
            text, calls, call_id = await turn_runner.ask(messages, turn)
            await resumer.reply(turn, call_id, text, calls)
        else:  # a reply an earlier attempt received: the model is not asked again
            text, call_id = reused.content, reused.request_id
            calls = [ToolCall(c.name, c.args, c.call_id) for c in reused.calls]
        usage.turns += 1
        messages.append(_assistant(text, calls))
        observations, seen = [], []
        for index, call in enumerate(calls):
            seen.append((call.name, await resumer.run(turn, index, call, reused)))
            usage.calls.append(call.name)
            usage.tool_errors += seen[-1][1].text.lstrip().lower().startswith("error")
            observations.append(
                {
                    "tool": call.name,
                    "args": call.args,
                    "observation": seen[-1][1].text,
                    "images": len(seen[-1][1].images),
                }
            )
            transcript.calls.append({"turn": turn, **observations[-1]})
            messages.append(_observation(call, seen[-1][1].text))
        messages.extend(_screenshots(seen))
        shaped = await turn_reward(session, text, observations)
        if shaped:
            ctx.emit(CALL_REWARD_STEP, {"request_id": call_id, "turn": turn, "reward": shaped})
        ctx.emit(
            "turn",
            {
                "turn": turn,
                "request_id": call_id,
                "content": text,
                "tool_calls": observations,
                "seconds": time.perf_counter() - started,
                "retries": usage.retries,
                "reward": shaped,
                **({"reused": True} if reused is not None else {}),
            },
        )
        await resumer.turn_done(turn, reused)
        if not calls:
            answer = final_answer(text)
            break
        ended = [name for name, observation in seen if observation.done]
        if ended:  # the environment's episode is over (e.g. the agent called done or fail)
            answer = ended[-1]
            break
    score = await score_of(session, answer, transcript)
    ctx.emit(
        "reward",
        {"reward": score.reward, "correct": score.correct, "answer": answer, **score.details},
    )
    metrics = {
        "turns": float(usage.turns),
        "prompt_tokens": float(usage.prompt_tokens),
        "completion_tokens": float(usage.completion_tokens),
        "llm_s": usage.llm_s,
        "retries": float(usage.retries),
        "tool_calls": float(len(usage.calls)),
        "used_tools": float(bool(usage.calls)),
        "tool_errors": float(usage.tool_errors),
        "discarded": float(usage.discarded),
        "correct": float(score.correct),
    }
    return RolloutResult(
        reward=score.reward,
        metrics=metrics,
        output={"answer": answer, "messages": messages, "score": score.details},
    )
