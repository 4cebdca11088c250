"""``sandbox``: an isolated Python execution sandbox (the ``py`` mode's environment).

Each instance is a private directory; every run is a fresh subprocess started in it with
CPU, address-space, file-size and open-file rlimits, its own session (so the whole process
group is killed on timeout or reset), a wall-clock timeout, capped output and a clean
environment (no variable of the parent is inherited, so no secrets leak). Reset kills
whatever is still running and gives the instance a fresh, empty directory.

Not isolated: the network and the rest of the filesystem (use a container or VM provider
when the code is hostile rather than merely buggy).
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.errors import InvalidInput, PoolError


class SandboxLimits(BaseModel):
    """Resource limits applied to every process a sandbox runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_s: int = Field(default=10, ge=1, description="CPU seconds per run (RLIMIT_CPU)")
    memory_mb: int = Field(default=1024, ge=64, description="address space per process (RLIMIT_AS)")
    wall_s: float = Field(default=30.0, gt=0, description="wall-clock seconds per run")
    file_mb: int = Field(
        default=64, ge=1, description="largest file a run may write (RLIMIT_FSIZE)"
    )
    open_files: int = Field(default=256, ge=16, description="open descriptors (RLIMIT_NOFILE)")
    max_output_bytes: int = Field(
        default=1_000_000, ge=1024, description="stdout/stderr kept per run"
    )
    python: str = Field(default=sys.executable, description="the interpreter that runs code")


@dataclass(frozen=True)
class RunResult:
    """What one run in a sandbox produced."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the run finished in time with exit status 0."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class UnitTestResult:
    """A unit-test run: the raw result and the counts unittest reported."""

    result: RunResult
    ran: int
    failed: int

    @property
    def passed(self) -> bool:
        """True when at least one test ran and none failed or errored."""
        return self.result.ok and self.ran > 0 and self.failed == 0


def _rlimits(limits: SandboxLimits) -> Callable[[], None]:
    """The preexec function that applies ``limits`` in the child before it runs anything."""

    def apply() -> None:
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.umask(0o077)

    return apply


def _kill_group(pid: int) -> None:
    """SIGKILL the whole session a sandboxed run started; quiet when it is already gone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Capture:
    """The first ``cap`` bytes of a stream, and whether any more were dropped."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.dropped = cap, bytearray(), False

    async def read(self, stream: asyncio.StreamReader | None) -> None:
        """Read ``stream`` to its end."""
        while stream is not None and (chunk := await stream.read(65536)):
            room = self.cap - len(self.kept)
            self.kept += chunk[:room]
            self.dropped = self.dropped or len(chunk) > room

    def text(self) -> str:
        """What was kept, decoded."""
        return self.kept.decode(errors="replace")


_RAN = re.compile(r"^Ran (\d+) tests?", re.MULTILINE)
_FAILED = re.compile(r"^FAILED \((.*)\)", re.MULTILINE)


def unittest_counts(output: str) -> tuple[int, int]:
    """(tests run, tests failed or errored) from unittest's summary lines."""
    ran = int(m.group(1)) if (m := _RAN.search(output)) else 0
    failed = 0
    if m := _FAILED.search(output):
        failed = sum(
            int(n)
            for key, n in re.findall(r"(\w+)=(\d+)", m.group(1))
            if key in ("failures", "errors", "unexpected_successes")
        )
    return ran, failed


class Sandbox:
    """One instance: a private directory in which code runs as fresh, limited processes."""

    def __init__(self, path: Path, limits: SandboxLimits) -> None:
        """Use ``path`` (which must exist) as this sandbox's directory."""
        self.path = path
        self.limits = limits
        self._running: set[int] = set()
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(path),
            "TMPDIR": str(path),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
        }

    def write_files(self, files: Mapping[str, str]) -> None:
        """Write text files into the sandbox; names must stay inside it."""
        for name, text in files.items():
            target = (self.path / name).resolve()
            if not target.is_relative_to(self.path.resolve()):
                raise InvalidInput(f"sandbox file name {name!r} escapes the sandbox directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")

    async def run(
        self, argv: list[str], *, timeout_s: float | None = None, stdin: str | None = None
    ) -> RunResult:
        """Run ``argv`` in the sandbox under its limits; never raises for the program's failures."""
        timeout = timeout_s or self.limits.wall_s
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=self.path,
            env=self.env,
            start_new_session=True,
            preexec_fn=_rlimits(self.limits),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        )
        self._running.add(proc.pid)
        out, err = _Capture(self.limits.max_output_bytes), _Capture(self.limits.max_output_bytes)
        readers = asyncio.gather(out.read(proc.stdout), err.read(proc.stderr))
        try:
            if stdin is not None and proc.stdin is not None:
                proc.stdin.write(stdin.encode())
                proc.stdin.close()
            timed_out = not await self._wait(proc, timeout)
        finally:
            _kill_group(proc.pid)  # stragglers the program left behind go too
            self._running.discard(proc.pid)
            await proc.wait()
        try:  # a process that escaped the session may hold the pipes open: do not wait for it
            await asyncio.wait_for(readers, 5.0)
        except TimeoutError:
            pass
        return RunResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=None if timed_out else proc.returncode,
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
            truncated=out.dropped or err.dropped,
        )

    @staticmethod
    async def _wait(proc: asyncio.subprocess.Process, timeout: float) -> bool:
        """Wait for ``proc`` to exit; False (and the process group killed) after ``timeout``."""
        try:
            await asyncio.wait_for(proc.wait(), timeout)
            return True
        except TimeoutError:
            _kill_group(proc.pid)
            return False

    def python(self, *args: str) -> list[str]:
        """argv running the sandbox's interpreter isolated from the environment, writing no
        bytecode."""
        return [self.limits.python, "-E", "-s", "-B", *args]

    async def run_code(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> RunResult:
        """Run a Python program given as source text."""
        self.write_files({"main.py": code})
        return await self.run(self.python("main.py"), timeout_s=timeout_s, stdin=stdin)

    async def run_tests(
        self, solution: str, tests: str, *, module: str = "solution", timeout_s: float | None = None
    ) -> UnitTestResult:
        """Write ``solution`` as ``module``.py and ``tests`` as test_``module``.py; run unittest."""
        self.write_files({f"{module}.py": solution, f"test_{module}.py": tests})
        result = await self.run(
            self.python("-m", "unittest", f"test_{module}"), timeout_s=timeout_s
        )
        ran, failed = unittest_counts(result.stderr)
        return UnitTestResult(result=result, ran=ran, failed=failed)

    def kill_all(self) -> None:
        """Kill every process the sandbox is running now."""
        for pid in list(self._running):
            _kill_group(pid)

    def wipe(self) -> None:
        """Empty the directory (a fresh one for the next holder)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)


class SandboxProvider:
    """Makes :class:`Sandbox` instances under ``root`` (a temporary directory by default)."""

    name = "sandbox"

    def __init__(self, limits: SandboxLimits | None = None, root: str | Path | None = None) -> None:
        """Every sandbox gets ``limits``; directories live under ``root``."""
        self.limits = limits or SandboxLimits()
        self.root = Path(root) if root is not None else None
        if not Path(self.limits.python).exists():
            raise PoolError(f"sandbox: interpreter {self.limits.python} does not exist")

    async def start(self, instance_id: str) -> Sandbox:
        """A fresh private directory."""
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"rollfleet-{instance_id}-", dir=self.root))
        return Sandbox(path, self.limits)

    async def reset(self, handle: Sandbox) -> None:
        """Kill what still runs and empty the directory."""
        handle.kill_all()
        await asyncio.to_thread(handle.wipe)

    async def check(self, handle: Sandbox) -> None:
        """Run a trivial program; raise unless it prints ``ok``."""
        result = await handle.run(handle.python("-c", "print('ok')"), timeout_s=30)
        if result.stdout.strip() != "ok":
            raise PoolError(
                f"sandbox {handle.path}: check failed (exit {result.exit_code}, "
                f"timed out {result.timed_out}): {result.stderr[-500:]}"
            )

    async def stop(self, handle: Sandbox) -> None:
        """Kill what still runs and delete the directory."""
        handle.kill_all()
        await asyncio.to_thread(shutil.rmtree, handle.path, True)

    def endpoint(self, handle: Sandbox) -> str:
        """The sandbox's directory."""
        return str(handle.path)
