"""The command line that runs a program under bubblewrap, isolated from everything but its work dir.

What the program gets (and only that):

- new user, PID, network, IPC, UTS and cgroup namespaces: it sees only its own processes (it is
  PID 1's descendant; PID 1 is the program itself), has no network but a loopback of its own, and
  cannot signal, trace or read anything outside;
- an unprivileged uid (65534). Run by root, bubblewrap makes no user namespace and ``setpriv``
  drops to a uid of the sandbox's own instead (:func:`sandbox_uid`, one per work directory, taken
  before a tmpfs is mounted on it: every tmpfs's root has inode 1), so
  that the process-count limit applies (the kernel does not count a root-owned user namespace's
  processes against ``RLIMIT_NPROC``) and counts only that sandbox's processes: under one shared
  uid, a sandbox holding every allowed process made another's correct answer fail;
- read-only binds of ``/usr`` (with the merged-``/usr`` links) and of the interpreter's prefix when
  it lives elsewhere, a fresh ``/proc`` and minimal ``/dev``, a private ``/tmp`` (tmpfs of
  ``tmp_mb``: it is memory, so it is sized), and its work dir at ``/work``, writable. No
  ``/etc``, no home, no project, no store. Run by root, the work dir is a tmpfs of its own
  (:func:`mount_workdir`), so a run that fills it gets ENOSPC and the host's disk is never filled;
- a seccomp filter (:func:`seccomp_filter`): sockets of the local, IPv4 and IPv6 families only (no
  ``AF_VSOCK`` to a VM's host, no netlink, no packet sockets), no kernel keyring calls, no
  io_uring, no system call of another ABI (32-bit or x32) that would slip past the filter;
- ``--die-with-parent`` and ``--new-session``: when the run is killed, everything it started dies.

``RLIMIT_NPROC`` is set inside (``prlimit``): set outside, it would count every process the
calling user already has.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import select
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollfleet.errors import PoolError

SANDBOX_UID = 65534  # "nobody": the uid inside a user namespace
UID_BASE, UID_SPAN = 1 << 30, 1 << 31  # run by root, each sandbox's uid is in this range
WORKDIR = "/work"
INSTALL_HINT = (
    "the py sandbox needs bubblewrap (bwrap), which is not installed: run "
    "`apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`, or pass "
    "--unsafe-sandbox to run model-written code without isolation"
)


def bwrap_path() -> str:
    """The ``bwrap`` executable; PoolError saying how to install it when there is none."""
    found = shutil.which("bwrap")
    if found is None:
        raise PoolError(INSTALL_HINT)
    return found


def interpreter(python: str) -> tuple[str, str | None]:
    """(the interpreter's real path, the prefix to bind read-only, or None when under /usr).

    A venv's ``python`` is a link to its base interpreter: the sandbox runs the base one, so the
    venv (and the project installed in it) stays outside.
    """
    real = os.path.realpath(python)
    prefix = str(Path(real).parent.parent)
    return real, (None if prefix == "/usr" or prefix.startswith("/usr/") else prefix)


def _root_links() -> list[str]:
    """``/bin``, ``/lib``... as links into ``/usr`` (merged /usr) or read-only binds."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def bwrap_command(
    argv: Sequence[str],
    *,
    workdir: Path,
    env: Mapping[str, str],
    processes: int,
    tmp_mb: int,
    python_prefix: str | None = None,
    info_fd: int | None = None,
    seccomp_fd: int | None = None,
    uid: int | None = None,
) -> list[str]:
    """``argv`` (paths as the sandbox sees them) wrapped in bubblewrap and the limits above.

    bubblewrap writes ``{"child-pid": N}`` on ``info_fd`` (see :func:`namespace_pid`) and loads
    the seccomp program it reads from ``seccomp_fd`` (:func:`seccomp_filter`). Run by root, the
    program runs as ``uid`` (by default :func:`sandbox_uid` of ``workdir``).
    """
    root = os.geteuid() == 0
    cmd = [bwrap_path(), "--die-with-parent", "--new-session", "--as-pid-1"]
    if info_fd is not None:
        cmd += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--hostname", "sandbox"]
    if not root:
        cmd += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    cmd += ["--ro-bind", "/usr", "/usr", *_root_links()]
    if python_prefix is not None:  # its parents exist inside as traversable dirs, nothing more
        for parent in reversed(Path(python_prefix).parents[:-1]):
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", python_prefix, python_prefix]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    cmd += ["--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp"]  # writable by all
    cmd += ["--bind", str(workdir), WORKDIR, "--chdir", WORKDIR, "--clearenv"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    cmd += ["--", "prlimit", f"--nproc={processes}:{processes}", "--"]
    if root:
        user = str(sandbox_uid(workdir) if uid is None else uid)
        cmd += ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--no-new-privs"]
        cmd += ["--"]
    return cmd + list(argv)


def namespace_pid(info_fd: int, wait_s: float = 2.0) -> int | None:
    """The sandbox's PID 1 as the host sees it, from bubblewrap's ``--info-fd`` (None when
    bubblewrap ended before it made the sandbox).

    SIGKILL to it ends every process in the PID namespace, daemons included. Killing bubblewrap
    alone is not enough when root runs it: ``--die-with-parent`` arms the parent-death signal,
    and the uid change (setpriv) clears it.
    """
    if not select.select([info_fd], [], [], wait_s)[0]:
        return None
    try:
        return int(json.loads(os.read(info_fd, 65536) or b"{}")["child-pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sandbox_uid(workdir: Path) -> int:
    """The uid a sandbox runs as when root starts it: one of its own, from its work directory's
    inode number (unique among the directories that exist at once on a filesystem, below 2**31),
    in a range above the accounts' (2**30 up). Take it before mounting anything on the directory:
    the root of every tmpfs has inode 1."""
    return UID_BASE + os.stat(workdir).st_ino % UID_SPAN


def prepare_workdir(path: Path, uid: int | None = None) -> None:
    """Make ``path`` the sandbox user's own, ``uid``'s (by default :func:`sandbox_uid`'s); only
    needed when root runs the sandbox."""
    if os.geteuid() == 0:
        user = sandbox_uid(path) if uid is None else uid
        os.chown(path, user, user)
        path.chmod(0o700)


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def mount_workdir(path: Path, size_mb: int) -> None:
    """Mount a tmpfs of ``size_mb`` on ``path`` (root only; OSError when the kernel refuses):
    writing past it is ENOSPC, and its pages are charged to the memory cgroup of the writer."""
    options = f"size={size_mb}m,mode=0700".encode()
    flags = _MS_NOSUID | _MS_NODEV
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount -t tmpfs: {os.strerror(code)}", str(path))


def unmount_workdir(path: Path) -> None:
    """Unmount the tmpfs on ``path``; detached (it goes once unused) when something still holds
    it; nothing when there is none."""
    libc = _libc()
    if libc.umount2(os.fsencode(path), 0) == 0:
        return
    code = ctypes.get_errno()
    if code == errno.EBUSY and libc.umount2(os.fsencode(path), _MNT_DETACH) == 0:
        return
    if code != errno.EINVAL:  # EINVAL: not a mount point
        raise OSError(code, f"umount: {os.strerror(code)}", str(path))


def tmpfs_refusal(size_mb: int) -> str | None:
    """Why a work dir cannot be a tmpfs here; None when it can (root, and the kernel mounts one
    of ``size_mb``: tried on a scratch directory)."""
    if os.geteuid() != 0:
        return "not root"
    with tempfile.TemporaryDirectory(prefix="rollfleet-tmpfs-probe-") as tmp:
        try:
            mount_workdir(Path(tmp), size_mb)
            unmount_workdir(Path(tmp))
        except OSError as exc:
            return f"mount refused: {exc.strerror}"
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, with errno kept for ctypes.get_errno."""
    return ctypes.CDLL(None, use_errno=True)


# seccomp: classic BPF over struct seccomp_data (nr at 0, arch at 4, args from 16, little endian)
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _EPERM = 0x7FFF0000, 0x00050000 | 1
_ARCHES = {  # machine: (AUDIT_ARCH_*, socket, then refused: keyctl, add_key, request_key, io_uring)
    "x86_64": (0xC000003E, 41, 250, 248, 249, 425),
    "aarch64": (0xC00000B7, 198, 219, 217, 218, 425),
}
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The sandbox's seccomp program for this machine's architecture (None where it has none):
    sockets only of SOCKET_FAMILIES, no keyctl/add_key/request_key (keyrings are shared by uid
    across sandboxes), no io_uring (its operations would pass by the filter), and every system
    call of another ABI refused, all with EPERM."""
    import platform
    import struct

    found = _ARCHES.get(machine or platform.machine())
    if found is None:
        return None
    arch, socket, *keyring = found
    deny = 8 + len(keyring) + 2 * len(SOCKET_FAMILIES)  # the index of the last instruction

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
        return code, jt, jf, k

    program = [op(_LD_ABS, 4), op(_JEQ, arch, 1, 0)]  # another ABI's arch: refused
    program += [op(_RET, _EPERM), op(_LD_ABS, 0), op(_JGE, 0x40000000, 0, 0)]  # x32 numbers
    program[-1] = op(_JGE, 0x40000000, deny - len(program), 0)
    program.append(op(_JEQ, socket, len(keyring) + 1, 0))
    for nr in keyring:
        program.append(op(_JEQ, nr, deny - len(program) - 1, 0))
    program.append(op(_RET, _ALLOW))
    program.append(op(_LD_ABS, 16))  # socket: its first argument, the family
    for family in SOCKET_FAMILIES:
        program.append(op(_JEQ, family, 0, 1))
        program.append(op(_RET, _ALLOW))
    program.append(op(_RET, _EPERM))
    assert len(program) == deny + 1
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)
