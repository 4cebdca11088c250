"""Token-in across turns: a call that continues its attempt's conversation is prompted with the
exact tokens the engine saw and sampled before, plus the tokens of only the new messages.

Re-rendering and re-tokenizing the whole conversation every turn drifts: the sampled reply
``" 42"`` may tokenize back as ``" 4" "2"``, the end-of-turn token the model chose is re-rendered
from the template, a chat template may rewrite earlier turns. The trained sequence then differs
from what the model saw, and the trajectory splits into one training row per call. Here the
prompt of call ``n + 1`` is ``prompt(n) + completion(n) + gap``: ``completion(n)`` holds the
sampled end-of-generation token, and ``gap`` is the rest of the assistant's turn as the template
closes it (``"\\n"`` after ChatML's ``<|im_end|>``) followed by the new messages (tool results,
user turns) and the next assistant opener, rendered by the template as it renders them.

A reply read as tool calls comes back as an assistant message with ``tool_calls``: when they
are the calls (and content) read from the sampled text, the reply is that text, so the calls
continue token-in too; the tools offered must be the prior call's.

When that cannot hold (the agent trimmed its history, the template rewrites the past, the reply
the agent sent back is not the one sampled), :func:`continued_prompt` returns None and the engine
renders the whole conversation: the call starts a new training row, which the aggregation counts
as a merge break.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollfleet.engines.base import Message, message_text
from rollfleet.engines.tool_calls import same_turn


@dataclass(frozen=True)
class PriorCall:
    """A finished call of the same rollout attempt that a new call may continue."""

    request_id: str
    model: str
    messages: list[Message]
    prompt_ids: list[int]
    completion_ids: list[int]
    finish_reason: str
    text: str  # the reply as the engine returned it: the agent must send back exactly this
    tools: list[dict[str, Any]] | None = None  # the tools offered with the messages

    @property
    def tokens(self) -> list[int]:
        """The whole sequence the engine saw and sampled."""
        return self.prompt_ids + self.completion_ids


class Renderer(Protocol):
    """What an engine offers to build a continued prompt (its chat template and tokenizer)."""

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the chat template renders it, with the ``tools`` offered."""
        ...

    def fragment_ids(self, text: str) -> list[int]:
        """Token ids of text in the middle of a sequence (special tokens parsed, no BOS)."""
        ...

    def token_text(self, token: int) -> str:
        """The text of one token as the template writes it (``<|im_end|>`` for that token)."""
        ...

    def is_end(self, token: int) -> bool:
        """True for the engine's end-of-generation tokens."""
        ...


def _plain(messages: Sequence[Message]) -> list[Message]:
    """Messages with their content as text (what text templates render)."""
    return [{**m, "content": message_text(m.get("content"))} for m in messages]


def continues(
    prior: PriorCall, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
) -> bool:
    """True when ``messages`` are the prior call's messages, its reply, then anything new, with
    the same ``tools`` offered."""
    k = len(prior.messages)
    return (
        len(messages) > k
        and list(messages[:k]) == prior.messages
        and messages[k].get("role") == "assistant"
        and tools == prior.tools
    )


def _replayed(prior: PriorCall, messages: Sequence[Message]) -> list[Message] | None:
    """``messages`` with the reply to ``prior`` as its sampled text: an assistant message with
    ``tool_calls`` becomes that text when it holds the calls read from it (None otherwise)."""
    k = len(prior.messages)
    reply = messages[k]
    if not reply.get("tool_calls"):
        return list(messages)
    if not same_turn(prior.text, reply):
        return None
    return [*messages[:k], {"role": "assistant", "content": prior.text}, *messages[k + 1 :]]


def continued_prompt(
    renderer: Renderer,
    prior: PriorCall | None,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None = None,
) -> list[int] | None:
    """The prompt of a call that continues ``prior`` token-in, or None when it does not continue
    it (or cannot be continued exactly: the caller renders the whole conversation)."""
    if prior is None:
        return None
    if list(messages) == prior.messages and tools == prior.tools:  # asked again
        return list(prior.prompt_ids)
    if not prior.completion_ids or not continues(prior, messages, tools):
        return None
    replayed = _replayed(prior, messages)
    if replayed is None:
        return None  # the agent sent back other calls than the ones read from the reply
    k, tools = len(prior.messages), prior.tools
    plain = _plain(replayed)
    try:
        opened = renderer.render(plain[:k], True, tools)
        closed = renderer.render(plain[: k + 1], False, tools)
        whole = renderer.render(plain, True, tools)
    except Exception:  # a template that refuses the partial conversation: no continuation
        return None
    reply = plain[k]["content"]
    if reply != prior.text:
        return None  # the agent sent back another reply than the one sampled
    if not closed.startswith(opened + reply) or not whole.startswith(closed):
        return None  # the template rewrites the past, or the reply is not rendered verbatim
    closing = closed[len(opened) + len(reply) :]
    last = prior.completion_ids[-1]
    if prior.finish_reason == "stop" and renderer.is_end(last):
        end = renderer.token_text(last)
        if not closing.startswith(end):
            return None  # the model ended with another token than the template's end of turn
        closing = closing[len(end) :]
    return prior.tokens + renderer.fragment_ids(closing + whole[len(closed) :])


def token_in(prior: PriorCall, prompt_ids: list[int]) -> bool:
    """True when ``prompt_ids`` continue ``prior`` token-in (or repeat its prompt, for a call
    asked again)."""
    if prompt_ids == prior.prompt_ids:
        return True
    return bool(prior.completion_ids) and prompt_ids[: len(prior.tokens)] == prior.tokens
