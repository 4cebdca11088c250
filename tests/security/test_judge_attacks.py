"""A policy's attacks on the py judge, in a real bubblewrap sandbox: none of them scores.

Each reproduction of the review that found them (a solution-controlled object in an operand, a
patched builtin, the evaluator's descriptor taken over, a signal to the judge, an answer nested
to break its parser) scores 0 on tests an honest solution passes, and none of them turns a wrong
answer into an unscored run (a SandboxError, which the runner retries).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support import bubblewrap, eventually

from rollfleet.envs.py import run_py_tests
from rollfleet.errors import InfraError
from rollfleet.pool.providers.sandbox import Sandbox, SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxError, SandboxLimits

LIMITS = SandboxLimits(cpu_s=5, memory_mb=512, wall_s=20, test_s=3, processes=32)
FLOAT_TESTS = ["abs(f(3.5) - 0.5) < 1e-6", "abs(f(1.0) - 0.25) < 1e-6"]
TAKEOVER_TESTS = ["f(10) == 2**10", "f(3) == [1, 2] * 3", "h() == float('inf')"]
HONEST = (
    "def f(x):\n    if isinstance(x, float):\n        return x / 7 if x == 3.5 else x / 4\n"
    "    return 2**x if x == 10 else [1, 2] * x\n"
    "def h():\n    return float('inf')\n"
)
ANSWER_FDS = (
    "import json, os\n"
    "def _flood(line):\n"
    "    for fd in range(3, 30):\n"
    "        try:\n"
    "            os.write(fd, line.encode())\n"
    "        except OSError:\n"
    "            pass\n"
)


@pytest.fixture
async def box(tmp_path: Path) -> AsyncIterator[Sandbox]:
    """One started bubblewrap sandbox."""
    bubblewrap()
    provider = SandboxProvider(LIMITS, root=tmp_path / "boxes")
    sandbox = await provider.start("attack")
    yield sandbox
    await provider.stop(sandbox)


async def test_an_honest_solution_passes_every_test_form_the_attacks_use(box: Sandbox) -> None:
    score = await run_py_tests(box, HONEST, FLOAT_TESTS + TAKEOVER_TESTS)
    assert score.reward == 1.0, score.details


@pytest.mark.parametrize(
    "forged",
    [
        # an object whose arithmetic and comparisons all say "equal"
        "class Zero(float):\n    def __sub__(self, other):\n        return 0.0\n"
        "    def __abs__(self):\n        return 0.0\n    def __lt__(self, other):\n"
        "        return True\ndef f(x):\n    return Zero(9)\n",
        # the judge's abs replaced in the solution's process
        "import builtins\nbuiltins.abs = lambda x: 0\ndef f(x):\n    return 99.0\n",
    ],
    ids=["lying-object", "patched-abs"],
)
async def test_a_solution_controlled_operand_scores_nothing(box: Sandbox, forged: str) -> None:
    score = await run_py_tests(box, forged, FLOAT_TESTS)
    assert score.details["passed"] == 0 and score.reward == 0.0, score.details


async def test_an_evaluator_descriptor_taken_over_answers_only_for_its_own_calls(
    box: Sandbox,
) -> None:
    """It answers 0 to every line the judge sends: every expected value is computed in the
    judge, so 0 matches none of them."""
    forged = (
        ANSWER_FDS
        + "_flood(json.dumps({'ready': True}) + '\\n' + (json.dumps({'value': {'int': '0'}})"
        " + '\\n') * 50)\n"
        "def f(x):\n    return 0\ndef h():\n    return 0\n"
    )
    score = await run_py_tests(box, forged, TAKEOVER_TESTS)
    assert score.details["passed"] == 0, score.details


async def test_a_signal_to_the_judge_fails_the_tests_and_leaves_the_run_scored(
    box: Sandbox,
) -> None:
    forged = (
        "import os, signal\n"
        "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):\n"
        "    try:\n        os.kill(1, sig)\n    except OSError:\n        pass\n"
        "def f(x):\n    return 0.0\n"
    )
    score = await run_py_tests(box, forged, FLOAT_TESTS)  # no SandboxError: it was scored
    assert score.details["passed"] == 0 and score.reward == 0.0, score.details


async def test_an_answer_nested_to_break_the_parser_fails_the_test_only(box: Sandbox) -> None:
    forged = (
        ANSWER_FDS + "_flood(json.dumps({'ready': True}) + '\\n' + '[' * 200000 + '\\n')\n"
        "def f(x):\n    return 0.25\n"
    )
    score = await run_py_tests(box, forged, FLOAT_TESTS)
    assert score.details["passed"] <= 1 and not score.correct, score.details


async def test_a_judge_stopped_after_the_solution_started_fails_the_tests_left(
    box: Sandbox,
) -> None:
    """Whatever stops the judge once the solution runs, its tests fail: never an unscored run."""
    solution = "open('imported', 'w').close()\nimport time\ndef f():\n    time.sleep(30)\n"
    run = asyncio.create_task(box.run_tests(solution, ["f() == 1", "f() == 2"]))

    async def imported() -> bool:
        return (box.path / "imported").exists()

    await eventually(imported, timeout=20, what="the solution to be imported")
    for started in list(box._running.values()):
        started.kill()  # the sandbox's PID 1 (the judge) and bubblewrap, from outside
    report = await run
    assert report.passed == [False, False]
    assert all("stopped while the solution ran" in why for why in report.why), report.why


async def test_a_judge_that_never_started_is_an_infrastructure_failure(tmp_path: Path) -> None:
    bubblewrap()
    provider = SandboxProvider(LIMITS.model_copy(update={"python": "/bin/false"}), root=tmp_path)
    box = await provider.start("infra")
    try:
        with pytest.raises(SandboxError, match="the test judge did not start") as caught:
            await box.run_tests(HONEST, ["h() == 1"])
        assert isinstance(caught.value, InfraError)  # the runner retries it; never scored
    finally:
        await provider.stop(box)
