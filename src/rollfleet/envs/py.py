"""``py``: write a Python function; the reward runs the task's tests in the pool's sandbox.

Task: ``{"prompt": str, "entry_point": str, "tests": [str, ...]}`` where each test is a
Python boolean expression over the function (``"add(2, 3) == 5"``). The solution is the last
fenced code block of the final answer (or the whole answer); each test becomes one unittest
method, run by :meth:`Sandbox.run_tests` under the sandbox's CPU, memory and time limits.
Reward: the fraction of tests that passed. Tool: ``run_python`` (run a program, see its output).
"""

from __future__ import annotations

import re
from typing import Any

from rollfleet.envs.base import Score, Tool, handle_of, require_fields
from rollfleet.errors import InvalidInput, PoolError
from rollfleet.pool.providers.sandbox import Sandbox

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
OBSERVATION_LIMIT = 2000


def extract_code(answer: str) -> str:
    """The last fenced code block of ``answer``, or all of it when there is none."""
    blocks = _FENCE.findall(answer)
    return str(blocks[-1]) if blocks else answer


def unittest_source(tests: list[str]) -> str:
    """A unittest module with one test method per boolean expression."""
    lines = [
        "import unittest",
        "from solution import *",
        "",
        "",
        "class TaskTests(unittest.TestCase):",
    ]
    for i, expr in enumerate(tests):
        lines += [f"    def test_{i}(self):", f"        self.assertTrue({expr})", ""]
    lines += ["", "if __name__ == '__main__':", "    unittest.main()"]
    return "\n".join(lines) + "\n"


async def run_py_tests(sandbox: Sandbox, solution: str, tests: list[str]) -> Score:
    """Run ``tests`` against ``solution`` in ``sandbox``; reward = fraction passed."""
    outcome = await sandbox.run_tests(solution, unittest_source(tests))  # the sandbox's wall_s
    ran_all = outcome.ran == len(tests) and not outcome.result.timed_out
    passed = max(0, outcome.ran - outcome.failed) if ran_all else 0
    return Score(
        reward=passed / len(tests),
        correct=passed == len(tests),
        details={
            "tests": len(tests),
            "ran": outcome.ran,
            "passed": passed,
            "timed_out": outcome.result.timed_out,
            "stderr_tail": outcome.result.stderr[-400:],
        },
    )


class PySession:
    """Runs code in one sandbox."""

    def __init__(self, task: dict[str, Any], sandbox: Sandbox) -> None:
        """Score ``task``'s tests in ``sandbox``."""
        self.tools = [
            Tool(
                "run_python",
                "run a Python program and see its stdout and stderr",
                {"code": "the program's source"},
            )
        ]
        self.task, self.sandbox = task, sandbox

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """``run_python``: run the code, return exit status and (capped) output."""
        if name != "run_python":
            return f"error: unknown tool {name!r}; the only tool is run_python"
        result = await self.sandbox.run_code(str(args.get("code", "")), timeout_s=10)
        text = (
            f"exit={result.exit_code} timed_out={result.timed_out}\n{result.stdout}{result.stderr}"
        )
        return text[:OBSERVATION_LIMIT]

    async def score(self, answer: str) -> Score:
        """Fraction of the task's tests that pass."""
        return await run_py_tests(self.sandbox, extract_code(answer), list(self.task["tests"]))


class PyMode:
    """Function-writing tasks with unit tests."""

    name = "py"

    def check(self, task: Any, where: str) -> None:
        """``prompt``, ``entry_point`` and a list of test expressions that compile."""
        require_fields(task, where, {"prompt": str, "entry_point": str, "tests": list})
        for i, expr in enumerate(task["tests"]):
            if not isinstance(expr, str):
                raise InvalidInput(
                    f"{where}: field 'tests.{i}' must be str, got {type(expr).__name__}"
                )
            try:
                compile(expr, f"tests.{i}", "eval")
            except SyntaxError as exc:
                raise InvalidInput(
                    f"{where}: field 'tests.{i}' is not a Python expression: {exc.msg}"
                ) from None

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Ask for one fenced code block."""
        return (
            "You write correct, simple Python functions. Reply with the complete function "
            "in one ```python code block."
        )

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The task, naming the function."""
        return f"{task['prompt']}\nName the function `{task['entry_point']}`."

    async def open(self, task: dict[str, Any], env: Any) -> PySession:
        """A session on the leased sandbox."""
        sandbox = handle_of(env)
        if not isinstance(sandbox, Sandbox):
            raise PoolError("py mode needs a sandbox from the pool (ctx.env holds none)")
        return PySession(task, sandbox)
