"""One run's process in a sandbox: the limits it starts under (rlimits, the sandbox's cgroup,
a private umask), the seccomp program handed to bubblewrap on a pipe, its output capped, and how
it is killed: its session and, under bubblewrap, its whole PID namespace.

:class:`.sandbox.Sandbox` starts the process with these and keeps track of the runs in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
from collections.abc import Callable

from rollfleet.pool.providers.bwrap import namespace_pid, seccomp_filter
from rollfleet.pool.providers.cgroup import SandboxCgroup
from rollfleet.pool.providers.sandbox_records import SandboxLimits

SECCOMP_PROGRAM = seccomp_filter()  # this machine's; None where its architecture has none


def preexec(limits: SandboxLimits, cgroup: SandboxCgroup | None) -> Callable[[], None]:
    """The preexec function that moves the child into ``cgroup`` and applies ``limits`` before
    it runs anything."""

    def apply() -> None:
        if cgroup is not None:
            cgroup.join()
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.isolation == "none":  # under bwrap it is set inside, by prlimit
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes,) * 2)
        os.umask(0o077)

    return apply


def seccomp_pipe() -> int | None:
    """A pipe's read end holding the seccomp program, for bubblewrap's ``--seccomp`` (None on an
    architecture the filter does not know: the sandbox then runs without one)."""
    program = SECCOMP_PROGRAM
    if program is None:
        return None
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: the pipe holds them all
    finally:
        os.close(write)
    return read


class Started:
    """One started run, and how to kill everything it started."""

    def __init__(self, proc: asyncio.subprocess.Process, info_fd: int | None) -> None:
        self.proc, self.info_fd = proc, info_fd
        self.inside: int | None = None  # the sandbox's PID 1, once bubblewrap has said it

    def kill(self) -> None:
        """SIGKILL the run's session and, under bubblewrap, its whole PID namespace.

        The namespace outlives bubblewrap only when bubblewrap itself was killed: a bubblewrap
        that exited by itself waited for the sandbox's PID 1 (whose number may be reused).
        """
        code = self.proc.returncode
        if self.info_fd is not None and self.inside is None and (code is None or code < 0):
            self.inside = namespace_pid(self.info_fd)
        for kill, pid in ((os.kill, self.inside), (os.killpg, self.proc.pid)):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Release the info pipe."""
        if self.info_fd is not None:
            os.close(self.info_fd)
            self.info_fd = None


class Capture:
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
