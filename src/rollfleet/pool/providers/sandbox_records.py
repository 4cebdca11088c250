"""What a sandbox is given and what it gives back: its limits, a run's result, the judge's report.

Kept apart from :mod:`.sandbox` (which starts and isolates the processes) so that the py mode,
pool configs and tests can read and build them without the machinery.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollfleet.errors import PoolError
from rollfleet.pool.providers.cgroup import CgroupLimits


class SandboxError(PoolError):
    """The sandbox itself failed (it could not start, or its judge did not report): an
    infrastructure failure, retried and counted apart, never scored."""


class SandboxLimits(BaseModel):
    """Resource limits applied to every process a sandbox runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_s: int = Field(default=10, ge=1, le=3600, description="CPU seconds per process")
    memory_mb: int = Field(
        default=1024, ge=64, le=65536, description="address space per process (RLIMIT_AS)"
    )
    wall_s: float = Field(default=30.0, gt=0, le=3600, description="wall-clock seconds per run")
    test_s: float = Field(default=5.0, gt=0, le=600, description="wall-clock seconds per test")
    file_mb: int = Field(
        default=64, ge=1, le=65536, description="largest file a run may write (RLIMIT_FSIZE)"
    )
    tmp_mb: int = Field(
        default=64, ge=1, le=65536, description="size of the sandbox's private /tmp (tmpfs, memory)"
    )
    open_files: int = Field(
        default=256, ge=16, le=65536, description="open descriptors (RLIMIT_NOFILE)"
    )
    processes: int = Field(
        default=64,
        ge=4,
        le=4096,
        description="processes of the sandbox (its cgroup's pids.max; RLIMIT_NPROC of its user)",
    )
    sandbox_memory_mb: int = Field(
        default=2048,
        ge=64,
        le=1 << 20,
        description="memory of the whole sandbox, its tmpfs files included (its cgroup's cap)",
    )
    cpus: float = Field(
        default=1.0, ge=0.01, le=1024, description="CPU cores the whole sandbox may use (cgroup)"
    )
    work_mb: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="size of the work dir (a tmpfs, mounted when root runs the sandbox)",
    )
    cgroup: bool = Field(
        default=True, description="a cgroup per sandbox where the host allows one (off: rlimits)"
    )
    work_tmpfs: bool = Field(
        default=True, description="a tmpfs work dir of work_mb when run by root (off: the disk)"
    )
    max_output_bytes: int = Field(
        default=1_000_000, ge=1024, le=1 << 28, description="stdout/stderr kept per run"
    )
    python: str = Field(default=sys.executable, description="the interpreter that runs code")
    isolation: Literal["bwrap", "none"] = Field(
        default="bwrap",
        description="bwrap: bubblewrap namespaces (the default); none: rlimits only, unsafe",
    )

    @model_validator(mode="after")
    def _room_for_processes(self) -> SandboxLimits:
        """The tmpfs (work dir and /tmp) is charged to the sandbox's memory: leave room."""
        if self.work_mb + self.tmp_mb >= self.sandbox_memory_mb:
            raise ValueError(
                f"work_mb + tmp_mb ({self.work_mb} + {self.tmp_mb} MB of tmpfs) must be less "
                f"than sandbox_memory_mb ({self.sandbox_memory_mb}), which they are charged to"
            )
        return self

    def cgroup_limits(self) -> CgroupLimits:
        """What a sandbox's cgroup caps (one process more than ``processes`` under bubblewrap:
        its own, outside the namespace)."""
        extra = 1 if self.isolation == "bwrap" else 0
        return CgroupLimits(self.sandbox_memory_mb << 20, self.processes + extra, self.cpus)


@dataclass(frozen=True)
class RunResult:
    """What one run in a sandbox produced."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    truncated: bool = False
    oom_killed: bool = False  # the sandbox's memory cap killed a process of it during the run

    @property
    def ok(self) -> bool:
        """True when the run finished in time with exit status 0."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class TestReport:
    """The judge's verdict per test (``why`` says what failed), and the raw run."""

    passed: list[bool]
    why: list[str]
    import_error: str | None = None
    result: RunResult | None = field(default=None, compare=False)

    @property
    def all_passed(self) -> bool:
        """True when there was at least one test and every one passed."""
        return bool(self.passed) and all(self.passed)


def read_report(stdout: str, tests: int) -> tuple[bool, dict[int, tuple[bool, str]], str | None]:
    """``(started, {test: (ok, why)}, import_error)`` from the judge's report lines; a line that
    does not parse ends the report (what follows it is not the judge's)."""
    started, verdicts, import_error = False, {}, None
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            break
        if not isinstance(record, dict):
            break
        if "started" in record:
            started = record["started"] == tests
        elif started and isinstance(record.get("test"), int) and 0 <= record["test"] < tests:
            verdicts[record["test"]] = (record.get("ok") is True, str(record.get("why", ""))[:500])
        elif started and "import_error" in record:
            error = record["import_error"]
            import_error = None if error is None else str(error)[:500]
    return started, verdicts, import_error
