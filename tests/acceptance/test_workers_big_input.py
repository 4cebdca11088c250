"""A task input over 64 KiB must not disable a runner, and ``rollfleet workers`` always stops.

Issue 15: a 200 KiB input made the runner child's event line longer than asyncio's 64 KiB
stream limit; the supervisor's reader died, the child blocked writing to stdout while holding a
lease, and SIGINT to ``rollfleet workers`` did not end it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ServeProcess, eventually

from rollfleet.cli.workers import host_prefix
from rollfleet.client import HttpStore
from rollfleet.model import RolloutSpec, RolloutStatus, WorkerStatus

pytestmark = pytest.mark.timeout(180)
BIG = "x" * (200 * 1024)


def workers_cmd(url: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "workers",
        "--store",
        url,
        "--agent",
        "rollfleet.agents.sleep",
        *extra,
    ]


async def test_a_200_kib_input_succeeds_the_runner_keeps_working_and_sigint_ends_it(
    tmp_path: Path,
) -> None:
    server = ServeProcess(f"sqlite:///{tmp_path}/big.db").start()
    store = HttpStore(server.url)
    proc = subprocess.Popen(
        workers_cmd(server.url, "-n", "1", "--concurrency", "2", "--grace", "5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        big = await store.enqueue_rollout({"duration": 0.01, "pad": BIG}, rollout_id="big-0")
        done = await store.wait_for_rollouts([big.rollout_id], 60)
        assert done[0].status is RolloutStatus.SUCCEEDED, done[0]
        assert done[0].input["pad"] == BIG  # the input itself is stored whole; only events trim it

        # the same runner keeps claiming: more big inputs and small ones all succeed
        specs = [
            RolloutSpec(
                input={"duration": 0.01, "pad": BIG if i % 2 else ""}, rollout_id=f"after-{i}"
            )
            for i in range(6)
        ]
        await store.enqueue_many(specs)
        after = await store.wait_for_rollouts([s.rollout_id for s in specs], 60)
        assert [r.status for r in after] == [RolloutStatus.SUCCEEDED] * 6
        assert {r.attempt.worker_id for r in after if r.attempt} == {f"{host_prefix()}-0"}

        # one long rollout is running when SIGINT arrives: it finishes within the grace period
        slow = await store.enqueue_rollout({"duration": 1.0, "pad": BIG}, rollout_id="slow")

        async def slow_running() -> bool:
            return (await store.get_rollout(slow.rollout_id)).status is RolloutStatus.RUNNING

        await eventually(slow_running, 30, what="the slow rollout to run")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        took = time.monotonic() - sent
        assert proc.returncode == 0, out
        assert took < 5 + 10, f"SIGINT took {took:.1f}s to end rollfleet workers"
        assert "processing rollout: big-0" in out
        assert BIG[:1000] not in out  # the console shows a preview of the input, not the input
        assert (await store.get_rollout(slow.rollout_id)).status is RolloutStatus.SUCCEEDED
        assert all(w.status is WorkerStatus.OFFLINE for w in (await store.query_workers()).items)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await store.close()
        server.kill()


async def test_ctrl_c_to_the_process_group_drains_instead_of_releasing(tmp_path: Path) -> None:
    # a terminal's Ctrl-C signals the whole foreground process group: runners and supervisor
    server = ServeProcess(f"sqlite:///{tmp_path}/cc.db").start()
    store = HttpStore(server.url)
    proc = subprocess.Popen(
        workers_cmd(server.url, "-n", "2", "--grace", "20"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        slow = [
            await store.enqueue_rollout({"duration": 2.0}, rollout_id=f"cc-{i}") for i in range(2)
        ]

        async def both_running() -> bool:
            now = await store.wait_for_rollouts([r.rollout_id for r in slow], timeout=0)
            return all(r.status is RolloutStatus.RUNNING for r in now)

        await eventually(both_running, 60, what="both rollouts to run")
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=40)
        assert proc.returncode == 0, out
        # one Ctrl-C drains: the running rollouts finish (before: the runners took the supervisor's
        # SIGTERM as a second signal and released them back to the queue)
        after = await store.wait_for_rollouts([r.rollout_id for r in slow], timeout=0)
        assert [r.status for r in after] == [RolloutStatus.SUCCEEDED] * 2
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # nothing of the group is left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        await store.close()
        server.kill()
