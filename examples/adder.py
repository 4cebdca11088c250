"""A mode of your own, outside rollfleet: add two numbers with a tool, then answer.

rollfleet train --mode examples/adder.py:make --data examples/adder.jsonl --max-turns 3
"""

import re
from typing import Any

from rollfleet.envs.base import Score, Tool, Transcript, require_fields


class AdderSession:
    tools = [Tool("add", "returns a + b", {"a": "a number", "b": "a number"})]

    def __init__(self, task: dict[str, Any]) -> None:
        self.task = task

    async def call(self, name: str, args: dict[str, Any]) -> str:
        try:
            return str(float(args["a"]) + float(args["b"]))
        except (KeyError, TypeError, ValueError):
            return 'error: add needs two numbers, e.g. CALL add {"a": "2", "b": "3"}'

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        want = self.task["a"] + self.task["b"]
        right = want in {float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", answer)}
        added = any(c["tool"] == "add" for c in (transcript.calls if transcript else []))
        return Score(1.0 if right else 0.25 if added else 0.0, right, {"expected": want})


class AdderMode:
    name, uses_tools = "adder", True

    def check(self, task: Any, where: str) -> None:
        require_fields(task, where, {"a": int, "b": int})

    def system_prompt(self, task: dict[str, Any]) -> str:
        return "Use the add tool, then give the sum as ANSWER: <number>."

    def user_prompt(self, task: dict[str, Any]) -> str:
        return f"What is {task['a']} + {task['b']}?"

    async def open(self, task: dict[str, Any], env: Any) -> AdderSession:
        return AdderSession(task)


def make() -> AdderMode:
    return AdderMode()
