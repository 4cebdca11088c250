"""Tool calls through the gateway, with the official ``openai`` client and ``tools=``, against
the real llama.cpp engine (the bundled SmolLM2-135M, whose ChatML template has no tool support:
the gateway's built-in Hermes section is what it is shown).

The tiny model makes a call when the conversation shows it how: three earlier turns in which
the assistant answered a weather question with a ``get_weather`` call (sent as OpenAI
``tool_calls``, rendered back as ``<tool_call>`` text) and got the ``role: tool`` result. Asked
about Berlin, greedy decoding writes ``<tool_call>{"name": "get_weather", "arguments": {"city":
"Berlin"}}</tool_call>`` itself: nothing is forced, the test reads what the model wrote.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.client import llm_client
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.model import StepIn

pytestmark = pytest.mark.llamacpp
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]


def shown(city: str, n: int) -> list[dict[str, Any]]:
    """One earlier turn: the question, the assistant's call, the tool's result, the answer."""
    call = {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{n}", "content": "sunny"},
        {"role": "assistant", "content": f"It is sunny in {city}."},
    ]


CONVERSATION = [
    *shown("Paris", 1),
    *shown("Rome", 2),
    *shown("Madrid", 3),
    {"role": "user", "content": "What is the weather in Berlin?"},
]
BERLIN = [("get_weather", {"city": "Berlin"})]


class Recorded:
    """In-memory recorder standing in for the store's add_steps."""

    def __init__(self) -> None:
        self.steps: list[StepIn] = []

    async def __call__(self, rollout_id: str, attempt_id: str, step: StepIn) -> None:
        self.steps.append(step)


@pytest.fixture
async def served(llama):
    recorded = Recorded()
    gateway = Gateway(recorded)
    gateway.add_replica(llama, "llama-0")
    async with running_gateway(gateway) as url:
        yield url, recorded, llama


def prompt_text(engine: Any, step: StepIn) -> str:
    """The Step's prompt tokens as text, special tokens written out (llama.cpp's detokenizer)."""
    ids = step.payload["prompt_token_ids"]
    return bytes(engine.llm.model.detokenize(ids, special=True)).decode("utf-8", "replace")


def called(tool_calls: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or ()]


async def test_the_model_is_shown_the_tools_and_its_call_comes_back_as_tool_calls(served) -> None:
    url, recorded, engine = served
    async with llm_client(url, "ro-1", "at-1") as client:
        reply = await client.chat.completions.create(
            model="any", messages=CONVERSATION, tools=TOOLS, max_tokens=48, temperature=0
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and called(choice.message.tool_calls) == BERLIN
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert choice.message.content is None
    (step,) = recorded.steps
    p = step.payload
    assert p["tool_calls"] == [call.model_dump()] and p["tool_parse_error"] is None
    assert p["tools"] == TOOLS and p["tool_choice"] == "auto" and p["finish_reason"] == "stop"
    assert "<tool_call>" in p["text"]  # the text the model wrote is kept as it was
    prompt = prompt_text(engine, step)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in prompt
    # the earlier calls and results are shown as the text a call is made with
    shown_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{shown_call}<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt


async def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(served) -> None:
    url, recorded, _ = served
    async with llm_client(url, "ro-2", "at-2") as client:
        whole = await client.chat.completions.create(
            model="any", messages=CONVERSATION, tools=TOOLS, max_tokens=48, temperature=0
        )
        stream = await client.chat.completions.create(
            model="any",
            messages=CONVERSATION,
            tools=TOOLS,
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        content, parts, finish = "", {}, None
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for part in choice.delta.tool_calls or ():
                    got = parts.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                    got["id"] += part.id or ""
                    got["name"] += part.function.name or ""
                    got["arguments"] += part.function.arguments or ""
                finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    streamed = [(p["name"], json.loads(p["arguments"])) for p in parts.values()]
    assert streamed == called(whole.choices[0].message.tool_calls) == BERLIN
    first, second = (s.payload for s in recorded.steps)
    assert [p["id"] for p in parts.values()] == [c["id"] for c in second["tool_calls"]]
    assert second["text"] == first["text"]  # the same greedy output, read the same way


async def test_tool_choice_none_leaves_the_call_as_text(served) -> None:
    url, recorded, _ = served
    async with llm_client(url, "ro-3", "at-3") as client:
        reply = await client.chat.completions.create(
            model="any",
            messages=CONVERSATION,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=48,
            temperature=0,
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")
    (step,) = recorded.steps
    assert step.payload["tool_calls"] is None and step.payload["tool_parse_error"] is None


async def test_a_tool_result_continues_the_conversation_token_in(served) -> None:
    url, recorded, engine = served
    async with llm_client(url, "ro-4", "at-4") as client:
        reply = await client.chat.completions.create(
            model="any", messages=CONVERSATION, tools=TOOLS, max_tokens=48, temperature=0
        )
        message = reply.choices[0].message
        assert called(message.tool_calls) == BERLIN
        (call,) = message.tool_calls
        after = [
            *CONVERSATION,
            message.model_dump(exclude_none=True),  # content None left out, as clients send it
            {"role": "tool", "tool_call_id": call.id, "content": "cloudy, 12 C"},
        ]
        answer = await client.chat.completions.create(
            model="any", messages=after, tools=TOOLS, max_tokens=24, temperature=0
        )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    first, second = (s.payload for s in recorded.steps)
    assert second["continues"] == first["request_id"] and second["token_in"] is True
    sampled = first["prompt_token_ids"] + first["completion_token_ids"]
    assert second["prompt_token_ids"][: len(sampled)] == sampled  # what the model saw and wrote
    gap = prompt_text(engine, recorded.steps[1])[len(prompt_text(engine, recorded.steps[0])) :]
    assert gap.endswith(
        "<|im_start|>user\n<tool_response>\ncloudy, 12 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert gap.startswith(first["text"])  # the call as the model wrote it, not re-rendered


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [WEATHER] * 129}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}},
            "tool_choice",
        ),
    ],
)
async def test_bad_tools_are_a_422_naming_the_field_and_nothing_is_recorded(
    served, fields: dict[str, Any], field: str
) -> None:
    import openai

    url, recorded, _ = served
    async with llm_client(url, "ro-5", "at-5") as client:
        with pytest.raises(openai.UnprocessableEntityError, match=field) as info:
            await client.chat.completions.create(
                model="any", messages=CONVERSATION, max_tokens=4, **fields
            )
    assert info.value.status_code == 422 and recorded.steps == []
