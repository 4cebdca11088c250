"""A cgroup per sandbox: memory, processes and CPU capped for the sandbox as a whole.

The rlimits of :mod:`.sandbox` cap each process: 64 processes of 1 GiB each could still take
64 GiB. Where the host lets this process make cgroups below its own, each sandbox gets one:

- ``memory`` caps everything its processes hold, the tmpfs pages they write included (its work
  dir and ``/tmp``); past it the kernel's OOM killer kills a process *of that sandbox*;
- ``pids`` caps its processes and threads together, whatever uid they run as;
- ``cpu`` caps its share of the cores (a CFS quota).

Every run's process joins it before it execs (:meth:`SandboxCgroup.join`, from the child's
preexec hook), so nothing the run starts is outside it. Two layouts are used:

- cgroup v1, a hierarchy per controller (``/sys/fs/cgroup/memory``...), writable by root: the
  sandbox's cgroup is made below this process's own in each (``memory:/a/b`` gives
  ``/sys/fs/cgroup/memory/a/b/rollfleet-…``);
- cgroup v2 (``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``) where this process's cgroup has the
  controllers and may enable them for its children (a delegated subtree).

:func:`detect` finds out by trying (it makes a cgroup with the limits and removes it) and says why
not where it cannot; the sandbox then keeps the per-process rlimits alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUIRED = ("memory", "pids")  # without these a sandbox's cgroup is not worth having
CONTROLLERS = (*REQUIRED, "cpu")  # cpu is used where the host has it
PERIOD_US = 100_000  # the CFS period the CPU quota is a share of
KILL_WAIT_S = 5.0  # how long kill() waits for the cgroup to empty
# counter: (controller, file per version, key in it); each file is "key value" lines
_COUNTERS = {
    "oom_kill": ("memory", {1: "memory.oom_control", 2: "memory.events"}, "oom_kill"),
    "pids_max": ("pids", {1: "pids.events", 2: "pids.events"}, "max"),
    "throttled": ("cpu", {1: "cpu.stat", 2: "cpu.stat"}, "nr_throttled"),
}


@dataclass(frozen=True)
class CgroupLimits:
    """What one sandbox's cgroup caps."""

    memory_bytes: int
    pids: int
    cpus: float

    def settings(self, version: Literal[1, 2]) -> list[tuple[str, str, str, bool]]:
        """``(controller, file, value, required)`` to write, in order (a file that is not
        required is skipped where the kernel has none: swap accounting may be off)."""
        memory, quota = str(self.memory_bytes), str(max(1000, round(self.cpus * PERIOD_US)))
        if version == 1:
            return [
                ("memory", "memory.limit_in_bytes", memory, True),
                ("memory", "memory.memsw.limit_in_bytes", memory, False),  # no swap beyond it
                ("pids", "pids.max", str(self.pids), True),
                ("cpu", "cpu.cfs_period_us", str(PERIOD_US), True),
                ("cpu", "cpu.cfs_quota_us", quota, True),
            ]
        return [
            ("memory", "memory.max", memory, True),
            ("memory", "memory.swap.max", "0", False),
            ("pids", "pids.max", str(self.pids), True),
            ("cpu", "cpu.max", f"{quota} {PERIOD_US}", True),
        ]


class SandboxCgroup:
    """One sandbox's cgroup: a directory per controller (v1) or one directory (v2)."""

    def __init__(self, version: Literal[1, 2], dirs: dict[str, Path]) -> None:
        """The cgroup at ``dirs`` (controller: directory), which exist already."""
        self.version, self.dirs = version, dirs
        self.paths = list(dict.fromkeys(dirs.values()))  # each directory once, in order
        # v1: "tasks" moves the writing thread alone, which spares the kernel a global lock and
        # an RCU grace period (~10 ms a run) that moving a whole thread group takes; a child
        # between fork and exec has one thread. v2 moves only thread groups between its cgroups.
        entry = "tasks" if version == 1 else "cgroup.procs"
        self._join = [os.fsencode(path / entry) for path in self.paths]

    def join(self) -> None:
        """Move the calling process, which must have a single thread (a child between fork and
        exec), into the cgroup."""
        for procs in self._join:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # 0: the writer itself
            finally:
                os.close(fd)

    def counter(self, name: str) -> int:
        """An event count of the cgroup's: ``oom_kill`` (processes the memory cap killed),
        ``pids_max`` (forks the process cap refused), ``throttled`` (CPU periods it was held
        back); 0 where the host has no such controller or count."""
        controller, files, key = _COUNTERS[name]
        if controller not in self.dirs:
            return 0
        try:
            text = (self.dirs[controller] / files[self.version]).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            field, _, value = line.partition(" ")
            if field == key:
                return int(value)
        return 0

    def pids(self) -> set[int]:
        """The processes in the cgroup now."""
        found: set[int] = set()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(pid) for pid in (path / "cgroup.procs").read_text().split())
        return found

    def kill(self, wait_s: float = KILL_WAIT_S) -> None:
        """SIGKILL every process in the cgroup, and wait until it is empty (OSError past
        ``wait_s``)."""
        if self.version == 2:
            with contextlib.suppress(OSError):  # cgroup.kill: Linux 5.14 and later
                (self.paths[0] / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + wait_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise OSError(errno.EBUSY, f"processes {sorted(pids)} outlived SIGKILL")
            time.sleep(0.005)  # they are exiting: a dying process leaves within milliseconds

    def remove(self, wait_s: float = KILL_WAIT_S) -> None:
        """Kill what is left in the cgroup and remove its directories (OSError past
        ``wait_s``)."""
        self.kill(wait_s)
        deadline = time.monotonic() + wait_s
        for path in reversed(self.paths):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while a killed process finishes leaving
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.005)


@dataclass(frozen=True)
class CgroupHost:
    """Where this process may make sandboxes' cgroups: a parent directory per controller."""

    version: Literal[1, 2]
    parents: dict[str, Path]

    def create(self, name: str, limits: CgroupLimits) -> SandboxCgroup:
        """Make the cgroup ``name`` with ``limits`` (OSError, leaving nothing, when it cannot)."""
        made = SandboxCgroup(self.version, {c: p / name for c, p in self.parents.items()})
        try:
            for path in made.paths:
                path.mkdir(mode=0o755)
            for controller, file, value, required in limits.settings(self.version):
                target = made.dirs.get(controller)
                if target is not None and (required or (target / file).exists()):
                    _write(target / file, value)
        except OSError:
            with contextlib.suppress(OSError):
                made.remove()
            raise
        return made

    def describe(self) -> str:
        """Where the sandboxes' cgroups go, in words."""
        where = self.parents.get("memory") or next(iter(self.parents.values()))
        missing = [c for c in CONTROLLERS if c not in self.parents]
        return f"cgroup v{self.version} under {where}" + (
            f", no {'/'.join(missing)} controller" if missing else ""
        )


@dataclass(frozen=True)
class _Mount:
    """A cgroup filesystem in /proc/self/mountinfo."""

    point: Path
    root: str  # the cgroup path the mount shows at its mount point
    fstype: str
    options: frozenset[str]


def detect(
    limits: CgroupLimits,
    root: Path = CGROUP_ROOT,
    mountinfo: Path = Path("/proc/self/mountinfo"),
    own: Path = Path("/proc/self/cgroup"),
) -> CgroupHost | str:
    """Where sandboxes' cgroups can go on this host, found by making one with ``limits`` under
    the cgroup filesystems mounted at ``root``; or why none can be made, in words."""
    mounts = [m for m in _mounts(mountinfo) if root in (m.point, m.point.parent)]
    if not mounts:
        return f"no cgroup filesystem mounted at {root}"
    paths = _own_paths(own)
    found = _v1(mounts, paths)
    if isinstance(found, str):
        v2 = _v2(mounts, paths)
        if isinstance(v2, str):
            return f"{found}; {v2}"
        found = v2
    probe = f"rollfleet-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        found.create(probe, limits).remove()
    except OSError as exc:
        return f"cannot make a cgroup with the sandbox's limits under {found.describe()}: {exc}"
    return found


def _v1(mounts: list[_Mount], own: dict[str, str]) -> CgroupHost | str:
    """A cgroup v1 host: a hierarchy for each controller, or which are missing."""
    parents = {}
    for controller in CONTROLLERS:
        for mount in mounts:
            if mount.fstype == "cgroup" and controller in mount.options:
                parents[controller] = _below(mount, own.get(controller, "/"))
    missing = [c for c in REQUIRED if c not in parents]
    if missing:
        return f"no cgroup v1 {'/'.join(missing)} hierarchy"
    return CgroupHost(1, parents)


def _v2(mounts: list[_Mount], own: dict[str, str]) -> CgroupHost | str:
    """A cgroup v2 host whose controllers this process may enable for its children, or why not."""
    unified = [m for m in mounts if m.fstype == "cgroup2"]
    if not unified:
        return "no cgroup v2 mount"
    parent = _below(unified[0], own.get("", "/"))
    try:
        offered = set((parent / "cgroup.controllers").read_text().split())
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
    except OSError as exc:
        return f"cgroup v2 at {parent} unreadable: {exc.strerror}"
    wanted = [c for c in CONTROLLERS if c in offered]
    if missing := [c for c in REQUIRED if c not in offered]:
        return f"cgroup v2 at {parent} is not delegated {'/'.join(missing)}"
    for controller in (c for c in wanted if c not in enabled):
        try:
            _write(parent / "cgroup.subtree_control", f"+{controller}")
        except OSError as exc:
            if controller in REQUIRED:
                return (
                    f"cgroup v2: cannot enable {controller} for the children of {parent} "
                    f"({exc.strerror}; a cgroup that holds processes cannot: run rollfleet in "
                    "a delegated cgroup of its own)"
                )
            wanted.remove(controller)
    return CgroupHost(2, dict.fromkeys(wanted, parent))


def _below(mount: _Mount, path: str) -> Path:
    """The directory of the cgroup ``path`` (as /proc/self/cgroup names it) under ``mount``."""
    relative = Path(path).relative_to("/")
    with contextlib.suppress(ValueError):
        relative = relative.relative_to(Path(mount.root).relative_to("/"))
    return mount.point / relative


def _mounts(mountinfo: Path) -> Iterator[_Mount]:
    """The cgroup and cgroup2 filesystems this process sees."""
    with contextlib.suppress(OSError):
        for line in mountinfo.read_text().splitlines():
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                point = Path(_unescape(fields[4]))
                yield _Mount(point, _unescape(fields[3]), tail[0], frozenset(tail[2].split(",")))


def _own_paths(own: Path) -> dict[str, str]:
    """This process's cgroup per controller (``""``: the v2 one), from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in own.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _unescape(text: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` for a space) decoded."""
    return text.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")


def _write(path: Path, value: str) -> None:
    """Write one value to a cgroup file (one write(2): the kernel reads it whole)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
