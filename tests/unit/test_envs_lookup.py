"""The lookup mode: task checks, the lookup tool, rewards (partial credit too), the bundled data."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from rollfleet.envs import EnvSpec, build_env_source, get_mode
from rollfleet.envs.lookup import EXAMPLE, LookupSession, has_code, lookup_reward, resolve
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput

TABLE = {"Zerbin": "7Q4K2", "Malvox": "X9P3", "Trisdel": "A4B6C8"}
TASK: dict[str, Any] = {
    "question": "What is the access code of the Zerbin vault?",
    "key": "Zerbin",
    "table": TABLE,
}


def _task(**changes: Any) -> dict[str, Any]:
    return {**TASK, **changes}


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ([1], "expected a JSON object, got list"),
        (_task(key=None), "field 'key' must be str, got NoneType"),
        ({"question": "q", "key": "Zerbin"}, "field 'table' is missing"),
        (_task(table=["Zerbin"]), "field 'table' must be dict, got list"),
        (_task(table={}), "field 'key' 'Zerbin' is not in the table"),
        (_task(key="Quill"), "field 'key' 'Quill' is not in the table"),
        (_task(table={**TABLE, "Malvox": 1234}), "field 'table.Malvox' must be str, got int"),
        (_task(table={**TABLE, "Malvox": " "}), "field 'table.Malvox': a code must be 1 to 64"),
        (_task(table={**TABLE, "Malvox": "A" * 65}), "field 'table.Malvox': a code must be 1 to"),
        (_task(table={**TABLE, "K" * 65: "A1"}), r"field 'table\.K+': a key must be 1 to 64"),
        (_task(table={**TABLE, 5: "A1"}), "field 'table' keys must be str, got 5"),
        (
            _task(table={f"K{i}": f"C{i}" for i in range(62)} | TABLE),
            "field 'table' has 65 entries; at most 64",
        ),
        (_task(key="Z" * 65), "field 'key' is longer than 64 characters"),
        (_task(table={**TABLE, "Malvox": "7Q4K2"}), "field 'table': the key's code is not unique"),
    ],
)
def test_check_refuses_bad_tasks_naming_line_and_field(task: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=rf"data\.jsonl:3: {message}"):
        get_mode("lookup").check(task, "data.jsonl:3")


def test_check_accepts_a_good_task_and_prompts_hide_the_table() -> None:
    mode = get_mode("lookup")
    mode.check(TASK, "data.jsonl:1")
    shown = mode.system_prompt(TASK) + mode.user_prompt(TASK)
    assert "Zerbin vault" in shown and EXAMPLE in shown
    assert mode.user_prompt(TASK).endswith('\n(key: "Zerbin")')
    assert not any(code in shown for code in TABLE.values())


def test_resolve_matches_case_spaces_and_one_key_among_words() -> None:
    assert resolve("zerbin", TABLE) == "Zerbin"
    assert resolve(' "Zerbin" ', TABLE) == "Zerbin"
    assert resolve("the Zerbin vault", TABLE) == "Zerbin"
    assert resolve("Zerbin Malvox", TABLE) is None  # two keys: ambiguous
    assert resolve("Zerbinx", TABLE) is None
    assert resolve("Quorvane", TABLE) is None


async def test_lookup_tool_returns_codes_and_no_entry() -> None:
    session = await get_mode("lookup").open(TASK, None)
    assert isinstance(session, LookupSession)
    assert [t.name for t in session.tools] == ["lookup"]
    assert await session.call("lookup", {"key": "Malvox"}) == "Malvox: X9P3"
    assert not session.called_right_key
    assert await session.call("lookup", {"key": "Quill"}) == "no entry for Quill"
    assert await session.call("lookup", {"key": "Q" * 200}) == "no entry for " + "Q" * 64
    assert (await session.call("lookup", {})).startswith("error: lookup needs a key")
    assert (await session.call("lookup", {"key": 7})).startswith("error: lookup needs a key")
    assert (await session.call("search", {"key": "Zerbin"})).startswith("error: unknown tool")
    assert not session.called_right_key
    assert await session.call("lookup", {"key": "zerbin vault"}) == "Zerbin: 7Q4K2"
    assert session.called_right_key


async def test_scoring_full_partial_and_none() -> None:
    session = await get_mode("lookup").open(TASK, None)
    nothing = await session.score("I do not know")
    assert (nothing.reward, nothing.correct) == (0.0, False)
    assert nothing.details["called_right_key"] is False
    await session.call("lookup", {"key": "Zerbin"})
    await session.call("lookup", {"key": "Zerbin"})
    partial = await session.score("The code is 7Q4K")
    assert (partial.reward, partial.correct) == (0.25, False)  # counted once
    assert partial.details == {
        "called_right_key": True,
        "code_in_answer": False,
        "other_codes_in_answer": [],
        "expected": "7Q4K2",
    }
    full = await session.score("The access code is 7Q4K2.")
    assert (full.reward, full.correct) == (1.0, True)
    assert full.details["code_in_answer"] is True


def test_no_credit_for_a_guessed_or_other_code() -> None:
    assert lookup_reward("X9P3", "Zerbin", TABLE, called_right_key=False).reward == 0.0
    assert lookup_reward("12345", "Zerbin", TABLE, called_right_key=False).reward == 0.0
    hedged = lookup_reward("7Q4K2 or X9P3", "Zerbin", TABLE, called_right_key=False)
    assert (hedged.reward, hedged.correct) == (0.0, False)
    assert hedged.details["other_codes_in_answer"] == ["X9P3"]
    assert lookup_reward("A7Q4K2", "Zerbin", TABLE, called_right_key=False).reward == 0.0
    # The code alone, without a lookup, still counts: it cannot be guessed.
    assert lookup_reward("ANSWER 7Q4K2", "Zerbin", TABLE, called_right_key=False).correct


def test_has_code_is_whole_token() -> None:
    assert has_code("code: 7Q4K2!", "7Q4K2")
    assert has_code("(AB-12)", "AB-12")
    assert not has_code("7Q4K23", "7Q4K2")
    assert not has_code("x7Q4K2", "7Q4K2")
    assert not has_code("7q4k2", "7Q4K2")


def test_needs_no_environment() -> None:
    assert build_env_source(EnvSpec(mode="lookup")) is None


def _split(name: str) -> Path:
    return Path(str(resources.files("rollfleet.examples").joinpath(name)))


def test_bundled_splits_load_and_are_disjoint() -> None:
    mode = get_mode("lookup")
    train = [t.task for t in load_tasks(_split("lookup.jsonl"), mode)]
    held = [t.task for t in load_tasks(_split("lookup_eval.jsonl"), mode)]
    assert (len(train), len(held)) == (400, 64)

    def names(tasks: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
        return (
            {k for t in tasks for k in t["table"]},
            {c for t in tasks for c in t["table"].values()},
        )

    (train_keys, train_codes), (held_keys, held_codes) = names(train), names(held)
    assert not train_keys & held_keys and not train_codes & held_codes
    assert "Quorvane" not in train_keys | held_keys
    for task in train + held:
        assert task["key"] in task["question"]
        assert all(4 <= len(c) <= 6 for c in task["table"].values())


def test_generator_is_deterministic() -> None:
    from rollfleet.examples.make_lookup import EVAL_TASKS, tasks

    found = tasks()
    assert found == tasks()
    lines = _split("lookup_eval.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == found[:EVAL_TASKS]
