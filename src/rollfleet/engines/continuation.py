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

When that cannot hold (the agent trimmed its history, the template rewrites the past, the reply
the agent sent back is not the one sampled), :func:`continued_prompt` returns None and the engine
renders the whole conversation: the call starts a new training row, which the aggregation counts
as a merge break.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rollfleet.engines.base import Message, message_text


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

    @property
    def tokens(self) -> list[int]:
        """The whole sequence the engine saw and sampled."""
        return self.prompt_ids + self.completion_ids


class Renderer(Protocol):
    """What an engine offers to build a continued prompt (its chat template and tokenizer)."""

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The conversation as the chat template renders it."""
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


def continues(prior: PriorCall, messages: Sequence[Message]) -> bool:
    """True when ``messages`` are the prior call's messages, its reply, then anything new."""
    k = len(prior.messages)
    return (
        len(messages) > k
        and list(messages[:k]) == prior.messages
        and messages[k].get("role") == "assistant"
    )


def continued_prompt(
    renderer: Renderer, prior: PriorCall | None, messages: Sequence[Message]
) -> list[int] | None:
    """The prompt of a call that continues ``prior`` token-in, or None when it does not continue
    it (or cannot be continued exactly: the caller renders the whole conversation)."""
    if prior is None:
        return None
    if list(messages) == prior.messages:  # the same question asked again (a retry)
        return list(prior.prompt_ids)
    if not prior.completion_ids or not continues(prior, messages):
        return None
    k = len(prior.messages)
    plain = _plain(messages)
    try:
        opened = renderer.render(plain[:k], True)
        closed = renderer.render(plain[: k + 1], False)
        whole = renderer.render(plain, True)
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
