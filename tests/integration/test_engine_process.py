"""Launching a server child process: health polling, start-up timeout, early exit, stop."""

from __future__ import annotations

import os
import sys

import pytest
from support import free_port

from rollfleet.engines.served.process import ServerProcess
from rollfleet.errors import EngineError


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_engine_process_becomes_healthy_and_stops(tmp_path) -> None:
    port = free_port()
    server = ServerProcess(
        "http",
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        f"http://127.0.0.1:{port}/",
        startup_timeout_s=60,
        cwd=str(tmp_path),
    )
    await server.start()
    assert server.running and server.pid is not None
    code = await server.stop()
    assert code is not None and not server.running and not alive(server.pid)


async def test_engine_process_startup_timeout_kills_the_child_and_says_why() -> None:
    port = free_port()
    script = "import sys, time; print('loading weights...', flush=True); time.sleep(600)"
    server = ServerProcess(
        "slow",
        [sys.executable, "-c", script],
        f"http://127.0.0.1:{port}/health",
        startup_timeout_s=1.5,
    )
    with pytest.raises(EngineError) as err:
        await server.start()
    message = str(err.value)
    assert "not healthy" in message and "after 1.5 s" in message and "killed" in message
    assert "loading weights..." in message
    assert server.pid is not None and not server.running and not alive(server.pid)


async def test_engine_process_early_exit_reports_code_and_output() -> None:
    script = "import sys; print('CUDA not found', flush=True); sys.exit(3)"
    server = ServerProcess(
        "broken",
        [sys.executable, "-c", script],
        f"http://127.0.0.1:{free_port()}/health",
        startup_timeout_s=60,
    )
    with pytest.raises(EngineError, match=r"exited with code 3[\s\S]*CUDA not found"):
        await server.start()


async def test_engine_process_missing_binary_is_a_clear_error() -> None:
    server = ServerProcess("none", ["/nonexistent/vllm-binary"], "http://127.0.0.1:1/health")
    with pytest.raises(EngineError, match="cannot launch '/nonexistent/vllm-binary'"):
        await server.start()
