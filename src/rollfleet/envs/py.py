"""``py``: write a Python function; the reward runs the task's tests in the pool's sandbox.

Task: ``{"prompt": str, "entry_point": str, "tests": [str, ...]}`` where each test is a
boolean expression over the function (``"add(2, 3) == 5"``, ``"abs(area(2) - 12.57) < 0.01"``)
of the judge's grammar (:func:`~rollfleet.pool.providers.judge.check_test`: the solution's
functions are called with literal arguments; arithmetic, comparisons, a few builtins and
``math`` around them). Tasks are untrusted input: a test is only parsed here, and a test outside
the grammar is refused by line and field when the task file is read. The solution is the last
fenced code block of the final answer (or the whole answer); :meth:`Sandbox.run_tests` scores it
with the sandbox's judge, which has the solution answer its calls in a process of their own and
computes the rest itself, so the solution can neither see the expected values nor forge a pass.
Write tests as ``call == expected`` (a bare ``call`` passes on any truthy value).
Reward: the fraction of tests that passed. A sandbox that fails raises SandboxError (an
infrastructure failure: the attempt is retried, never scored). Tool: ``run_python``.
"""

from __future__ import annotations

import re
from typing import Any

from rollfleet.envs.base import EnvSpec, Score, Tool, Transcript, handle_of, require_fields
from rollfleet.errors import InvalidInput, PoolError
from rollfleet.pool.base import EnvSource
from rollfleet.pool.providers.judge import check_test
from rollfleet.pool.providers.sandbox import Sandbox

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
OBSERVATION_LIMIT = 2000
MAX_TESTS = 100  # per task
MAX_TEST_CHARS = 2000  # per test expression


def extract_code(answer: str) -> str:
    """The last fenced code block of ``answer``, or all of it when there is none."""
    blocks = _FENCE.findall(answer)
    return str(blocks[-1]) if blocks else answer


async def run_py_tests(sandbox: Sandbox, solution: str, tests: list[str]) -> Score:
    """Run ``tests`` against ``solution`` in ``sandbox``; reward = fraction passed."""
    report = await sandbox.run_tests(solution, tests)
    passed = sum(report.passed)
    failures = [why for ok, why in zip(report.passed, report.why, strict=True) if not ok]
    return Score(
        reward=passed / len(tests),
        correct=passed == len(tests),
        details={
            "tests": len(tests),
            "passed": passed,
            "import_error": report.import_error,
            "failures": [why[:300] for why in failures[:5]],
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

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """Fraction of the task's tests that pass."""
        return await run_py_tests(self.sandbox, extract_code(answer), list(self.task["tests"]))


class PyMode:
    """Function-writing tasks with unit tests."""

    name = "py"
    uses_tools = True
    pools_instances = True  # --use-vm-pool shares num_instances among one process's rollouts
    shares_process = False  # one runner process per rollout, unless a pool shares sandboxes

    def check(self, task: Any, where: str) -> None:
        """``prompt``, ``entry_point`` and a list of test expressions that compile."""
        require_fields(task, where, {"prompt": str, "entry_point": str, "tests": list})
        if len(task["tests"]) > MAX_TESTS:
            raise InvalidInput(
                f"{where}: field 'tests' has {len(task['tests'])} tests; at most {MAX_TESTS}"
            )
        for i, expr in enumerate(task["tests"]):
            if not isinstance(expr, str):
                raise InvalidInput(
                    f"{where}: field 'tests.{i}' must be str, got {type(expr).__name__}"
                )
            if len(expr) > MAX_TEST_CHARS:
                raise InvalidInput(
                    f"{where}: field 'tests.{i}' is {len(expr)} characters; at most "
                    f"{MAX_TEST_CHARS}"
                )
            try:
                check_test(expr)
            except SyntaxError as exc:
                raise InvalidInput(
                    f"{where}: field 'tests.{i}' is not a Python expression: {exc.msg}"
                ) from None
            except (ValueError, RecursionError, MemoryError) as exc:
                raise InvalidInput(
                    f"{where}: field 'tests.{i}' is outside the tests the judge computes: {exc}"
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

    def env_source(self, spec: EnvSpec, concurrency: int) -> EnvSource:
        """Sandboxes, one per rollout or a pool of ``num_instances``."""
        from rollfleet.pool import env_source

        return env_source(
            self._provider(spec),
            use_pool=spec.use_pool,
            num_instances=spec.num_instances,
            concurrency=concurrency,
            pool_name="py",
        )

    def preflight(self, spec: EnvSpec, local: bool) -> None:
        """bubblewrap must be able to make its namespaces here (not checked for
        ``--unsafe-sandbox``)."""
        self._provider(spec).preflight()

    def _provider(self, spec: EnvSpec) -> Any:
        from rollfleet.pool import SandboxLimits, SandboxProvider

        return SandboxProvider(SandboxLimits(**spec.sandbox))
