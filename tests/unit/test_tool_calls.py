"""Tool calls over a text model (rollfleet.engines.tool_calls): the parser on exact texts, the
answer and stream shapes, the rendering (built-in Hermes section, a template that knows tools),
the request checks, and token-in across a tool call. No engine, no I/O."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
from support import require

from rollfleet.engines.base import (
    Delta,
    FinishReason,
    Generation,
    GenerationRequest,
    Message,
)
from rollfleet.engines.continuation import PriorCall, continued_prompt, token_in
from rollfleet.engines.gateway.gateway import step_payload
from rollfleet.engines.gateway.wire import ChatBody, Shaper, parse_request
from rollfleet.engines.tool_calls import (
    ToolStream,
    parse_tool_calls,
    read_tool_calls,
    same_turn,
    template_messages,
)
from rollfleet.errors import InvalidInput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, SEARCH]
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "search", "arguments": {"q": "Rome"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def calls(text: str, tool_choice: Any = "auto") -> list[tuple[str, dict[str, Any]]]:
    parsed = parse_tool_calls(text, TOOLS, tool_choice, "req-1")
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# -- the parser -----------------------------------------------------------------------------
def test_one_hermes_call_is_read_with_an_openai_id_and_its_arguments_as_a_json_string() -> None:
    parsed = parse_tool_calls(PARIS, TOOLS, "auto", "req-1")
    (call,) = parsed.calls
    assert parsed.content is None and parsed.error is None
    assert call.wire() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert (
        call.id.startswith("call_")
        and call.id == parse_tool_calls(PARIS, TOOLS, "auto", "req-1").calls[0].id
    )
    assert call.id != parse_tool_calls(PARIS, TOOLS, "auto", "req-2").calls[0].id


def test_several_calls_are_read_in_order_with_distinct_ids() -> None:
    parsed = parse_tool_calls(f"{PARIS}\n{ROME}", TOOLS, "auto", "req-1")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("search", {"q": "Rome"}),
    ]
    assert len({c.id for c in parsed.calls}) == 2


def test_content_before_the_calls_stays_content() -> None:
    parsed = parse_tool_calls(f"Let me look that up.\n\n{PARIS}", TOOLS)
    assert parsed.content == "Let me look that up." and len(parsed.calls) == 1


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>', "not JSON"),
        ("<tool_call>[1, 2]</tool_call>", 'not a JSON object with a "name"'),
        ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>', "not a JSON object"),
        (f'{PARIS}\n<tool_call>{{"name": "search", "arguments": </tool_call>', "tool_call 2"),
        ('{"name": "get_weather", "arguments": {"city": "Par', "the JSON call: not JSON"),
    ],
)
def test_malformed_calls_leave_the_whole_text_with_the_reason(text: str, reason: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == () and parsed.content == text
    assert parsed.error is not None and reason in parsed.error


def test_a_call_to_a_tool_not_offered_stays_text_with_the_reason() -> None:
    text = '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == () and parsed.content == text
    assert parsed.error == (
        "tool_call 1: calls 'delete_everything', which is not one of the tools offered"
    )


@pytest.mark.parametrize("key", ["parameters", "arguments"])
def test_a_llama3_json_call_is_read(key: str) -> None:
    text = f' {{"name": "get_weather", "{key}": {{"city": "Paris"}}}}'
    parsed = parse_tool_calls(text, TOOLS)
    assert calls(text) == [("get_weather", {"city": "Paris"})] and parsed.content is None


def test_arguments_written_as_a_json_string_are_read_as_the_object() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    )
    assert calls(text) == [("get_weather", {"city": "Paris"})]


def test_plain_text_and_json_that_is_no_call_stay_text_without_a_reason() -> None:
    for text in ("It is sunny.", '{"answer": 4}', "Use <tool_call> tags? No."):
        parsed = parse_tool_calls(text, TOOLS)
        assert parsed.calls == () and parsed.content == text
    assert parse_tool_calls("It is sunny.", TOOLS).error is None


def test_tool_choice_none_reads_nothing_and_a_forced_choice_rules_out_other_tools() -> None:
    assert parse_tool_calls(PARIS, TOOLS, "none") == parse_tool_calls(PARIS, [], "none")
    assert parse_tool_calls(PARIS, TOOLS, "none").calls == ()
    forced = {"type": "function", "function": {"name": "search"}}
    parsed = parse_tool_calls(PARIS, TOOLS, forced)
    assert parsed.calls == () and "tool_choice names 'search'" in str(parsed.error)
    assert calls(ROME, forced) == [("search", {"q": "Rome"})]
    assert parse_tool_calls("no call", TOOLS, "required").error == (
        "tool_choice asks for a tool call, and the output has none"
    )


# -- shaping: the answer, the stream, the Step ----------------------------------------------
def request(tools: Any = TOOLS, choice: Any = "auto") -> GenerationRequest:
    return GenerationRequest(messages=list(ASK), tools=tools, tool_choice=choice)


def generation(req: GenerationRequest, text: str, finish: str = "stop") -> Generation:
    g = Generation(
        req.request_id, text, [1, 2], [3, 4], [-0.1, -0.2], FinishReason(finish), "e", "m", 0
    )
    return read_tool_calls(req, g)


def streamed(req: GenerationRequest, text: str, size: int) -> tuple[str, list[dict[str, Any]], str]:
    """The text in deltas of ``size`` characters through a Shaper: the content and the tool
    calls the chunks reassemble to, and the finish reason."""
    shaper = Shaper(req, ChatBody(messages=ASK), False)
    frames = [shaper.chunk(Delta(text[i : i + size], (i,))) for i in range(0, len(text), size)]
    frames += shaper.last(generation(req, text))
    content, parts, finish = "", {}, ""
    for frame in frames:
        (choice,) = frame["choices"]
        content += choice["delta"].get("content") or ""
        for part in choice["delta"].get("tool_calls") or ():
            got = parts.setdefault(part["index"], {"id": "", "name": "", "arguments": ""})
            got["id"] += part.get("id") or ""
            got["name"] += part["function"].get("name") or ""
            got["arguments"] += part["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return content, [parts[i] for i in sorted(parts)], finish


def whole(req: GenerationRequest, text: str) -> dict[str, Any]:
    return Shaper(req, ChatBody(messages=ASK), False).full(generation(req, text))["choices"][0]


TEXTS = [
    PARIS,
    f"Let me check.\n{PARIS}\n{ROME}",
    '{"name": "search", "parameters": {"q": "x"}}',
    "It is sunny in Paris, <tool_ not a call.",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "  spaced  \n",
    '{"answer": 4}',
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_deltas_reassemble_to_the_whole_answer(text: str, size: int) -> None:
    req = request()
    answer = whole(req, text)
    content, got, finish = streamed(req, text, size)
    message = answer["message"]
    assert content == (message["content"] or "") and finish == answer["finish_reason"]
    expected = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or ()
    ]
    assert got == expected
    assert (finish == "tool_calls") == bool(expected)


def test_the_whole_answer_has_tool_calls_and_null_content_as_openai_gives_them() -> None:
    choice = whole(request(), PARIS)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    cut = Shaper(request(), ChatBody(messages=ASK), False).full(
        generation(request(), PARIS, "length")
    )
    assert cut["choices"][0]["finish_reason"] == "length"  # calls read, but the output was cut


def test_without_tools_or_with_tool_choice_none_text_streams_as_it_comes() -> None:
    for req in (request(tools=None, choice=None), request(choice="none")):
        shaper = Shaper(req, ChatBody(messages=ASK), False)
        assert shaper.chunk(Delta("<tool_call>"))["choices"][0]["delta"]["content"] == "<tool_call>"
        assert whole(req, PARIS)["message"] == {"role": "assistant", "content": PARIS}


def test_the_stream_sends_text_until_it_may_start_a_call() -> None:
    stream = ToolStream()
    assert stream.feed("Sure") == "Sure"
    assert stream.feed(", one moment.\n<tool") == ", one moment."
    assert stream.feed("_call>{") == "" and stream.holding


def test_the_step_records_the_calls_or_the_reason() -> None:
    req = request()
    p = step_payload(req, generation(req, PARIS), 0.1, "r-0")
    assert p["tools"] == TOOLS and p["tool_choice"] == "auto" and p["tool_parse_error"] is None
    assert p["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert p["text"] == PARIS and p["finish_reason"] == "stop"  # the engine's, for training
    bad = step_payload(req, generation(req, "<tool_call>{</tool_call>"), 0.1, "r-0")
    assert bad["tool_calls"] is None and "not JSON" in bad["tool_parse_error"]
    plain = GenerationRequest(messages=list(ASK))
    assert "tools" not in step_payload(plain, generation(plain, "hi"), 0.1, "r-0")


# -- the request -----------------------------------------------------------------------------
async def parsed(**fields: Any) -> GenerationRequest:
    body = {"messages": ASK, **fields}
    return (await parse_request(json.dumps(body).encode(), True, None))[1]


async def test_tools_and_tool_choice_reach_the_request_and_its_messages() -> None:
    req = await parsed(tools=TOOLS)
    assert req.tools == TOOLS and req.tool_choice == "auto"
    assert req.messages == ASK
    named = {"type": "function", "function": {"name": "search"}}
    assert (await parsed(tools=TOOLS, tool_choice=named)).tool_choice == named
    assert (await parsed(tools=[], tool_choice="none")).tools is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [WEATHER] * 129}, "'tools'"),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "'tools': tool 'get_weather' is named twice"),
        (
            {"tools": [{**WEATHER, "function": {"name": "big", "description": "x" * 70_000}}]},
            "'tools'",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "'tool_choice'",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "'tool_choice'"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
            "messages.0.tool_calls.0.function",
        ),
    ],
)
async def test_bad_tools_are_refused_naming_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(field)) as info:
        await parsed(**fields)
    assert info.value.status_code == 422


# -- rendering ------------------------------------------------------------------------------
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
RESULTS = [
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]},
]


def test_the_built_in_template_adds_the_tools_and_writes_calls_and_results_as_text() -> None:
    out = template_messages([*ASK, CALLED, *RESULTS], TOOLS, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(SEARCH) + "\n</tools>" in system
    assert "<tool_call></tool_call> XML tags" in system
    assert out[2]["content"] == PARIS
    assert out[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n21 C\n</tool_response>"
    )
    own = template_messages([{"role": "system", "content": "Be brief."}, *ASK], TOOLS, False)
    assert own[0]["content"].startswith("Be brief.\n\n# Tools") and len(own) == 2
    assert template_messages(ASK, None, False) == ASK  # no tools: nothing added


def jinja_template(source: str | None) -> Any:
    require(bool(importlib.util.find_spec("jinja2")), "jinja2")
    from rollfleet.engines.llamacpp.model import ChatTemplate

    return ChatTemplate(source, "", "<|im_end|>")


SMOLLM2 = (  # the bundled GGUF's template: no tool support
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
KNOWS_TOOLS = (  # a template that renders tools and calls itself
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}\n{% endfor %}"
)


def test_the_llamacpp_template_renders_the_built_in_section_or_hands_tools_to_its_own() -> None:
    messages = [*ASK, CALLED, *RESULTS]
    text = jinja_template(SMOLLM2).render(messages, True, TOOLS)
    assert (
        text.startswith("<|im_start|>system\n# Tools") and f"assistant\n{PARIS}<|im_end|>" in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny" in text
    native = jinja_template(KNOWS_TOOLS).render(messages, True, TOOLS)
    assert native.startswith("TOOLS:get_weather;search;")
    assert "CALL get_weather Paris" in native  # arguments handed over as an object
    assert "tool: sunny" in native


def test_a_template_that_fails_on_the_messages_is_an_engine_error() -> None:
    from rollfleet.errors import EngineError

    with pytest.raises(EngineError, match="chat template failed"):
        jinja_template("{{ messages[0].content + 1 }}").render(ASK, True)


def test_the_hf_engine_renders_the_tools_through_its_chat_template() -> None:
    require(bool(importlib.util.find_spec("transformers")), "transformers (rollfleet[hf])")
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_tokenizer

    engine = HFEngine("tiny")
    engine.tokenizer = tiny_tokenizer()
    text = engine.render([*ASK, CALLED, *RESULTS], True, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and PARIS in text
    engine.tokenizer.chat_template = KNOWS_TOOLS
    assert engine.render(ASK, True, TOOLS).startswith("TOOLS:get_weather;search;")


# -- token-in across a tool call ------------------------------------------------------------
class CharRenderer:
    """A renderer on the built-in template whose tokens are characters (``<|im_end|>``: 0)."""

    END = "<|im_end|>"

    def __init__(self) -> None:
        self.template = jinja_template(None)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return str(self.template.render(messages, add_generation_prompt, tools))

    def fragment_ids(self, text: str) -> list[int]:
        pieces = text.split(self.END)
        ids = [ord(c) for c in pieces[0]]
        for piece in pieces[1:]:
            ids += [0, *(ord(c) for c in piece)]
        return ids

    def token_text(self, token: int) -> str:
        return self.END if token == 0 else chr(token)

    def is_end(self, token: int) -> bool:
        return token == 0


def test_a_tool_call_sent_back_continues_token_in_with_the_sampled_text() -> None:
    r = CharRenderer()
    sampled = f"Checking.\n{PARIS}"  # the model's own spacing: the reply is this text, verbatim
    prompt = r.fragment_ids(r.render(list(ASK), True, TOOLS))
    prior = PriorCall(
        "c1", "m", list(ASK), prompt, [*r.fragment_ids(sampled), 0], "stop", sampled, TOOLS
    )
    reply = {**CALLED, "content": "Checking."}
    turn2 = [*ASK, reply, RESULTS[0]]
    ids = continued_prompt(r, prior, turn2, TOOLS)
    assert ids is not None and token_in(prior, ids)
    gap = "".join(r.token_text(t) for t in ids[len(prior.tokens) :])
    assert (
        gap
        == "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # other calls sent back, other tools offered, or no tools: rendered whole
    other = {
        **reply,
        "tool_calls": [
            {**CALLED["tool_calls"][0], "function": {"name": "search", "arguments": "{}"}}
        ],
    }
    assert continued_prompt(r, prior, [*ASK, other, RESULTS[0]], TOOLS) is None
    assert continued_prompt(r, prior, [*ASK, reply, RESULTS[0]], [WEATHER]) is None
    assert continued_prompt(r, prior, [*ASK, reply, RESULTS[0]]) is None
    assert continued_prompt(r, prior, list(ASK)) is None  # a retry without the tools


def test_same_turn_compares_content_and_calls_as_json_values() -> None:
    spaced = {
        **CALLED,
        "tool_calls": [
            {
                **CALLED["tool_calls"][0],
                "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'},
            }
        ],
    }
    assert same_turn(PARIS, CALLED) and same_turn(PARIS, spaced)
    assert not same_turn(PARIS, {**CALLED, "content": "extra"})
    assert not same_turn("no call", CALLED)
