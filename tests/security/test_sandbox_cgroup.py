"""A sandbox per rollout, not per process: where the host allows (root, writable cgroups), each
sandbox has a cgroup of its own (memory, processes, CPU) and a sized tmpfs work dir.

Per-process rlimits alone let 4 processes of 150 MB each, every one under its 1 GiB RLIMIT_AS,
take 600 MB; a sandbox's work dir could fill the host's disk one 64 MB file at a time. Here the
memory hog is OOM-killed inside its own sandbox (its test fails; another sandbox's correct answer,
scored while the hog holds its memory, passes), a fork hog stops at the sandbox's ``processes``
even where RLIMIT_NPROC does not apply (root without namespaces), the CPU quota throttles, the work
dir is ENOSPC past ``work_mb``, and nothing (cgroup directory, mount) is left after ``stop()``.
These run on the host's real /sys/fs/cgroup; where it cannot give a sandbox a cgroup they skip,
and fail under ROLLFLEET_REQUIRE_ALL=1. Without cgroups the provider says so in one line at
start-up and the rlimits remain (tested against a cgroup root that is not a cgroup filesystem).
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from support import bubblewrap, eventually, require

from rollfleet.envs.py import run_py_tests
from rollfleet.pool.providers.cgroup import CgroupLimits, detect
from rollfleet.pool.providers.sandbox import Sandbox, SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxError, SandboxLimits

BASE: dict[str, Any] = {"cpu_s": 10, "memory_mb": 1024, "wall_s": 60, "test_s": 20}
CAPPED = {"sandbox_memory_mb": 256, "work_mb": 32, "tmp_mb": 32, "processes": 16}
CORRECT = "def add(a, b):\n    return a + b\n"
# n children each touch mb MB and hold it until every one has (or died); then the parent, when
# asked, waits at the FIFO 'gate' (so a test can act while the memory is held) before letting
# them go. Returns (children that held their memory, children SIGKILLed).
HOG = """import os
def hog(n, mb, gate=False):
    kids, ready, go = [], [], os.pipe()
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(go[1])
            block = bytearray(mb << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            os.write(w, b"r")
            os.read(go[0], 1)
            os._exit(0)
        os.close(w)
        kids.append(pid)
        ready.append(r)
    held = sum(os.read(r, 1) == b"r" for r in ready)
    if gate:
        open("held", "w").write(str(held))
        os.read(os.open("gate", os.O_RDONLY), 1)
    os.close(go[1])
    codes = [os.waitpid(pid, 0)[1] for pid in kids]
    return held, sum(os.WIFSIGNALED(c) and os.WTERMSIG(c) == 9 for c in codes)
"""
FORKS = (
    "import os, signal, sys\n"
    "kids = 0\n"
    "while kids < 64:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        signal.pause()\n"
    "    kids += 1\n"
    "print(kids)\n"
    "sys.stdout.flush()\n"
    "os.killpg(0, signal.SIGKILL)\n"
)


def limits(**update: Any) -> SandboxLimits:
    """BASE with ``update``, validated."""
    return SandboxLimits.model_validate({**BASE, **update})


class Boxes:
    """The sandboxes a test starts: each is stopped at the test's end, whatever happened (a
    sandbox left running would leave its cgroup and its mount behind)."""

    def __init__(self, root: Path) -> None:
        self.root, self.running = root, list[tuple[SandboxProvider, Sandbox]]()

    def capped(self, **update: Any) -> SandboxProvider:
        """A provider whose sandboxes get a cgroup and a tmpfs work dir of their own; skips
        (fails under ROLLFLEET_REQUIRE_ALL=1) where this host cannot give them."""
        if update.get("isolation") != "none":
            bubblewrap()
        require(os.geteuid() == 0, "root (a cgroup and a tmpfs work dir per sandbox)")
        provider = SandboxProvider(limits(**{**CAPPED, **update}), root=self.root)
        require(
            provider.cgroups is not None and provider.work_tmpfs,
            f"a writable cgroup and tmpfs mounts ({provider.host_line})",
        )
        return provider

    async def start(self, provider: SandboxProvider, name: str) -> Sandbox:
        """A started sandbox of ``provider``'s."""
        box = await provider.start(name)
        self.running.append((provider, box))
        return box

    async def stop(self, box: Sandbox) -> None:
        """Stop ``box`` now."""
        for provider, started in list(self.running):
            if started is box:
                self.running.remove((provider, started))
                await provider.stop(box)

    async def close(self) -> None:
        """Stop every sandbox still running."""
        for _, box in list(self.running):
            await self.stop(box)


@pytest.fixture
async def boxes(tmp_path: Path) -> AsyncIterator[Boxes]:
    """Start sandboxes under tmp_path; all stopped at the end."""
    made = Boxes(tmp_path)
    yield made
    await made.close()


def mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this process's mount table."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return str(path) in points


async def test_a_memory_hog_is_killed_in_its_own_sandbox_while_another_scores(
    boxes: Boxes,
) -> None:
    """4 x 150 MB, each under its 1 GiB RLIMIT_AS, in a 256 MB sandbox: OOM-killed there, while
    another sandbox's correct answer, scored as the hog holds its memory, passes."""
    provider = boxes.capped()
    hog_box, other = await boxes.start(provider, "hog"), await boxes.start(provider, "other")
    os.mkfifo(hog_box.path / "gate")
    os.chown(hog_box.path / "gate", hog_box.uid, hog_box.uid)
    hog = asyncio.create_task(hog_box.run_code(HOG + "print(hog(4, 150, gate=True))"))

    async def held() -> bool:
        return (hog_box.path / "held").exists() or hog.done()

    await eventually(held, timeout=60, what="the hog to hold its memory")
    score = await run_py_tests(other, CORRECT, ["add(2, 3) == 5"])
    gate = os.open(hog_box.path / "gate", os.O_RDWR)  # never blocks; the hog reads "g" and ends
    try:
        os.write(gate, b"g")
        result = await hog
    finally:
        os.close(gate)
    assert score.reward == 1.0, score.details
    assert result.exit_code == 0, result
    _, killed = ast.literal_eval(result.stdout)
    assert killed >= 3, result.stdout  # 2 x 150 MB do not fit: one child at most survives
    assert result.oom_killed and hog_box.cgroup is not None
    assert hog_box.cgroup.counter("oom_kill") >= 1
    assert other.cgroup is not None and other.cgroup.counter("oom_kill") == 0


async def test_a_memory_hog_under_the_judge_fails_its_test_and_is_no_infrastructure_error(
    boxes: Boxes,
) -> None:
    """Scored by the judge, the killed hog is a failed test (reward 0), not a SandboxError; the
    other sandbox, scored at the same time, passes."""
    provider = boxes.capped()
    hog_box, other = await boxes.start(provider, "hog"), await boxes.start(provider, "other")
    hogged, scored = await asyncio.gather(
        hog_box.run_tests(HOG, ["hog(4, 150) == (4, 0)"]),
        run_py_tests(other, CORRECT, ["add(2, 3) == 5", "add(-1, 1) == 0"]),
    )
    assert hogged.passed == [False], hogged
    assert hogged.result is not None and hogged.result.oom_killed, hogged
    assert scored.reward == 1.0, scored.details


async def test_a_fork_hog_stops_at_the_sandboxs_processes_through_its_cgroup(
    boxes: Boxes,
) -> None:
    """Root without namespaces (isolation none) is exempt from RLIMIT_NPROC: only the sandbox's
    cgroup stops the fork hog, at ``processes`` (the hog and its children)."""
    box = await boxes.start(boxes.capped(isolation="none", processes=12), "forks")
    result = await box.run(box.python("-c", FORKS))
    assert result.stdout.strip() == "11", (result.stdout, result.stderr)
    assert box.cgroup is not None and box.cgroup.counter("pids_max") >= 1


async def test_every_run_joins_the_sandboxs_cgroup_and_reset_keeps_it(boxes: Boxes) -> None:
    """A run's processes are in the sandbox's cgroup while it runs and leave with kill_all;
    reset keeps the cgroup (one per sandbox), an empty work dir and the uid."""
    provider = boxes.capped()
    box = await boxes.start(provider, "join")
    assert box.cgroup is not None
    cgroup = box.cgroup
    running = asyncio.create_task(box.run_code("import signal\nsignal.pause()"))

    async def joined() -> set[int]:
        return cgroup.pids()

    assert await eventually(joined, what="the run's processes in the sandbox's cgroup")
    await box.kill_all()
    await running
    assert cgroup.pids() == set()
    first = await box.run_code("import os\nopen('f', 'w').write('x')\nprint(os.getuid())")
    paths = list(cgroup.paths)
    await provider.reset(box)
    assert box.cgroup is cgroup and cgroup.paths == paths and all(p.is_dir() for p in paths)
    assert list(box.path.iterdir()) == []
    again = await box.run_code("import os\nprint(os.getuid())")
    assert first.stdout.strip() == again.stdout.strip() == str(box.uid), (first, again)


async def test_reset_kills_a_daemon_that_left_its_session(boxes: Boxes) -> None:
    """Without namespaces (isolation none) a double-forked setsid daemon outlives its run; the
    cgroup still holds it, and reset kills everything in it."""
    provider = boxes.capped(isolation="none")
    box = await boxes.start(provider, "daemon")
    daemon = (
        "import os, signal\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        null = os.open(os.devnull, os.O_RDWR)\n"
        "        for fd in (0, 1, 2):\n"
        "            os.dup2(null, fd)\n"
        "        signal.pause()\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )
    result = await box.run_code(daemon)
    assert result.exit_code == 0, result.stderr
    assert box.cgroup is not None and len(box.cgroup.pids()) == 1  # the daemon, still there
    await provider.reset(box)
    assert box.cgroup.pids() == set()


async def test_the_cpu_quota_throttles_a_busy_sandbox(boxes: Boxes) -> None:
    """cpus=0.2: 0.3 s of CPU takes several CFS periods, and the cgroup counts the throttling."""
    box = await boxes.start(boxes.capped(cpus=0.2), "cpu")
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
    result = await box.run_code(busy)
    assert result.exit_code == 0, result.stderr
    assert box.cgroup is not None and box.cgroup.counter("throttled") >= 1
    assert result.duration_s > 0.3 / 0.2 * 0.8, result.duration_s


async def test_the_work_dir_is_a_tmpfs_of_work_mb_and_each_sandbox_has_its_uid(
    boxes: Boxes, tmp_path: Path
) -> None:
    """Writing 64 MB into a 16 MB work dir is ENOSPC inside, and none of it reaches the host's
    disk; two sandboxes (every tmpfs root is inode 1) still run as different uids; after reset
    the work dir is a writable tmpfs still."""
    provider = boxes.capped(work_mb=16)
    box, other = await boxes.start(provider, "fill"), await boxes.start(provider, "other")
    fill = (
        "import errno, os\nwritten = 0\ntry:\n"
        "    with open('fill', 'wb') as f:\n"
        "        for _ in range(64):\n"
        "            f.write(b'x' * (1 << 20))\n            f.flush()\n"
        "            written += 1\n"
        "except OSError as exc:\n"
        "    print('refused', errno.errorcode[exc.errno], written, os.getuid())\n"
    )
    assert os.stat(box.path).st_dev != os.stat(tmp_path).st_dev  # a filesystem of its own
    result = await box.run_code(fill)
    words = result.stdout.split()
    assert words[:2] == ["refused", "ENOSPC"], (result.stdout, result.stderr)
    assert int(words[2]) <= 16 and (box.path / "fill").stat().st_size <= 16 << 20
    size = os.statvfs(box.path)
    assert size.f_blocks * size.f_frsize == 16 << 20
    theirs = await other.run_code("import os\nprint(os.getuid())")
    assert int(words[3]) == box.uid != other.uid == int(theirs.stdout), (words, theirs)
    await provider.reset(box)
    assert os.stat(box.path).st_dev != os.stat(tmp_path).st_dev
    again = await box.run_code("open('small', 'w').write('ok')\nprint(open('small').read())")
    assert again.stdout == "ok\n", again


async def test_stop_leaves_no_cgroup_directory_and_no_mount(boxes: Boxes) -> None:
    provider = boxes.capped()
    started = [await boxes.start(provider, f"s{i}") for i in range(3)]
    for box in started:
        await box.run_code("open('f', 'w').write('x' * 1000)")
    await provider.reset(started[0])
    made = [(box.path, list(box.cgroup.paths) if box.cgroup else []) for box in started]
    assert all(mounted(path) and cgroups for path, cgroups in made), made
    for box in started:
        await boxes.stop(box)
    for path, cgroups in made:
        assert not mounted(path) and not path.exists()
        assert not any(c.exists() for c in cgroups), cgroups


async def test_a_run_that_cannot_join_its_cgroup_is_an_infrastructure_error(boxes: Boxes) -> None:
    """Never a run outside its cgroup, never a score: a SandboxError, retried and counted apart."""
    box = await boxes.start(boxes.capped(), "gone")
    assert box.cgroup is not None
    box.cgroup.remove()
    with pytest.raises(SandboxError, match="could not start a run"):
        await box.run_tests(CORRECT, ["add(2, 3) == 5"])


async def test_without_cgroups_the_provider_says_so_and_keeps_the_rlimits(
    boxes: Boxes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cgroup root that is not a cgroup filesystem: one line at start-up names why, the
    sandboxes get no cgroup, and the per-process rlimits still apply (the 4 x 150 MB hog, each
    under RLIMIT_AS, runs whole; one process past RLIMIT_AS fails)."""
    bubblewrap()
    nowhere = tmp_path / "not-a-cgroup-fs"
    nowhere.mkdir()
    caplog.set_level(logging.INFO, "rollfleet.pool")
    provider = SandboxProvider(
        limits(**CAPPED, memory_mb=256), root=tmp_path / "boxes", cgroup_root=nowhere
    )
    lines = [r for r in caplog.records if r.getMessage().startswith("sandbox: ")]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, caplog.records
    line = lines[0].getMessage()
    assert f"no writable cgroup (no cgroup filesystem mounted at {nowhere})" in line, line
    assert "memory is capped per process (RLIMIT_AS, 256 MB)" in line, line
    assert provider.cgroups is None
    box = await boxes.start(provider, "plain")
    assert box.cgroup is None
    within = await box.run_code(HOG + "print(hog(4, 150))")
    assert within.stdout == "(4, 0)\n" and not within.oom_killed, within
    past = await box.run_code("block = bytearray(300 << 20)")
    assert past.exit_code != 0 and "MemoryError" in past.stderr, past


def test_cgroups_and_tmpfs_switched_off_are_said_too(tmp_path: Path) -> None:
    provider = SandboxProvider(
        limits(cgroup=False, work_tmpfs=False, isolation="none"), root=tmp_path
    )
    assert provider.cgroups is None and not provider.work_tmpfs
    assert "no writable cgroup (switched off: cgroup = false)" in provider.host_line
    assert "the work dir is capped per file only (RLIMIT_FSIZE, 64 MB)" in provider.host_line


def test_the_tmpfs_must_leave_the_sandbox_memory_for_its_processes() -> None:
    with pytest.raises(ValidationError, match="work_mb \\+ tmp_mb"):
        limits(sandbox_memory_mb=256, work_mb=200, tmp_mb=64)
    capped = limits(sandbox_memory_mb=256, work_mb=128, tmp_mb=64, processes=16).cgroup_limits()
    assert (capped.memory_bytes, capped.pids) == (256 << 20, 17)  # bubblewrap's own process too


def test_a_cgroup_v2_hierarchy_without_the_controllers_is_named_as_the_reason() -> None:
    """Hosts like this one (cgroup v1 controllers, a v2 hierarchy with none of them at
    /sys/fs/cgroup/unified): pointed at the v2 mount alone, the detector says why it cannot."""
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.controllers").exists():
        pytest.skip("no cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    if "memory" in (unified / "cgroup.controllers").read_text().split():
        pytest.skip("this host's v2 hierarchy has the memory controller")
    found = detect(CgroupLimits(256 << 20, 16, 1.0), unified)
    assert isinstance(found, str) and "no cgroup v1 memory/pids hierarchy" in found, found
    assert f"cgroup v2 at {unified}" in found and "not delegated memory/pids" in found, found
