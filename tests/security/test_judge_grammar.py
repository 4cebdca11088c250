"""The judge's test grammar: what it computes itself, what it asks the solution, what it refuses.

In-process: the judge's evaluator is replaced by an honest solution evaluated here, so the
property test can run thousands of expressions (the sandboxed attacks are in
test_judge_attacks.py).
"""

from __future__ import annotations

import ast
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.envs import get_mode
from rollfleet.errors import InvalidInput
from rollfleet.pool.providers.judge import Judge, check_test


def f(x: Any) -> Any:
    """The honest solution the property test scores: a function of one argument."""
    return x * 2 if isinstance(x, (int, float)) else x


class HonestJudge(Judge):
    """The judge with its evaluator replaced by ``f`` called here, recording each call asked."""

    def __init__(self) -> None:
        super().__init__("solution", test_s=5.0)
        self.asked: list[str] = []

    def ask(self, call: ast.Call, deadline: float) -> Any:
        """Evaluate the call of ``f`` (literal arguments) in this process."""
        self.asked.append(ast.unparse(call))
        value = f(*(ast.literal_eval(a) for a in call.args))
        self.answers.append(value)
        return value


@pytest.mark.parametrize(
    "expr",
    [
        "add(2, 3) == 5",
        "abs(f(3.5) - 0.5) < 1e-6",
        "f(10) == 2**10",
        "f(3) == [1, 2] * 3",
        "h() == float('inf')",
        "not 0 < g('x') <= (1, 2)",
        "math.isclose(area(2), math.pi * 4, rel_tol=1e-6)",
        "sorted(f([3, 1])) == [1, 3] and len(f('ab')) == 2",
        "f(-1)[1:] == {'a': (1, b'x')}['a'][::-1]",
        "is_even(4)",
    ],
)
def test_the_grammar_takes_the_forms_tests_are_written_in(expr: str) -> None:
    check_test(expr)


@pytest.mark.parametrize(
    ("expr", "named"),
    [
        ("f(g(1)) == 2", "literal arguments only, not 'g(1)'"),
        ("f(1).real == 1", "only math's constants"),
        ("__import__('os').system('x')", "only a function of the solution's, by name"),
        ("(lambda: 1)() == 1", "only a function of the solution's, by name"),
        ("[x for x in f(3)] == [1]", "a ListComp is not computed here"),
        ("f(x) == 1", "literal arguments only, not 'x'"),
        ("f(*[1]) == 1", "* or ** arguments"),
        ("f(1) @ f(2)", "operator MatMult"),
    ],
)
def test_forms_outside_the_grammar_are_refused_naming_the_part(expr: str, named: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_test(expr)
    assert named in str(caught.value)


def test_a_task_file_test_outside_the_grammar_is_refused_by_field() -> None:
    mode = get_mode("py")
    task = {"prompt": "p", "entry_point": "f", "tests": ["f(1) == 2", "f(g(1)) == 2"]}
    with pytest.raises(InvalidInput, match=r"tasks.jsonl:3: field 'tests.1' is outside the tests"):
        mode.check(task, "tasks.jsonl:3")


def test_arithmetic_too_large_to_make_fails_the_test_not_the_judge() -> None:
    judge = HonestJudge()
    for expr in ("f(1) == 10 ** 10 ** 8", "f('a') * 10**9 == 'x'", "f(1) << 10**9 == 1"):
        verdict = judge.test(expr)
        assert verdict["ok"] is False and "too large" in verdict["why"], (expr, verdict)


def test_the_judge_asks_only_for_the_solutions_calls() -> None:
    judge = HonestJudge()
    assert judge.test("abs(f(3.5) - 7.0) < 1e-6 and f(10) == 2**4 + 4") == {"ok": True, "why": ""}
    assert judge.asked == ["f(3.5)", "f(10)"]
    verdict = judge.test("f(2) == 5")
    assert verdict == {"ok": False, "why": "f(2) == 5: false (the solution answered [4])"}


# Random expressions over the grammar: literals, calls of the solution's f, arithmetic,
# comparisons, boolean operators and the computed builtins.
NUMBERS = st.one_of(
    st.integers(-50, 50), st.floats(-50, 50, allow_nan=False).map(lambda x: round(x, 3))
)
LEAVES = st.one_of(
    NUMBERS.map(repr),
    NUMBERS.map(lambda x: f"f({x!r})"),
    st.sampled_from(["math.pi", "math.e", "True", "None"]),
)


def _grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    ops = ["+", "-", "*", "//", "%", "<", "<=", "==", "!=", ">", "and", "or"]
    return st.one_of(
        st.tuples(inner, st.sampled_from(ops), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda e: f"abs({e})"),
        inner.map(lambda e: f"(not {e})"),
        inner.map(lambda e: f"(-{e})"),
        st.tuples(inner, inner).map(lambda t: f"max({t[0]}, {t[1]})"),
        st.tuples(inner, inner).map(lambda t: f"[{t[0]}, {t[1]}][1]"),
    )


EXPRESSIONS = st.recursive(LEAVES, _grow, max_leaves=8)


def _python(expr: str) -> tuple[str, Any]:
    """What plain Python says: ``("value", v)`` or ``("error", type)``."""
    try:
        return "value", bool(eval(expr, {"f": f, "math": math}))  # noqa: S307  test input
    except Exception as exc:  # noqa: BLE001
        return "error", type(exc).__name__


@settings(max_examples=400, deadline=None)
@given(EXPRESSIONS)
def test_the_judge_computes_what_python_computes_on_an_honest_solution(expr: str) -> None:
    check_test(expr)
    verdict = HonestJudge().test(expr)
    kind, value = _python(expr)
    if kind == "value":
        assert verdict["ok"] is value, (expr, verdict)
    else:
        assert verdict["ok"] is False and value in verdict["why"], (expr, verdict)
