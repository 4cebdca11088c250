"""``math``: word problems answered with a number; exact numeric match on the final number.

Task: ``{"question": str, "answer": number or numeric string}``. The final number of a reply
is the one after the last ``####``, else inside the last ``\\boxed{}``, else the last number
in the text. Numbers compare exactly as fractions (``1,200`` == ``1200.0``; ``3/4`` == ``0.75``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rollfleet.envs.base import Score, Tool, Transcript, require_fields
from rollfleet.errors import InvalidInput

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUMBER + r")\s*\}")
_ANY = re.compile(_NUMBER)


def to_number(text: str | float) -> Fraction | None:
    """A number written as text (commas, decimals, a fraction) as an exact Fraction; None if not
    one."""
    if isinstance(text, (int, float)):
        return Fraction(str(text))
    cleaned = text.strip().replace(",", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(reply: str) -> str | None:
    """The reply's final answer as written: after ``####``, in ``\\boxed{}``, or the last number."""
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(reply)
        if found:
            return str(found[-1])
    found = _ANY.findall(reply)
    return str(found[-1]) if found else None


def math_reward(reply: str, answer: str | float) -> Score:
    """1.0 when the reply's final number equals the answer exactly, else 0.0."""
    said = final_number(reply)
    got, want = (to_number(said) if said is not None else None), to_number(answer)
    correct = got is not None and want is not None and got == want
    return Score(
        reward=1.0 if correct else 0.0,
        correct=correct,
        details={"parsed": said, "expected": str(answer)},
    )


class MathSession:
    """No tools: the model reasons and answers."""

    def __init__(self, task: dict[str, Any]) -> None:
        """Score against ``task['answer']``."""
        self.tools: list[Tool] = []
        self.answer = task["answer"]

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Math offers no tools."""
        return f"error: there is no tool named {name!r}; answer directly"

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """Exact numeric match on the final number."""
        return math_reward(answer, self.answer)


class MathMode:
    """Grade-school word problems."""

    name = "math"
    uses_tools = False
    resume = "replay"  # a crashed rollout reuses the reply its last attempt received

    def check(self, task: Any, where: str) -> None:
        """``question`` text and a numeric ``answer``."""
        require_fields(task, where, {"question": str, "answer": (str, int, float)})
        if to_number(task["answer"]) is None:
            raise InvalidInput(f"{where}: field 'answer' must be a number, got {task['answer']!r}")

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Ask for the answer after ``####``."""
        return (
            "You solve math word problems. Think step by step, briefly. "
            "End your reply with a line '#### <number>' giving the final answer."
        )

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The question."""
        return str(task["question"])

    async def open(self, task: dict[str, Any], env: Any) -> MathSession:
        """A session scoring against the task's answer."""
        return MathSession(task)
