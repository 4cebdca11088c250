"""The sandbox provider with real subprocesses, under bubblewrap and without (``--unsafe-sandbox``):
limits, timeouts, clean env, reset, pooling, and the judge that scores tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support import bubblewrap

from rollfleet.pool.pool import Pool
from rollfleet.pool.providers.sandbox import Sandbox, SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxLimits

LIMITS = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=20, test_s=3, max_output_bytes=4096)


@pytest.fixture(params=["bwrap", "none"])
async def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Sandbox]:
    """One started sandbox under tmp_path, isolated by bubblewrap or not."""
    if request.param == "bwrap":
        bubblewrap()
    limits = LIMITS.model_copy(update={"isolation": request.param})
    provider = SandboxProvider(limits, root=tmp_path)
    box = await provider.start("t-0")
    yield box
    await provider.stop(box)


async def test_sandbox_runs_code_and_reports_output_and_exit(sandbox: Sandbox) -> None:
    result = await sandbox.run_code(
        "import sys\nprint(input())\nprint('e', file=sys.stderr)\nsys.exit(3)", stdin="hello\n"
    )
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "e\n", 3)
    assert not result.ok and not result.timed_out


async def test_sandbox_does_not_inherit_secrets(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLFLEET_TEST_SECRET", "hunter2")
    result = await sandbox.run_code("import os; print(sorted(os.environ)); print(os.getcwd())")
    assert "ROLLFLEET_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout
    assert sandbox.workdir in result.stdout and os.environ.get("ROLLFLEET_TEST_SECRET") == "hunter2"


async def test_sandbox_wall_timeout_kills_the_process_group(sandbox: Sandbox) -> None:
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\nprint('started', flush=True)\ntime.sleep(60)"
    result = await sandbox.run_code(code, timeout_s=1.0)
    assert result.timed_out and result.exit_code is None and result.stdout == "started\n"
    assert not sandbox._running


async def test_sandbox_memory_limit_stops_a_hog(sandbox: Sandbox) -> None:
    result = await sandbox.run_code("x = bytearray(600 * 1024 * 1024)\nprint('allocated')")
    assert (
        result.exit_code != 0
        and "MemoryError" in result.stderr
        and "allocated" not in result.stdout
    )


async def test_sandbox_cpu_limit_stops_a_spinner(sandbox: Sandbox) -> None:
    result = await sandbox.run_code("while True:\n    pass")
    assert not result.timed_out and result.exit_code is not None and result.exit_code < 0


async def test_sandbox_output_is_capped(sandbox: Sandbox) -> None:
    result = await sandbox.run_code("print('x' * 100000)")
    assert result.truncated and len(result.stdout) == 4096 and result.exit_code == 0


async def test_sandbox_judge_scores_each_test(sandbox: Sandbox) -> None:
    tests = [
        "add(1, 2) == 3",
        "add(-1, -2) == -3",
        "3 == add(1, 2) < 4",
        "not add(0, 0)",
        "add(1, 1) in (2, 5)",
    ]
    good = await sandbox.run_tests("def add(a, b):\n    return a + b\n", tests)
    assert good.passed == [True] * 5 and good.all_passed and good.import_error is None
    bad = await sandbox.run_tests("def add(a, b):\n    return a - b\n", tests)
    assert bad.passed == [False, False, False, True, False]
    assert bad.why[0] == "add(1, 2) == 3: false (the solution answered [-1])"


async def test_sandbox_judge_compares_plain_values_of_every_kind(sandbox: Sandbox) -> None:
    solution = (
        "def f(x):\n    return {'a': [1, (2, 3)], 'b': {4}, 'c': b'x', 'd': None, 'e': 2.5, 'f': 2**100}[x]\n"
        "class Big(int):\n    def __eq__(self, other): return True\n"
        "def g():\n    return Big(7)\n"
    )
    tests = [
        "f('a') == [1, (2, 3)]",
        "f('b') == {4}",
        "f('c') == b'x'",
        "f('d') is None",
        "f('e') == 2.5",
        "f('f') == 2**100",
        "g() == 7",
        "g() == 8",
        "f('a') == [1, [2, 3]]",
    ]
    report = await sandbox.run_tests(solution, tests)
    # an int subclass is compared as the int it is, never through its own __eq__
    assert report.passed == [True, True, True, True, True, True, True, False, False]


async def test_sandbox_judge_fails_one_hung_test_and_goes_on(sandbox: Sandbox) -> None:
    solution = "def f(x):\n    while x:\n        pass\n    return 1\n"
    report = await sandbox.run_tests(solution, ["f(1) == 1", "f(0) == 1"])
    assert report.passed == [False, True] and "no answer within 3" in report.why[0]


async def test_sandbox_file_names_cannot_escape(sandbox: Sandbox) -> None:
    from rollfleet.errors import InvalidInput

    with pytest.raises(InvalidInput, match="escapes"):
        sandbox.write_files({"../evil.py": "x"})


async def test_sandbox_pool_resets_to_an_empty_directory(tmp_path: Path) -> None:
    bubblewrap()
    async with Pool(SandboxProvider(LIMITS, root=tmp_path), 1, name="py") as pool:
        async with pool.lease(timeout=10) as first:
            await first.handle.run_code("open('left-behind.txt', 'w').write('x')")
            assert (Path(first.endpoint or "") / "left-behind.txt").exists()
        async with pool.lease(timeout=10) as second:
            assert second.endpoint == first.endpoint
            assert sorted(p.name for p in Path(second.endpoint or "").iterdir()) == []
            assert (await second.handle.run_code("print(2 + 2)")).stdout == "4\n"
    assert not Path(first.endpoint or "").exists()
