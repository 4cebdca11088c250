"""Reading model replies: native tool calls, the plain-text fallback, final answers, history."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollfleet.agents.loop import LoopSettings, fit_history, rollout_seed
from rollfleet.agents.toolcalls import (
    ToolCall,
    Unparseable,
    final_answer,
    parse_native,
    parse_text,
    tool_instructions,
)
from rollfleet.envs.base import Tool

TOOLS = [
    Tool("search", "find documents", {"query": "words"}),
    Tool("read", "read one", {"doc_id": "id"}),
]


def test_plain_text_call_line() -> None:
    text = 'I will look.\nCALL search {"query": "lighthouse keeper"}\n'
    assert parse_text(text, TOOLS) == ToolCall("search", {"query": "lighthouse keeper"})
    assert parse_text("CALL read", TOOLS) == ToolCall("read", {})


def test_tagged_call() -> None:
    text = '<tool_call>{"name": "read", "arguments": {"doc_id": "seals"}}</tool_call>'
    assert parse_text(text, TOOLS) == ToolCall("read", {"doc_id": "seals"})


def test_answer_is_not_a_call() -> None:
    assert parse_text("ANSWER: Kettlewick", TOOLS) is None
    assert parse_text("CALL search {}", []) is None  # a mode with no tools never calls


@pytest.mark.parametrize(
    "text",
    [
        'CALL search {"query": ',
        "CALL fly {}",
        "<tool_call>{oops}</tool_call>",
        'CALL search ["a"]',
        '<tool_call>{"arguments": {}}</tool_call>',
    ],
)
def test_unreadable_calls(text: str) -> None:
    with pytest.raises(Unparseable):
        parse_text(text, TOOLS)


def test_native_calls() -> None:
    call = SimpleNamespace(
        id="c1", function=SimpleNamespace(name="search", arguments='{"query": "x"}')
    )
    assert parse_native([call], TOOLS) == [ToolCall("search", {"query": "x"}, "c1")]
    bad = SimpleNamespace(id="c2", function=SimpleNamespace(name="nope", arguments="{}"))
    with pytest.raises(Unparseable, match="unknown tool 'nope'"):
        parse_native([bad], TOOLS)


def test_final_answer_and_instructions() -> None:
    assert final_answer("thinking...\nANSWER: Grey Heron") == "Grey Heron"
    assert final_answer("  just this ") == "just this"
    text = tool_instructions(TOOLS)
    assert 'CALL search {"query": "..."}' in text and "- read {" in text


def test_fit_history_keeps_task_and_recent_turns() -> None:
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    turns = [
        {"role": "assistant", "content": "a" * 100},
        {"role": "user", "content": "o" * 100},
    ] * 10
    kept = fit_history(head + turns, budget=450)
    assert kept[:2] == head and len(kept) < len(head + turns)
    assert kept[-1] == turns[-1]
    assert fit_history(head, budget=10) == head


def test_settings_and_seed() -> None:
    settings = LoopSettings.of({"run": {"max_turns": 2, "max_tokens": 9, "unknown": 1}})
    assert (settings.max_turns, settings.max_tokens, settings.max_retries) == (2, 9, 3)
    assert rollout_seed("a") == rollout_seed("a") != rollout_seed("b")


def test_a_call_mid_line_or_with_text_after_its_arguments_is_read() -> None:
    said = 'The answer is: CALL search {"query": "keeper"}, for example: 42'
    assert parse_text(said, TOOLS) == ToolCall("search", {"query": "keeper"})
    assert parse_text('CALL read {"doc_id": "d1"} then ANSWER', TOOLS) == ToolCall(
        "read", {"doc_id": "d1"}
    )
