"""Pools end to end: properties (exclusive, in order) and faults, through ``rollfleet pool serve``.

The server runs as a subprocess from the CLI with a ``command`` pool whose instances are
directories; holders are separate processes using RemotePool. Each holder proves it holds
an instance alone by creating a marker file in it with O_EXCL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import free_port

import rollfleet
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.memory import MemoryProvider
from rollfleet.pool.remote import RemotePool

SRC = str(Path(rollfleet.__file__).resolve().parents[1])
ENV = {**os.environ, "PYTHONPATH": SRC}

CONFIG = """
[pools.fleet]
provider = "command"
size = 2
lease_s = 30
[pools.fleet.options]
start = 'd="{root}/$ROLLFLEET_INSTANCE_ID.$$"; mkdir -p "$d" && echo "$d"'
reset = 'if [ -e "$ROLLFLEET_ENDPOINT/.fail-reset" ]; then exit 7; fi; rm -rf "$ROLLFLEET_ENDPOINT"/*'
check = 'test -d "$ROLLFLEET_ENDPOINT" && ! test -e "$ROLLFLEET_ENDPOINT/.fail-check"'
stop = 'rm -rf "$ROLLFLEET_ENDPOINT"'
[pools.fleet.policy]
backoff_s = 0

[pools.solo]
provider = "command"
size = 1
lease_s = 1
[pools.solo.options]
start = 'd="{root}/$ROLLFLEET_INSTANCE_ID.$$"; mkdir -p "$d" && echo "$d"'
reset = 'rm -rf "$ROLLFLEET_ENDPOINT"/*'
stop = 'rm -rf "$ROLLFLEET_ENDPOINT"'
"""

HOLDER = """
import asyncio, json, os, random, sys
from rollfleet.pool.remote import RemotePool

async def main(url, cycles, seed):
    rnd, served = random.Random(seed), []
    async with RemotePool(url, "fleet", lease_s=30) as remote:
        for i in range(cycles):
            inst = await remote.acquire(60, attempt_id=f"{os.getpid()}-{i}")
            marker = os.path.join(inst.endpoint, "holder")
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if held twice
            os.close(fd)
            await asyncio.sleep(rnd.random() * 0.01)  # the 'work'
            os.unlink(marker)
            await remote.release(inst)
            served.append([inst.instance_id, inst.ticket, inst.serial])
    print(json.dumps(served))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""

VICTIM = """
import asyncio, json, os, sys
from rollfleet.pool.remote import RemotePool

async def main(url):
    async with RemotePool(url, "solo", lease_s=1) as remote:
        async with remote.lease(attempt_id="victim", timeout=30) as inst:
            open(os.path.join(inst.endpoint, "victim-was-here"), "w").close()
            print(json.dumps({"lease_id": inst.lease_id, "instance_id": inst.instance_id,
                              "endpoint": inst.endpoint}), flush=True)
            await asyncio.Event().wait()  # hold (renewing in the background) until killed

asyncio.run(main(sys.argv[1]))
"""


def until(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
    return value


def get(url: str) -> Any:
    """GET JSON, or None while the server is not answering."""
    try:
        response = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``rollfleet pool serve`` in a subprocess; yields its /pools URL."""
    root = tmp_path_factory.mktemp("fleet")
    config = root / "pools.toml"
    config.write_text(CONFIG.format(root=root))
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollfleet.cli.pool",
            "pool",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/pools"
    try:
        until(lambda: proc.poll() is not None or get(url))
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def stats(url: str, pool: str) -> dict[str, Any]:
    """One pool's stats from the server."""
    return until(lambda: get(f"{url}/{pool}"))  # type: ignore[no-any-return]


# ---- properties ------------------------------------------------------------------------


async def _exercise(size: int, holds: list[int], failing_resets: int) -> list[tuple[int, int]]:
    """Holders arrive in order, each holding for ``holds[i]`` yields; return (serial, ticket)."""
    provider = MemoryProvider()
    served: list[tuple[int, int]] = []
    holders: dict[str, int] = {}
    async with Pool(provider, size, name="p", policy=PoolPolicy(backoff_s=0.0)) as pool:
        await pool.wait_for(lambda s: s.states["IDLE"] == size, 5)
        provider.fail_resets = failing_resets

        async def holder(i: int, hold: int) -> None:
            async with pool.lease(attempt_id=str(i), timeout=30) as instance:
                assert instance.instance_id not in holders, "one instance, two holders"
                assert not instance.handle.stopped and instance.handle.state == {}
                holders[instance.instance_id] = i
                instance.handle.state["holder"] = i
                for _ in range(hold):
                    await asyncio.sleep(0)
                assert holders.pop(instance.instance_id) == i
                served.append((instance.serial, instance.ticket))

        await asyncio.gather(*(holder(i, hold) for i, hold in enumerate(holds)))
    return served


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 4),
    holds=st.lists(st.integers(0, 6), min_size=1, max_size=25),
    failing_resets=st.integers(0, 3),
)
def test_many_tasks_never_share_an_instance_and_are_served_in_order(
    size: int, holds: list[int], failing_resets: int
) -> None:
    served = asyncio.run(_exercise(size, holds, failing_resets))
    assert len(served) == len(holds)
    tickets = [ticket for _, ticket in sorted(served)]
    assert tickets == sorted(tickets), "acquires were not served in arrival order"


def test_many_processes_never_share_an_instance_and_are_served_in_order(server: str) -> None:
    cycles, workers = 8, 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, server, str(cycles), str(seed)],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(workers)
    ]
    served: list[tuple[str, int, int]] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err  # FileExistsError here means two holders at once
        served += [tuple(row) for row in json.loads(out)]
    assert len(served) == cycles * workers
    by_serial = sorted(served, key=lambda row: row[2])
    assert len({row[2] for row in served}) == len(served)
    tickets = [row[1] for row in by_serial]
    assert tickets == sorted(tickets), "acquires were not served in arrival order"
    assert {row[0] for row in served} == {"fleet-0", "fleet-1"}


# ---- faults --------------------------------------------------------------------------


@pytest.mark.parametrize("marker", [".fail-reset", ".fail-check"])
def test_instance_whose_reset_or_check_fails_is_replaced(server: str, marker: str) -> None:
    before = stats(server, "fleet")["replacements"]

    async def poison() -> str:
        async with RemotePool(server, "fleet") as remote:
            instance = await remote.acquire(30, attempt_id=f"poison{marker}")
            Path(instance.endpoint or "", marker).touch()
            await remote.release(instance)
            return instance.endpoint or ""

    endpoint = asyncio.run(poison())
    after = until(
        lambda: (
            (s := stats(server, "fleet"))["replacements"] == before + 1
            and s["states"]["IDLE"] == 2
            and s
        )
    )
    assert not Path(endpoint).exists(), "the broken instance was not stopped"
    assert endpoint not in {i["endpoint"] for i in after["instances"]}
    assert not after["degraded"] and after["healthy"] == 2


def test_holder_killed_with_sigkill_loses_its_lease_and_the_instance_is_reclaimed(
    server: str,
) -> None:
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, server],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = victim.stdout.readline() if victim.stdout else ""
        assert line, victim.stderr.read() if victim.stderr else ""
        held = json.loads(line)
        [lease] = get(f"{server}/solo/leases")
        assert lease["attempt_id"] == "victim" and lease["lease_id"] == held["lease_id"]
        until(
            lambda: get(f"{server}/solo/leases")[0]["expires_at"] > lease["expires_at"]
        )  # renewing
        assert Path(held["endpoint"], "victim-was-here").exists()
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
    until(
        lambda: get(f"{server}/solo/leases") == [] and stats(server, "solo")["states"]["IDLE"] == 1
    )

    async def next_holder() -> tuple[str, int, bool]:
        async with (
            RemotePool(server, "solo") as remote,
            remote.lease(attempt_id="next", timeout=30) as inst,
        ):
            return (
                inst.instance_id,
                inst.generation,
                Path(inst.endpoint or "", "victim-was-here").exists(),
            )

    assert asyncio.run(next_holder()) == (held["instance_id"], 0, False)


def test_pool_serve_rejects_a_bad_config_naming_file_and_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[pools.x]\nprovider = "sandbox"\nsize = -2\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollfleet.cli.pool",
            "pool",
            "serve",
            "--config",
            str(config),
            "--port",
            str(free_port()),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{config}: pools.x.size:" in result.stdout.replace("\n", "")
