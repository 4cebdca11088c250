"""Tokens stay off command lines, and no server of ours opens a non-loopback port without one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollfleet.runner.local import LocalFleet
from rollfleet.runner.spec import LlmAccess

ROLLFLEET = str(Path(sys.executable).with_name("rollfleet"))


def test_runner_children_get_the_token_in_their_environment_not_their_argv() -> None:
    fleet = LocalFleet(
        "http://127.0.0.1:1",
        "rollfleet.agents.sleep",
        n=1,
        token="s3cret-token",
        llm_token="sk-llm-key",
        llm=LlmAccess(url="http://127.0.0.1:2/v1"),
    )
    argv = fleet._argv(fleet.children[0])
    assert not any("s3cret-token" in arg or "sk-llm-key" in arg for arg in argv)
    assert "http://127.0.0.1:2/v1" in argv[-1]  # the spec travels on the command line
    assert fleet._env()["ROLLFLEET_TOKEN"] == "s3cret-token"
    assert fleet._env()["ROLLFLEET_LLM_TOKEN"] == "sk-llm-key"


@pytest.mark.parametrize(
    "command",
    [
        ["gateway", "--host", "0.0.0.0", "--port", "1"],
        ["pool", "serve", "--config", "does-not-matter.toml", "--host", "0.0.0.0", "--port", "1"],
    ],
)
def test_a_server_refuses_a_non_loopback_address_without_a_token(command: list[str]) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}  # no ROLLFLEET_TOKEN inherited
    done = subprocess.run(
        [ROLLFLEET, *command], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode != 0
    assert "refusing to serve on 0.0.0.0 without a token" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


async def test_runner_children_reach_a_control_plane_that_requires_the_token(
    tmp_path: Path,
) -> None:
    import asyncio

    from rollfleet.client import HttpStore
    from rollfleet.model import RolloutStatus
    from rollfleet.server.embedded import ServerThread

    server = await asyncio.to_thread(
        ServerThread(f"sqlite:///{tmp_path}/t.db", token="s3cret").start
    )
    store = HttpStore(server.url, token="s3cret")
    fleet = LocalFleet(server.url, "rollfleet.agents.sleep", n=1, token="s3cret", grace_s=5.0)
    running = asyncio.create_task(fleet.run())
    try:
        made = await store.enqueue_rollout({"duration": 0.01})
        done = await store.wait_for_rollouts([made.rollout_id], 60)
        assert done[0].status is RolloutStatus.SUCCEEDED
    finally:
        fleet.stop()
        await running
        await store.close()
        await asyncio.to_thread(server.stop)
