"""Reading a model's reply: native OpenAI tool calls, or the plain-text fallback small models
manage.

Plain text: ``CALL <tool> {json arguments}`` (anywhere in a line; what follows the arguments is
ignored), or ``<tool_call>{"name": …, "arguments": …}</tool_call>`` (the format several small
instruct models were tuned on), calls a tool;
anything else is the final answer (the part after ``ANSWER:`` when there is one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollfleet.envs.base import Tool

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_CALL = re.compile(r"\bCALL\s+([A-Za-z_][\w]*)[ \t]*(.*)$", re.MULTILINE)
_ANSWER = re.compile(r"ANSWER:\s*(.*)", re.DOTALL | re.IGNORECASE)


class Unparseable(ValueError):
    """The reply tried to call a tool but the call cannot be read."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the tool, its arguments, and the native call id when there was one."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    call_id: str | None = None


def tool_instructions(tools: Sequence[Tool]) -> str:
    """The plain-text protocol, appended to the system prompt when the mode has tools."""
    lines = "\n".join(f"- {t.signature()}" for t in tools)
    example_args = ", ".join(f'"{k}": "..."' for k in tools[0].parameters)
    return (
        f"\n\nTools:\n{lines}\nTo use a tool, reply with one line: CALL <tool> <JSON arguments>, "
        f"for example: CALL {tools[0].name} {{{example_args}}}\n"
        "When you know the answer, reply: ANSWER: <answer>"
    )


def _arguments(raw: Any, name: str) -> dict[str, Any]:
    if raw in (None, ""):
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, TypeError) as exc:
        raise Unparseable(f"arguments of {name!r} are not JSON: {raw!r:.200}") from exc
    if not isinstance(value, dict):
        raise Unparseable(f"arguments of {name!r} must be a JSON object, got {raw!r:.200}")
    return value


def _known(call: ToolCall, tools: Sequence[Tool]) -> ToolCall:
    names = {t.name for t in tools}
    if call.name not in names:
        raise Unparseable(f"unknown tool {call.name!r}; the tools are {', '.join(sorted(names))}")
    return call


def parse_native(tool_calls: Sequence[Any], tools: Sequence[Tool]) -> list[ToolCall]:
    """OpenAI ``message.tool_calls`` as ToolCalls (Unparseable for bad JSON or an unknown tool)."""
    calls = []
    for tc in tool_calls:
        fn = tc.function
        calls.append(_known(ToolCall(fn.name, _arguments(fn.arguments, fn.name), tc.id), tools))
    return calls


def parse_text(text: str, tools: Sequence[Tool]) -> ToolCall | None:
    """A tool call written as plain text, or None when the reply is a final answer."""
    if not tools:
        return None
    if match := _TAGGED.search(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError as exc:
            raise Unparseable(f"<tool_call> body is not JSON: {match.group(1)!r:.200}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise Unparseable("<tool_call> body needs a string 'name'")
        return _known(
            ToolCall(body["name"], _arguments(body.get("arguments"), body["name"])), tools
        )
    if match := _CALL.search(text):
        name = match.group(1)
        return _known(ToolCall(name, _arguments(_first_json(match.group(2)), name)), tools)
    return None


def _first_json(rest: str) -> str:
    """The arguments after ``CALL <tool>``: the first JSON value there (whatever text follows
    it on the line), else the rest of the line as it is."""
    rest = rest.strip()
    try:
        _, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        return rest
    return rest[:end]


def final_answer(text: str) -> str:
    """The answer part of a final reply: after the last ``ANSWER:``, else the whole reply."""
    found = _ANSWER.findall(text)
    return (found[-1] if found else text).strip()
