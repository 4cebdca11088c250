"""Mode rewards and task checks: computed from the answer, errors naming file:line and field."""

from __future__ import annotations

import pytest

from rollfleet.envs import get_mode
from rollfleet.envs.base import normalize_answer, token_f1
from rollfleet.envs.math import final_number, math_reward, to_number
from rollfleet.envs.py import extract_code
from rollfleet.envs.rag import rag_reward
from rollfleet.envs.web import web_reward
from rollfleet.errors import InvalidInput


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("3 + 4 = 7, so 9 in all\n#### 1,200", "1,200"),
        ("first #### 5 then #### 6", "6"),
        (r"The answer is \boxed{3/4}, not 5", "3/4"),
        ("She has 12 apples, then 15.", "15"),
        ("no numbers here", None),
        ("it costs -2.5 dollars", "-2.5"),
    ],
)
def test_final_number_prefers_hashes_then_boxed_then_last(reply: str, expected: str | None) -> None:
    assert final_number(reply) == expected


def test_math_reward_compares_numbers_exactly() -> None:
    assert math_reward("#### 1,200", 1200).reward == 1.0
    assert math_reward("so 0.75", "3/4").correct
    assert math_reward("#### 1201", 1200).reward == 0.0
    assert math_reward("nothing", 3).reward == 0.0
    assert to_number("abc") is None


def test_math_check_names_line_and_field() -> None:
    mode = get_mode("math")
    mode.check({"question": "q", "answer": 3}, "f.jsonl:1")
    with pytest.raises(InvalidInput, match=r"f\.jsonl:4: field 'answer' is missing"):
        mode.check({"question": "q"}, "f.jsonl:4")
    with pytest.raises(InvalidInput, match=r"f\.jsonl:5: field 'answer' must be a number"):
        mode.check({"question": "q", "answer": "many"}, "f.jsonl:5")
    with pytest.raises(InvalidInput, match=r"f\.jsonl:6: field 'question' must be str, got int"):
        mode.check({"question": 3, "answer": 1}, "f.jsonl:6")
    with pytest.raises(InvalidInput, match=r"f\.jsonl:7: expected a JSON object, got list"):
        mode.check([1], "f.jsonl:7")


@pytest.mark.parametrize(
    ("mode", "task", "message"),
    [
        (
            "py",
            {"prompt": "p", "entry_point": "f", "tests": ["f( == 1"]},
            "field 'tests.0' is not a Python expression",
        ),
        ("py", {"prompt": "p", "entry_point": "f", "tests": []}, "field 'tests' is empty"),
        (
            "py",
            {"prompt": "p", "entry_point": "f", "tests": ["1"] * 101},
            "field 'tests' has 101 tests; at most 100",
        ),
        (
            "py",
            {"prompt": "p", "entry_point": "f", "tests": ["1" * 2001]},
            "field 'tests.0' is 2001 characters; at most 2000",
        ),
        (
            "py",
            {"prompt": "p", "entry_point": "f", "tests": ["(" * 1000 + ")" * 1000]},
            "field 'tests.0' is not a Python expression",
        ),
        ("py", {"prompt": "p", "tests": ["1"]}, "field 'entry_point' is missing"),
        ("rag", {"question": "q", "answers": [""]}, "field 'answers.0' must be a non-empty string"),
        ("rag", {"question": "q", "answers": "x"}, "field 'answers' must be list"),
        (
            "web",
            {"question": "q", "answer": "a", "start": "index.html"},
            "field 'start' must be a path",
        ),
        ("osworld", {"instruction": "i"}, "field 'id' is missing"),
        ("osworld", {"id": "x", "instruction": "i", "config": {}}, "field 'config' must be a list"),
    ],
)
def test_mode_checks(mode: str, task: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=rf"data\.jsonl:9: {message}"):
        get_mode(mode).check(task, "data.jsonl:9")


def test_unknown_mode() -> None:
    with pytest.raises(
        InvalidInput,
        match="the modes are lookup, math, openenv, osworld, py, rag, reasoning-gym, verifiers, web, or ",
    ):
        get_mode("chess")


def test_f1_and_exact_match() -> None:
    assert normalize_answer("The  Grey Heron!") == "grey heron"
    assert token_f1("the Grey Heron ferry", "Grey Heron") == pytest.approx(0.8)
    assert token_f1("nothing", "Grey Heron") == 0.0
    score = rag_reward("Grey Heron.", ["the Grey Heron", "x"])
    assert score.reward == 1.0 and score.correct
    partial = rag_reward("it is the Grey ship", ["Grey Heron"])
    assert 0 < partial.reward < 1 and not partial.correct
    assert web_reward("binnacle", "Binnacle").reward == 1.0
    assert web_reward("Binnacle the cat", "Binnacle").reward == 0.0


def test_py_code_extraction_and_test_module() -> None:
    answer = (
        "Here:\n```python\ndef f():\n    return 1\n```\nand\n```py\ndef g():\n    return 2\n```"
    )
    assert extract_code(answer) == "def g():\n    return 2\n"
    assert extract_code("def h(): pass") == "def h(): pass"
