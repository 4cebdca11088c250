"""``rollfleet workers`` as users run it: graceful SIGTERM, a broken agent, the Ray backend."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ServeProcess, bubblewrap, eventually

from rollfleet.cli.workers import host_prefix
from rollfleet.client import HttpStore
from rollfleet.model import RolloutSpec, RolloutStatus, WorkerStatus

pytestmark = pytest.mark.timeout(180)


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


async def test_sigterm_drains_and_leaves_nothing_preparing(tmp_path: Path) -> None:
    server = ServeProcess(f"sqlite:///{tmp_path}/g.db").start()
    store = HttpStore(server.url)
    try:
        specs = [RolloutSpec(input={"duration": 1.0}, rollout_id=f"g-{i}") for i in range(40)]
        await store.enqueue_many(specs)
        proc = subprocess.Popen(
            workers_cmd(server.url, "-n", "2", "--concurrency", "4", "--grace", "20"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        async def some_succeeded() -> bool:
            return (await store.statistics()).rollouts["succeeded"] >= 8

        await eventually(some_succeeded, 120, what="rollouts to succeed")
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=90)
        assert proc.returncode == 0, out
        assert (
            f"Starting {host_prefix()}-0" in out and "processing rollout" in out
        )  # ids name the host
        stats = await store.statistics()
        assert stats.rollouts["preparing"] == 0 and stats.rollouts["running"] == 0, stats
        assert stats.rollouts["succeeded"] + stats.rollouts["queuing"] == 40, stats
        assert stats.rollouts["failed"] == 0
        assert all(w.status is WorkerStatus.OFFLINE for w in (await store.query_workers()).items)
    finally:
        await store.close()
        server.kill()


def test_broken_agent_is_one_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "workers",
            "--store",
            f"sqlite:///{tmp_path}/b.db",
            "--agent",
            "rollfleet.agents.nope:agent",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot import rollfleet.agents.nope" in result.stderr
    assert "Traceback" not in result.stderr


def test_enqueue_bad_file_names_line_and_queues_nothing(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": 1}\n{"input": 2, "priority": "high"}\n')
    db = f"sqlite:///{tmp_path}/e.db"
    bad = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "enqueue", str(tasks), "--store", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2
        and f"{tasks}:2: field 'priority'" in bad.stderr
        and "Traceback" not in bad.stderr
    )
    status = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "rollouts", "--json", "--store", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and status.stdout.strip() == ""
    tasks.write_text('{"q": 1}\n{"input": 2, "priority": 3}\n')
    good = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "enqueue", str(tasks), "--store", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert good.returncode == 0 and "queued 2 rollouts" in good.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "status", "--store", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "QUEUING" in shown.stdout and "2" in shown.stdout


def test_requeue_and_cancel_commands(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/q.db"

    async def setup() -> list[str]:
        from rollfleet.store import open_sql_store

        s = open_sql_store(db)
        await s.enqueue_many([RolloutSpec(input=i, rollout_id=f"r{i}") for i in range(3)])
        await s.start_rollout("stuck", rollout_id="stuck", worker_id="gone")
        await s.close()
        return ["r0"]

    asyncio.run(setup())
    cli = [sys.executable, "-m", "rollfleet.cli"]
    req = subprocess.run(
        [*cli, "requeue", "--status", "preparing", "--store", db], capture_output=True, text=True
    )
    assert req.returncode == 0 and "requeued 1 rollouts" in req.stdout and "stuck" in req.stdout
    can = subprocess.run([*cli, "cancel", "r1", "--store", db], capture_output=True, text=True)
    assert can.returncode == 0 and "r1: cancelled" in can.stdout
    missing = subprocess.run(
        [*cli, "cancel", "nope", "--store", db], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "not found" in missing.stderr
    assert (
        RolloutStatus.CANCELLED.value
        in subprocess.run(
            [*cli, "rollouts", "--store", db], capture_output=True, text=True
        ).stdout.lower()
    )


def test_status_over_http_shows_hosted_pools(tmp_path: Path) -> None:
    bubblewrap()
    config = tmp_path / "pools.toml"
    config.write_text('[pools.py]\nprovider = "sandbox"\nsize = 2\n')
    server = ServeProcess(f"sqlite:///{tmp_path}/p.db", "--pools", str(config)).start()
    bare = ServeProcess(f"sqlite:///{tmp_path}/n.db").start()
    try:
        cli = [sys.executable, "-m", "rollfleet.cli", "status", "--store"]
        env = {**os.environ, "COLUMNS": "200"}
        with_pools = subprocess.run(
            [*cli, server.url], capture_output=True, text=True, timeout=60, env=env
        )
        assert with_pools.returncode == 0, with_pools.stderr
        assert (
            "Workers" in with_pools.stdout
            and "py" in with_pools.stdout
            and "sandbox" in with_pools.stdout
        )
        without = subprocess.run(
            [*cli, bare.url], capture_output=True, text=True, timeout=60, env=env
        )
        assert without.returncode == 0, without.stderr
        assert "sandbox" not in without.stdout
    finally:
        server.kill()
        bare.kill()


def test_status_names_a_suspected_poison_rollout(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/p.db"

    async def lose_on_three_runners() -> None:
        from rollfleet.store import open_sql_store

        s = open_sql_store(db)
        await s.enqueue_many(
            [
                RolloutSpec(input=0, rollout_id="poison", config={"retry_delay_s": 0}),
                RolloutSpec(input=1, rollout_id="innocent"),
            ]
        )
        for runner in (
            "a",
            "b",
            "c",
        ):  # each runner dies under it and comes back: its attempt is lost
            assert [r.rollout_id for r in await s.claim(runner)] == ["poison"]
            await s.register_worker(runner)
        await s.close()

    asyncio.run(lose_on_three_runners())
    shown = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "status", "--store", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        "suspected poison" in shown.stdout and "poison" in shown.stdout.split("suspected poison")[1]
    )
    assert "innocent" not in shown.stdout
