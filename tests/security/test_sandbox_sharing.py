"""One rollout's sandbox cannot take another's processes: run by root, each sandbox runs as a
uid of its own, so a sandbox holding every process it may have leaves the next one's limit
whole (under one shared uid, the other sandbox's correct answer failed with BlockingIOError and
its rollout went unscored)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support import bubblewrap, eventually

from rollfleet.envs.py import run_py_tests
from rollfleet.pool.providers.sandbox import SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxLimits

LIMITS = SandboxLimits(cpu_s=10, memory_mb=512, wall_s=60, test_s=5, processes=16)
HOG = (
    "import os, time\n"
    "kids = 0\n"
    "while kids < 64:\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(60)\n"
    "            os._exit(0)\n"
    "    except OSError:\n"
    "        break\n"
    "    kids += 1\n"
    "open('forked', 'w').write(str(kids))\n"
    "time.sleep(60)\n"
)


async def test_a_fork_hog_in_one_sandbox_leaves_anothers_answer_scored(tmp_path: Path) -> None:
    bubblewrap()
    if os.geteuid() != 0:
        pytest.skip("as a user, each sandbox has a user namespace of its own already")
    provider = SandboxProvider(LIMITS, root=tmp_path)
    hog_box, other = await provider.start("hog"), await provider.start("other")
    hog = asyncio.create_task(hog_box.run_code(HOG, timeout_s=60))
    try:
        assert hog_box.uid != other.uid  # from each directory's inode, taken before its tmpfs

        async def forked() -> bool:
            return (hog_box.path / "forked").exists()

        await eventually(forked, timeout=30, what="the hog to hold its processes")
        assert int((hog_box.path / "forked").read_text()) < 64  # it reached its own limit
        score = await run_py_tests(other, "def add(a, b):\n    return a + b\n", ["add(2, 3) == 5"])
        assert score.reward == 1.0, score.details
    finally:
        await hog_box.kill_all()
        await hog
        await provider.stop(hog_box)
        await provider.stop(other)


async def test_the_private_tmp_is_sized_so_a_sandbox_cannot_fill_memory_through_it(
    tmp_path: Path,
) -> None:
    """/tmp is a tmpfs (memory): writing past ``tmp_mb`` fails with ENOSPC inside the sandbox."""
    bubblewrap()
    provider = SandboxProvider(LIMITS.model_copy(update={"tmp_mb": 8}), root=tmp_path)
    box = await provider.start("tmp")
    try:
        code = (
            "import errno\nwritten = 0\ntry:\n"
            "    with open('/tmp/fill', 'wb') as f:\n"
            "        for _ in range(64):\n"
            "            f.write(b'x' * (1 << 20))\n            f.flush()\n"
            "            written += 1\n"
            "except OSError as exc:\n"
            "    print('refused', errno.errorcode[exc.errno], written)\n"
        )
        result = await box.run_code(code)
        assert result.stdout.startswith("refused ENOSPC"), (result.stdout, result.stderr)
        assert int(result.stdout.split()[-1]) <= 8
    finally:
        await provider.stop(box)


SYSCALLS = (
    "import ctypes, errno, os, socket\n"
    "def family(f):\n"
    "    try:\n"
    "        socket.socket(f, socket.SOCK_STREAM if f != 16 else socket.SOCK_RAW).close()\n"
    "        return 'ok'\n"
    "    except OSError as exc:\n"
    "        return errno.errorcode[exc.errno]\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "keyring = libc.syscall({keyctl}, 0, -4, 0)  # KEYCTL_GET_KEYRING_ID of the user keyring\n"
    "print('vsock', family(40), 'netlink', family(16), 'unix', family(1), 'inet', family(2))\n"
    "print('keyctl', errno.errorcode.get(ctypes.get_errno()) if keyring < 0 else 'ok')\n"
)


async def test_the_seccomp_filter_refuses_vsock_netlink_and_keyrings_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """AF_VSOCK would reach a VM's host and keyrings are shared by uid: refused with EPERM, while
    local and IP sockets (the loopback of the sandbox's own network namespace) still work."""
    import platform

    from rollfleet.pool.providers.bwrap import seccomp_filter

    bubblewrap()
    if seccomp_filter() is None:
        pytest.skip(f"no seccomp filter for {platform.machine()}")
    keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
    provider = SandboxProvider(LIMITS, root=tmp_path)
    box = await provider.start("seccomp")
    try:
        result = await box.run_code(SYSCALLS.format(keyctl=keyctl))
    finally:
        await provider.stop(box)
    assert result.exit_code == 0, result.stderr
    sockets, keyring = result.stdout.splitlines()
    assert sockets == "vsock EPERM netlink EPERM unix ok inet ok", result.stdout
    assert keyring == "keyctl EPERM", result.stdout
