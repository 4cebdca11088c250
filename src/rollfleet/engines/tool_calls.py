"""OpenAI tool calling over a text model: the tools rendered into the prompt, the model's text
read back as ``tool_calls``.

Rendering (:func:`template_messages`): a chat template that knows tools (``tools`` appears in
its source: Qwen2.5, Llama 3.1, Hermes…) gets them as ``tools=`` and the messages as they are
(tool call arguments as objects, as transformers' templates take them). For a template without
(the bundled SmolLM2's ChatML), a built-in Hermes section is added to the system message (the
tools as JSON, one per line, in ``<tools>``, and the instruction to answer with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); an assistant message's
``tool_calls`` are written back as that text and ``role: "tool"`` results go into a user turn
as ``<tool_response>…</tool_response>``.

Parsing (:func:`parse_tool_calls`): Hermes ``<tool_call>{json}</tool_call>`` blocks (one or
several; the text before the first is the content), or the whole output as one Llama-3 style
JSON object ``{"name": ..., "parameters"|"arguments": {...}}``. All or nothing: a block that is
not a JSON call, a call naming a tool that was not offered, or one that ``tool_choice`` rules
out leaves the whole output as text, with the reason (``ToolParse.error``, recorded on the
Step as ``tool_parse_error``). With ``tool_choice: "none"`` nothing is read.

Streaming (:class:`ToolStream`): text streams as it comes until it may start a call (a
``<tool_call>`` tag, a prefix of one at its end, or an output that opens with ``{``); from
there it is held, and the end decides: the calls, or the held text as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollfleet.engines.base import Generation, GenerationRequest, Message, message_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_BARE = re.compile(r'\s*\{\s*"name"\s*:')  # an output that opens like a Llama-3 JSON call
SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def wire(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolParse:
    """A generation's text read for tool calls: the calls and the content before them, or no
    calls and, when the text tried one, why it was not taken (``error``)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None


# -- the request ----------------------------------------------------------------------------
def tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    """The names of the offered tools."""
    return [t["function"]["name"] for t in tools or ()]


def forced_name(tool_choice: Any) -> str | None:
    """The tool ``tool_choice`` names (``{"type": "function", "function": {"name": ...}}``)."""
    if isinstance(tool_choice, dict):
        return str(tool_choice["function"]["name"])
    return None


def reads_calls(request: GenerationRequest) -> bool:
    """True when the answer to ``request`` is read for tool calls."""
    return bool(request.tools) and request.tool_choice != "none"


def call_id(request_id: str, index: int) -> str:
    """The id of a request's ``index``-th call: the same wherever the answer is shaped (the
    response, the stream, the recorded Step)."""
    digest = hashlib.blake2b(f"{request_id}/{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


# -- rendering ------------------------------------------------------------------------------
def knows_tools(template: Any) -> bool:
    """True when a chat template's source renders ``tools`` itself."""
    return isinstance(template, str) and "tools" in template


def tools_section(tools: Sequence[dict[str, Any]]) -> str:
    """The built-in Hermes tool section of the system message."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return SECTION.format(tools=lines)


def call_text(call: dict[str, Any]) -> str:
    """One ``tool_calls`` entry of an assistant message as the ``<tool_call>`` block it was
    read from (the arguments string kept verbatim)."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    args = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
    name = json.dumps(function.get("name", ""), ensure_ascii=False)
    return f'{OPEN}\n{{"name": {name}, "arguments": {args}}}\n{CLOSE}'


def assistant_text(message: Message) -> str:
    """An assistant message as the text the model wrote: its content, then its calls."""
    content = message_text(message.get("content"))
    calls = "\n".join(call_text(c) for c in message.get("tool_calls") or ())
    return f"{content}\n{calls}" if content and calls else content or calls


def template_messages(
    messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None, native: bool
) -> list[Message]:
    """``messages`` ready for a chat template (content as text): as they are for a template
    that knows tools (``native``), else in the built-in Hermes form."""
    if native:
        return [_native(m) for m in messages]
    out: list[Message] = []
    after_tool = False  # the results of one turn share a user turn
    for m in messages:
        role = m.get("role")
        if role == "tool":
            response = f"<tool_response>\n{message_text(m.get('content'))}\n</tool_response>"
            if after_tool:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        elif role == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": assistant_text(m)})
        else:
            out.append({**m, "content": message_text(m.get("content"))})
        after_tool = role == "tool"
    if tools:
        section = tools_section(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _native(message: Message) -> Message:
    """A message for a template that renders tools itself: content as text, and the calls'
    arguments as objects where they parse (transformers' templates take them so)."""
    out = {**message, "content": message_text(message.get("content"))}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


# -- parsing --------------------------------------------------------------------------------
def parse_tool_calls(
    text: str,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: Any = "auto",
    request_id: str = "",
) -> ToolParse:
    """``text`` read for tool calls (see the module's docstring); ``tools`` None accepts any
    tool name."""
    if tool_choice == "none":
        return ToolParse(text)
    start = text.find(OPEN)
    if start >= 0:
        found = [(m.group(1), f"tool_call {i + 1}") for i, m in enumerate(_BLOCK.finditer(text))]
        content: str | None = text[:start].rstrip() or None
    elif _BARE.match(text):
        found, content = [(text, "the JSON call")], None
    else:
        return ToolParse(text, error=_required(tool_choice))
    calls, error = _calls(found, tools, tool_choice, request_id)
    if error is not None:
        return ToolParse(text, error=error)
    return ToolParse(content, tuple(calls))


def _calls(
    found: list[tuple[str, str]], tools: Sequence[dict[str, Any]] | None, choice: Any, rid: str
) -> tuple[list[ToolCall], str | None]:
    """The calls of the blocks found, or the first reason one is not taken."""
    names = None if tools is None else set(tool_names(tools))
    forced = forced_name(choice)
    calls = []
    for index, (body, where) in enumerate(found):
        try:
            name, arguments = _call(body)
        except ValueError as exc:
            return [], f"{where}: {exc}"
        if names is not None and name not in names:
            return [], f"{where}: calls {name!r}, which is not one of the tools offered"
        if forced is not None and name != forced:
            return [], f"{where}: calls {name!r}, but tool_choice names {forced!r}"
        calls.append(ToolCall(call_id(rid, index), name, arguments))
    return calls, None


def _call(body: str) -> tuple[str, str]:
    """The name and the arguments (a JSON string) of one call's JSON (ValueError: why not)."""
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError('not a JSON object with a "name"')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError("arguments are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError("arguments are not a JSON object")
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _required(tool_choice: Any) -> str | None:
    if tool_choice == "required" or forced_name(tool_choice) is not None:
        return "tool_choice asks for a tool call, and the output has none"
    return None


def read_tool_calls(request: GenerationRequest, result: Generation) -> Generation:
    """``result`` with its text read for tool calls, when ``request`` offered tools."""
    if not reads_calls(request):
        return result
    parsed = parse_tool_calls(result.text, request.tools, request.tool_choice, request.request_id)
    return dataclasses.replace(result, tool_parse=parsed)


def same_turn(text: str, message: Message) -> bool:
    """True when an assistant ``message`` carrying ``tool_calls`` is the answer the model gave
    as ``text``: the same content and the same calls (names and arguments, as JSON values)."""
    parsed = parse_tool_calls(text, None)
    sent = message.get("tool_calls") or []
    if not parsed.calls or len(sent) != len(parsed.calls):
        return False
    if (message_text(message.get("content")).rstrip() or None) != parsed.content:
        return False
    for call, mine in zip(sent, parsed.calls, strict=True):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        try:
            value = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            return False
        if function.get("name") != mine.name or value != json.loads(mine.arguments):
            return False
    return True


# -- streaming ------------------------------------------------------------------------------
class ToolStream:
    """Holds back streamed text that may be a tool call; what :meth:`feed` returns is content
    the answer keeps whatever follows (trailing whitespace is held too: before a call it is
    not content)."""

    def __init__(self) -> None:
        self.held = ""
        self.sent = 0  # characters of content sent (a bare JSON call must be the whole output)
        self.holding = False  # a call may have started: everything from here waits for the end

    def feed(self, text: str) -> str:
        """Take new text; return the part that can go out now."""
        buf = self.held + text
        if self.holding:
            self.held = buf
            return ""
        if not self.sent and buf.lstrip().startswith("{"):
            self.holding, self.held = True, buf
            return ""
        start = buf.find(OPEN)
        if start >= 0:
            self.holding = True
        else:
            start = len(buf) - _tag_prefix(buf)
        cut = len(buf[:start].rstrip())
        self.held, out = buf[cut:], buf[:cut]
        self.sent += len(out)
        return out

    def rest(self, parse: ToolParse | None) -> str:
        """At the end: the content not sent yet (what was held, unless calls were read: then
        the content before them, of which what went out is always the beginning)."""
        if parse is None or not parse.calls:
            return self.held
        return (parse.content or "")[self.sent :]


def _tag_prefix(text: str) -> int:
    """The length of the longest end of ``text`` that begins a ``<tool_call>`` tag (the tag has
    one ``<``: only the last one of the text can begin it)."""
    at = text.rfind("<", max(0, len(text) - len(OPEN) + 1))
    return len(text) - at if at >= 0 and OPEN.startswith(text[at:]) else 0
