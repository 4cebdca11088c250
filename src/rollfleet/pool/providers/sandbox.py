"""``sandbox``: an isolated Python execution sandbox (the ``py`` mode's environment).

Each instance is a private directory; every run is a fresh process started in it under
bubblewrap (:mod:`.bwrap`: its own user, PID, network, IPC and mount namespaces, an unprivileged
uid, read-only system files, no view of the host's files, processes or network), with CPU,
address-space, file-size, open-file and process-count rlimits, a wall-clock timeout, capped output
and a clean environment (those per-process pieces: :mod:`.sandbox_process`). Reset kills whatever
still runs (the whole PID namespace goes with it) and empties the instance's directory.

Where the host allows, the sandbox as a whole is capped too: a cgroup of its own
(:mod:`.cgroup`: memory, tmpfs pages included, processes and CPU; a memory hog past the cap is
OOM-killed in its own sandbox, and the run says so in :attr:`RunResult.oom_killed`), and, run by
root, its directory is a tmpfs of ``work_mb`` (ENOSPC past it, the host's disk untouched). Where it
does not, :class:`SandboxProvider` says so in one line at start-up and the per-process rlimits
remain.

Tests are scored by :mod:`.judge`, which runs in the sandbox too and keeps the expected values
away from the process the solution runs in. Its report travels on its stdout, which the
solution's processes do not hold; a judge that fails to report is a :class:`SandboxError` (the
infrastructure's failure), never a score of 0.

``isolation="none"`` (``--unsafe-sandbox``) runs the same processes without bubblewrap: only the
rlimits and the clean environment remain. For code you trust, on machines without bubblewrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from rollfleet.errors import InvalidInput, PoolError
from rollfleet.pool.providers import judge
from rollfleet.pool.providers.bwrap import (
    WORKDIR,
    bwrap_command,
    bwrap_path,
    interpreter,
    mount_workdir,
    prepare_workdir,
    sandbox_uid,
    tmpfs_refusal,
    unmount_workdir,
)
from rollfleet.pool.providers.cgroup import (
    CGROUP_ROOT,
    CgroupHost,
    SandboxCgroup,
    detect,
)
from rollfleet.pool.providers.sandbox_process import Capture, Started, preexec, seccomp_pipe
from rollfleet.pool.providers.sandbox_records import (
    RunResult,
    SandboxError,
    SandboxLimits,
    TestReport,
    read_report,
)

JUDGE_SOURCE = Path(judge.__file__).read_text(encoding="utf-8")  # run with -c: nothing to bind
log = logging.getLogger("rollfleet.pool")


class Sandbox:
    """One instance: a private directory in which code runs as fresh, limited processes."""

    def __init__(
        self,
        path: Path,
        limits: SandboxLimits,
        *,
        uid: int | None = None,
        cgroup: SandboxCgroup | None = None,
        mounted: bool = False,
    ) -> None:
        """Use ``path`` (which must exist) as this sandbox's directory; run as ``uid`` when root
        runs it (by default from the directory's inode: pass the one taken before a tmpfs was
        mounted on it), in ``cgroup``; ``mounted``: a tmpfs on ``path`` is this sandbox's."""
        self.path = path
        self.limits = limits
        self.isolated = limits.isolation == "bwrap"
        self.uid = sandbox_uid(path) if uid is None else uid
        self.cgroup, self.mounted = cgroup, mounted
        self._running: dict[int, Started] = {}
        if self.isolated:
            self.interpreter, self._prefix = interpreter(limits.python)
            prepare_workdir(path, self.uid)
        else:
            self.interpreter, self._prefix = limits.python, None
        home = WORKDIR if self.isolated else str(path)
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": "/tmp" if self.isolated else str(path),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
        }

    @property
    def workdir(self) -> str:
        """The work directory as the sandboxed program sees it."""
        return WORKDIR if self.isolated else str(self.path)

    def write_files(self, files: Mapping[str, str]) -> None:
        """Write text files into the sandbox; names must stay inside it."""
        for name, text in files.items():
            target = (self.path / name).resolve()
            if not target.is_relative_to(self.path.resolve()):
                raise InvalidInput(f"sandbox file name {name!r} escapes the sandbox directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            target.chmod(0o644)

    def command(
        self, argv: Sequence[str], info_fd: int | None = None, seccomp_fd: int | None = None
    ) -> list[str]:
        """``argv`` as it is started: inside bubblewrap unless isolation is off."""
        if not self.isolated:
            return list(argv)
        return bwrap_command(
            argv,
            workdir=self.path,
            env=self.env,
            processes=self.limits.processes,
            tmp_mb=self.limits.tmp_mb,
            python_prefix=self._prefix,
            info_fd=info_fd,
            seccomp_fd=seccomp_fd,
            uid=self.uid,
        )

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        stdin: str | None = None,
    ) -> RunResult:
        """Run ``argv`` in the sandbox under its limits; never raises for the program's failures."""
        timeout = timeout_s or self.limits.wall_s
        started = time.monotonic()
        info_read, info_write = os.pipe() if self.isolated else (None, None)
        program = seccomp_pipe() if self.isolated else None
        passed = tuple(fd for fd in (info_write, program) if fd is not None)
        ooms = self._ooms()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(argv, info_write, program),
                cwd=self.path,
                env=self.env,
                start_new_session=True,
                preexec_fn=preexec(self.limits, self.cgroup),
                pass_fds=passed,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            )
        except BaseException as exc:
            if info_read is not None:
                os.close(info_read)
            if isinstance(exc, subprocess.SubprocessError):  # the preexec hook failed
                raise SandboxError(f"sandbox {self.path}: could not start a run: {exc}") from exc
            raise
        finally:
            for fd in passed:
                os.close(fd)
        run = self._running[proc.pid] = Started(proc, info_read)
        out, err = Capture(self.limits.max_output_bytes), Capture(self.limits.max_output_bytes)
        readers = asyncio.gather(out.read(proc.stdout), err.read(proc.stderr))
        try:
            if stdin is not None and proc.stdin is not None:
                proc.stdin.write(stdin.encode())
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
                timed_out = False
            except TimeoutError:
                timed_out = True
        finally:
            run.kill()  # stragglers the program left behind go too
            await proc.wait()
            run.close()
            self._running.pop(proc.pid, None)
        try:  # a process that escaped the session may hold the pipes open: do not wait for it
            await asyncio.wait_for(readers, 5.0)
        except TimeoutError:
            pass
        return RunResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=None if timed_out else self._status(proc.returncode),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
            truncated=out.dropped or err.dropped,
            oom_killed=self._ooms() > ooms,
        )

    def _ooms(self) -> int:
        """How many processes the sandbox's memory cap has killed so far (0 without a cgroup)."""
        return 0 if self.cgroup is None else self.cgroup.counter("oom_kill")

    def _status(self, code: int | None) -> int | None:
        """The exit status as subprocess reports it: bubblewrap passes on a death by signal N as
        128 + N, which becomes -N (so a program's own ``exit(137)`` reads as SIGKILL too)."""
        if self.isolated and code is not None and 128 < code <= 128 + 64:
            return 128 - code
        return code

    def python(self, *args: str) -> list[str]:
        """argv running the sandbox's interpreter isolated from the environment, writing no
        bytecode; under bubblewrap without ``site`` too (the standard library only: no ``.pth``
        file of the host's runs inside, and start-up stays fast)."""
        return [self.interpreter, "-E", "-s", "-B", *(["-S"] if self.isolated else []), *args]

    async def run_code(
        self, code: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> RunResult:
        """Run a Python program given as source text."""
        self.write_files({"main.py": code})
        return await self.run(self.python("main.py"), timeout_s=timeout_s, stdin=stdin)

    async def run_tests(
        self, solution: str, tests: Sequence[str], *, module: str = "solution"
    ) -> TestReport:
        """Score ``solution`` (written as ``module``.py) against boolean test expressions.

        The judge runs in the sandbox. SandboxError when it never started (the sandbox failed,
        not the solution); once it started, a test it could not report on failed (whatever
        stopped the judge, the solution ran by then).
        """
        self.write_files({f"{module}.py": solution})
        request = json.dumps({"tests": list(tests), "module": module, "test_s": self.limits.test_s})
        result = await self.run(
            [self.interpreter, "-I", "-S", "-B", "-c", JUDGE_SOURCE],
            stdin=request,
            timeout_s=len(tests) * self.limits.test_s + self.limits.wall_s,
        )
        started, verdicts, import_error = read_report(result.stdout, len(tests))
        if not started:
            raise SandboxError(
                f"sandbox {self.path}: the test judge did not start (exit {result.exit_code}, "
                f"timed out {result.timed_out}): {result.stderr[-300:].strip()}"
            )
        stopped = (
            f"the judge was stopped while the solution ran (exit {result.exit_code},"
            f" timed out {result.timed_out}"
            + (", the sandbox's memory cap killed a process)" if result.oom_killed else ")")
        )
        return TestReport(
            passed=[bool(verdicts.get(i, (False, ""))[0]) for i in range(len(tests))],
            why=[verdicts.get(i, (False, stopped))[1] for i in range(len(tests))],
            import_error=import_error,
            result=result,
        )

    async def kill_all(self) -> None:
        """Kill every process the sandbox is running now (everything in its cgroup too, where it
        has one), and wait until they are gone."""
        running = list(self._running.values())
        for run in running:
            run.kill()
        for run in running:
            await run.proc.wait()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)

    def wipe(self) -> None:
        """Empty the directory for the next holder; the directory itself stays, and with it its
        tmpfs and its inode, from which the sandbox's uid came (unique while it exists)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        if self.isolated:
            prepare_workdir(self.path, self.uid)

    def close(self) -> None:
        """Remove the sandbox, once nothing runs in it: its cgroup, its tmpfs, its directory."""
        steps: list[Callable[[], None]] = []
        if self.mounted:  # first: the tmpfs's pages leave the cgroup's charge
            steps.append(functools.partial(unmount_workdir, self.path))
        if self.cgroup is not None:
            steps.append(self.cgroup.remove)
        failed: list[OSError] = []
        for step in steps:
            try:
                step()
            except OSError as exc:
                failed.append(exc)
        shutil.rmtree(self.path, ignore_errors=True)
        if failed:
            raise SandboxError(f"sandbox {self.path}: left behind: {failed}") from failed[0]


class SandboxProvider:
    """Makes :class:`Sandbox` instances under ``root`` (a temporary directory by default)."""

    name = "sandbox"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        root: str | Path | None = None,
        *,
        cgroup_root: str | Path = CGROUP_ROOT,
    ) -> None:
        """Every sandbox gets ``limits``; directories live under ``root``; cgroups under the
        cgroup filesystems mounted at ``cgroup_root``. Logs one line saying what caps a sandbox
        as a whole on this host (a warning where something falls back to rlimits)."""
        self.limits = limits or SandboxLimits()
        self.root = Path(root) if root is not None else None
        if not Path(self.limits.python).exists():
            raise PoolError(f"sandbox: interpreter {self.limits.python} does not exist")
        if self.limits.isolation == "bwrap":
            bwrap_path()  # the one-line refusal, before anything starts
        found = detect(self.limits.cgroup_limits(), Path(cgroup_root)) if self.limits.cgroup else ""
        self.cgroups = found if isinstance(found, CgroupHost) else None
        tmpfs_refused = (
            tmpfs_refusal(self.limits.work_mb) if self.limits.work_tmpfs else "work_tmpfs off"
        )
        self.work_tmpfs = tmpfs_refused is None
        self.host_line = _host_line(
            self.limits, found or "switched off: cgroup = false", tmpfs_refused
        )
        _say(logging.INFO if self.cgroups and self.work_tmpfs else logging.WARNING, self.host_line)

    def preflight(self) -> None:
        """Fail now, in one line, when bubblewrap cannot make its namespaces on this machine."""
        if self.limits.isolation != "bwrap":
            return
        with tempfile.TemporaryDirectory(prefix="rollfleet-preflight-") as tmp:
            box = Sandbox(Path(tmp), self.limits)
            probe = subprocess.run(
                box.command(box.python("-c", "pass")), capture_output=True, timeout=60
            )
        if probe.returncode != 0:
            said = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["nothing"]
            raise SandboxError(
                f"the py sandbox cannot start here: bubblewrap said {said[0]!r} (user namespaces "
                "may be disabled: see docs/security.md), or pass --unsafe-sandbox"
            )

    async def start(self, instance_id: str) -> Sandbox:
        """A fresh private directory, a tmpfs and a cgroup of its own where the host allows."""
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"rollfleet-{instance_id}-", dir=self.root))
        return await asyncio.to_thread(self._make, path)

    def _make(self, path: Path) -> Sandbox:
        """The sandbox in ``path``; SandboxError, leaving nothing, when its tmpfs or cgroup
        could not be made."""
        uid = sandbox_uid(path)  # before a tmpfs hides the directory's own inode
        cgroup, mounted = None, False
        try:
            if self.work_tmpfs:
                mount_workdir(path, self.limits.work_mb)
                mounted = True
            if self.cgroups is not None:
                cgroup = self.cgroups.create(path.name, self.limits.cgroup_limits())
            return Sandbox(path, self.limits, uid=uid, cgroup=cgroup, mounted=mounted)
        except BaseException as exc:
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.remove()
            if mounted:
                with contextlib.suppress(OSError):
                    unmount_workdir(path)
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(exc, OSError):
                raise SandboxError(f"sandbox {path}: no tmpfs or cgroup: {exc}") from exc
            raise

    async def reset(self, handle: Sandbox) -> None:
        """Kill what still runs and empty the directory."""
        await handle.kill_all()
        await asyncio.to_thread(handle.wipe)

    async def check(self, handle: Sandbox) -> None:
        """Run a trivial program; raise unless it prints ``ok``."""
        result = await handle.run(handle.python("-c", "print('ok')"), timeout_s=30)
        if result.stdout.strip() != "ok":
            hint = (
                " (bubblewrap could not make its namespaces here: user namespaces may be "
                "disabled; see docs/security.md, or pass --unsafe-sandbox)"
                if handle.isolated and "bwrap" in result.stderr
                else ""
            )
            raise SandboxError(
                f"sandbox {handle.path}: check failed (exit {result.exit_code}, "
                f"timed out {result.timed_out}): {result.stderr[-500:].strip()}{hint}"
            )

    async def stop(self, handle: Sandbox) -> None:
        """Kill what still runs and remove the sandbox: its cgroup, its tmpfs, its directory."""
        await handle.kill_all()
        await asyncio.to_thread(handle.close)

    def endpoint(self, handle: Sandbox) -> str:
        """The sandbox's directory."""
        return str(handle.path)


_SAID: set[str] = set()  # start-up lines already logged: a provider is made more than once


def _say(level: int, line: str) -> None:
    """Log ``line`` once per process."""
    if line not in _SAID:
        _SAID.add(line)
        log.log(level, line)


def _host_line(limits: SandboxLimits, cgroups: CgroupHost | str, tmpfs_refused: str | None) -> str:
    """The start-up line: what caps a sandbox as a whole here, or why only rlimits do."""
    if isinstance(cgroups, CgroupHost):
        caps = (
            f"a cgroup per sandbox ({cgroups.describe()}): {limits.sandbox_memory_mb} MB of "
            f"memory, {limits.processes} processes, {limits.cpus:g} CPU(s)"
        )
    else:
        root_unlimited = limits.isolation == "none" and os.geteuid() == 0
        processes = (
            "processes not at all (root ignores RLIMIT_NPROC)"
            if root_unlimited
            else f"processes per uid (RLIMIT_NPROC, {limits.processes})"
        )
        caps = (
            f"no writable cgroup ({cgroups}): memory is capped per process (RLIMIT_AS, "
            f"{limits.memory_mb} MB), {processes}, CPU per process (RLIMIT_CPU, {limits.cpu_s} s)"
        )
    work = (
        f"the work dir is a {limits.work_mb} MB tmpfs"
        if tmpfs_refused is None
        else f"the work dir is capped per file only (RLIMIT_FSIZE, {limits.file_mb} MB): "
        f"{tmpfs_refused}"
    )
    return f"sandbox: {caps}; {work}"
