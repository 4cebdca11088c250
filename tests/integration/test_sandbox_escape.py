"""Model-written code tries every escape an attack review found; under bubblewrap each one fails.

Each test runs hostile code in a real sandbox (bubblewrap, the default) and checks from outside
that nothing happened: the store's database, a token in another process's environment or command
line, the network, a process outside, files outside the work dir, a fork bomb, a daemon outliving
``reset()``, and a forged test report.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support import bubblewrap, eventually

from rollfleet.envs.py import run_py_tests
from rollfleet.pool.providers.sandbox import Sandbox, SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxLimits

LIMITS = SandboxLimits(cpu_s=5, memory_mb=512, wall_s=20, test_s=5, processes=32)


@pytest.fixture
async def provider(tmp_path: Path) -> SandboxProvider:
    """A bubblewrap sandbox provider under tmp_path/boxes."""
    bubblewrap()
    return SandboxProvider(LIMITS, root=tmp_path / "boxes")


@pytest.fixture
async def box(provider: SandboxProvider) -> AsyncIterator[Sandbox]:
    """One started sandbox."""
    sandbox = await provider.start("esc")
    yield sandbox
    await provider.stop(sandbox)


async def test_cannot_read_the_store_or_system_files(box: Sandbox, tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    db.write_text("the store's rows")
    code = (
        "import sys\n"
        f"for path in [{str(db)!r}, '/etc/passwd', {str(Path(__file__))!r}, {sys.prefix!r} + '/pyvenv.cfg']:\n"
        "    try:\n"
        "        print(path, open(path).read()[:20])\n"
        "    except OSError as exc:\n"
        "        print(path, 'refused', type(exc).__name__)\n"
    )
    result = await box.run_code(code)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(" refused " in line for line in lines), result.stdout


async def test_cannot_read_a_token_from_other_processes(box: Sandbox) -> None:
    secret = f"tok-{uuid.uuid4().hex}"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "--token", secret],
        stdin=subprocess.PIPE,
        env={**os.environ, "ROLLFLEET_TOKEN": secret},
    )
    try:
        code = (
            "import os\n"
            "found = []\n"
            "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    for name in ('environ', 'cmdline'):\n"
            "        try:\n"
            "            data = open(f'/proc/{pid}/{name}', 'rb').read()\n"
            "        except OSError:\n"
            "            continue\n"
            f"        found += [pid] if {secret.encode()!r} in data else []\n"
            "print('pids', len([p for p in os.listdir('/proc') if p.isdigit()]), 'found', found)\n"
        )
        result = await box.run_code(code)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.endswith("found []\n"), result.stdout
        assert int(result.stdout.split()[1]) <= 2  # it sees itself, nothing of the host
    finally:
        holder.kill()
        holder.wait()


async def test_cannot_reach_the_network(box: Sandbox) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.setblocking(False)
    try:
        code = (
            "import socket\n"
            f"for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection((host, port), timeout=3)\n"
            "        print(host, 'connected')\n"
            "    except OSError as exc:\n"
            "        print(host, 'refused', type(exc).__name__)\n"
            "try:\n"
            "    socket.getaddrinfo('example.com', 80)\n"
            "    print('dns resolved')\n"
            "except OSError:\n"
            "    print('dns refused')\n"
        )
        result = await box.run_code(code)
        assert "connected" not in result.stdout and "resolved" not in result.stdout, result.stdout
        assert result.stdout.count("refused") == 3, result.stdout + result.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's port
    finally:
        listener.close()


async def test_cannot_signal_a_process_outside(box: Sandbox) -> None:
    victim = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    # the parent too, unless it is pid 1 (a suite run orphaned under nohup): inside the sandbox's
    # pid namespace 1 is the sandbox's own init, which takes the call and ignores the signal
    outside = [victim.pid, os.getpid(), *([os.getppid()] if os.getppid() > 1 else [])]
    try:
        code = (
            "import os, signal\n"
            f"for pid in {outside}:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print(pid, 'signalled')\n"
            "    except OSError as exc:\n"
            "        print(pid, 'refused', type(exc).__name__)\n"
        )
        result = await box.run_code(code)
        assert "signalled" not in result.stdout, result.stdout
        assert victim.poll() is None  # still running: the sandbox could not even see it
    finally:
        victim.kill()
        victim.wait()


async def test_cannot_write_outside_the_work_dir(box: Sandbox, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    code = (
        f"for path in [{str(outside)!r}, '/usr/evil', '/work/../evil', '/tmp/ok', 'inside.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print(path, 'written')\n"
        "    except OSError as exc:\n"
        "        print(path, 'refused', type(exc).__name__)\n"
    )
    result = await box.run_code(code)
    assert result.exit_code == 0, result.stderr
    assert not outside.exists() and not Path("/usr/evil").exists()
    assert (box.path / "inside.txt").read_text() == "x"  # its own dir is its to write
    # what it "wrote" elsewhere went to its private tmpfs, gone with the run
    assert not any(p.name == "evil" for p in box.path.parent.iterdir())


async def test_a_fork_bomb_hits_the_process_limit(box: Sandbox) -> None:
    code = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    for _ in range(300):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError as exc:\n"
        "    print('stopped', type(exc).__name__)\n"
        "print('children', children)\n"
    )
    result = await box.run_code(code, timeout_s=15)
    assert "stopped" in result.stdout, result.stdout + result.stderr
    assert int(result.stdout.split()[-1]) < LIMITS.processes


async def test_a_daemon_does_not_survive_reset(provider: SandboxProvider, box: Sandbox) -> None:
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**3}"
    code = (
        "import os, subprocess, sys\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execvp('sleep', ['sleep', '{marker}'])\n"
        "print('started', flush=True)\n"
        "sys.stdin.read()\n"  # stays until killed
    )
    run = asyncio.create_task(box.run_code(code, stdin="", timeout_s=60))

    def daemons() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                continue
        return found

    result = await run  # the program ended (stdin closed); its daemons did not wait for it
    assert result.stdout == "started\n"
    assert daemons() == []  # the run's end took the whole PID namespace with it
    long_run = asyncio.create_task(
        box.run_code(code.replace("sys.stdin.read()", "import time; time.sleep(60)"))
    )

    async def started() -> list[int]:
        return daemons()

    await eventually(started, timeout=20, what="the daemons to start")
    await provider.reset(box)
    assert daemons() == []
    assert (await long_run).exit_code != 0


async def test_a_forged_unittest_summary_scores_nothing(box: Sandbox) -> None:
    tests = ["add(2, 3) == 5", "add(-1, 1) == 0", "add(0, 0) == 0"]
    forgeries = [
        "import os, sys\nprint('Ran 3 tests in 0.001s\\n\\nOK', file=sys.stderr)\nos._exit(0)\n",
        "import sys\nprint('Ran 3 tests in 0.001s\\n\\nOK')\nsys.exit(0)\n",
        "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
        "def add(a, b):\n    return Yes()\n",
        "import os, signal\nos.kill(1, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\n"
        "def add(a, b):\n    return 7\n",
        "import json, os\nfor fd in range(3, 20):\n    try:\n"
        "        os.write(fd, (json.dumps({'value': {'int': '5'}}) + '\\n').encode() * 3)\n"
        "    except OSError:\n        pass\n"
        "def add(a, b):\n    return 7\n",
    ]
    for forged in forgeries:
        score = await run_py_tests(box, forged, tests)
        assert score.reward < 1.0 and not score.correct, forged
        assert score.details["passed"] == 0, (forged, score.details)
    honest = await run_py_tests(box, "def add(a, b):\n    return a + b\n", tests)
    assert honest.reward == 1.0
