"""LocalFleet's supervision against children that misbehave: any line, any signal handling.

The children here are small Python scripts in place of ``rollfleet.runner.child``: they write
what a broken or hostile runner could write, and ignore SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from rollfleet.runner.child import MAX_EVENT_BYTES, encode_event
from rollfleet.runner.local import RELEASE_S, EventLines, LocalFleet

pytestmark = pytest.mark.timeout(120)


class ScriptFleet(LocalFleet):
    """A LocalFleet whose children run ``script`` instead of a runner."""

    def __init__(self, script: Path, **kwargs: Any) -> None:
        super().__init__("http://127.0.0.1:1", "unused", **kwargs)
        self.script = script

    def _argv(self, child: Any) -> list[str]:
        return [sys.executable, str(self.script), child.worker_id]


def write_script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return path


HOSTILE = """
    import json, os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wid = sys.argv[1]
    out = sys.stdout
    out.write("x" * (3 << 20) + "\\n")                       # 3 MiB, over the reader's limit
    out.write("not json\\n1\\n[1, 2]\\n" + '{"no_event": 1}\\n')  # not events
    out.write(json.dumps({"event": "boom", "worker_id": wid}) + "\\n")  # on_event raises for it
    out.write("y" * (2 << 20))                                # over-long, ended by the next line
    out.write("\\n" + json.dumps({"event": "worker_started", "worker_id": wid}) + "\\n")
    out.flush()
    while True:
        time.sleep(1)
"""


async def test_the_reader_survives_any_line_and_a_child_ignoring_sigterm_is_killed(
    tmp_path: Path,
) -> None:
    events: list[dict[str, Any]] = []
    started = asyncio.Event()

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "boom":
            raise RuntimeError("a broken event handler")
        events.append(event)
        if event["event"] == "worker_started":
            started.set()

    fleet = ScriptFleet(write_script(tmp_path, HOSTILE), n=2, grace_s=0.5, on_event=on_event)
    running = asyncio.create_task(fleet.run())
    try:
        await asyncio.wait_for(started.wait(), 30)
        while len([e for e in events if e["event"] == "worker_started"]) < 2:
            started.clear()
            await asyncio.wait_for(started.wait(), 30)
    finally:
        t0 = time.monotonic()
        fleet.stop()
        await asyncio.wait_for(running, 0.5 + RELEASE_S + 10)
    took = time.monotonic() - t0
    assert 0.5 + RELEASE_S - 0.5 <= took < 0.5 + RELEASE_S + 5, took
    assert [e["event"] for e in events] == ["worker_started", "worker_started"]
    assert fleet.pids() == {}


async def test_a_third_stop_kills_at_once(tmp_path: Path) -> None:
    started = asyncio.Event()
    fleet = ScriptFleet(
        write_script(tmp_path, HOSTILE),
        n=1,
        grace_s=60,
        on_event=lambda e: started.set() if e["event"] == "worker_started" else None,
    )
    running = asyncio.create_task(fleet.run())
    await asyncio.wait_for(started.wait(), 30)
    t0 = time.monotonic()
    fleet.stop()
    fleet.stop()
    fleet.stop()
    await asyncio.wait_for(running, 10)
    assert time.monotonic() - t0 < 5


GRANDPARENT = """
    import json, subprocess, sys
    wid = sys.argv[1]
    # a grandchild inherits stdout (the event pipe) and outlives this process
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    print(json.dumps({"event": "worker_started", "worker_id": wid}), flush=True)
    sys.exit(7)
"""


async def run_until_crashes(script: Path, count: int) -> list[dict[str, Any]]:
    """Supervise one child running ``script`` until it has exited ``count`` times; every event."""
    events: list[dict[str, Any]] = []
    enough = asyncio.Event()

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        if sum(e["event"] == "worker_crashed" for e in events) >= count:
            enough.set()

    fleet = ScriptFleet(script, n=1, grace_s=1, on_event=on_event)
    running = asyncio.create_task(fleet.run())
    try:
        await asyncio.wait_for(enough.wait(), 30)
    finally:
        fleet.stop()
        await asyncio.wait_for(running, 15)
    return events


async def test_a_child_exit_is_seen_while_a_grandchild_holds_its_pipe(tmp_path: Path) -> None:
    events = await run_until_crashes(write_script(tmp_path, GRANDPARENT), 1)
    crash = next(e for e in events if e["event"] == "worker_crashed")
    assert crash["exit_code"] == 7 and events[0]["event"] == "worker_started"


def test_event_lines_split_chunks_and_drop_overlong_lines_whole() -> None:
    lines: list[bytes] = []
    dropped: list[int] = []
    reader = EventLines(lines.append, dropped.append, limit=10)
    for chunk in [b"ab", b"c\nde", b"f\n" + b"z" * 8, b"z" * 8, b"zz\nok\n", b"tail"]:
        reader.data_received(chunk)
    reader.eof_received()
    assert lines == [b"abc", b"def", b"ok", b"tail"]
    assert dropped == [18]


def test_events_are_capped_and_keep_their_ids() -> None:
    big = {"event": "rollout_started", "worker_id": "w", "rollout_id": "r", "input": "x" * 100_000}
    line = encode_event(big)
    assert len(line) <= MAX_EVENT_BYTES
    decoded = json.loads(line)
    assert (
        decoded["trimmed"] is True and decoded["rollout_id"] == "r" and len(decoded["input"]) < 1000
    )
    many = {"event": "e", "worker_id": "w", **{f"k{i}": "v" * 400 for i in range(100)}}
    assert json.loads(encode_event(many)) == {"event": "e", "worker_id": "w", "trimmed": True}
    small = {"event": "e", "n": 1}
    assert json.loads(encode_event(small)) == small


DRAINER = """
    import json, signal, sys, time
    wid = sys.argv[1]
    def drain(*_):
        print(json.dumps({"event": "worker_stopped", "worker_id": wid}), flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, drain)
    print(json.dumps({"event": "worker_started", "worker_id": wid}), flush=True)
    while True:
        time.sleep(1)
"""


async def test_a_cancelled_run_stops_its_children_with_sigterm_not_sigkill(tmp_path: Path) -> None:
    events: list[str] = []
    started = asyncio.Event()

    def on_event(event: dict[str, Any]) -> None:
        events.append(event["event"])
        started.set()

    fleet = ScriptFleet(write_script(tmp_path, DRAINER), n=1, grace_s=5, on_event=on_event)
    running = asyncio.create_task(fleet.run())
    await asyncio.wait_for(started.wait(), 30)
    running.cancel()  # what asyncio.run does to a task still running at Ctrl-C
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running, 15)
    assert events == ["worker_started", "worker_stopped"]  # it drained (SIGTERM), it was not killed
    assert fleet.pids() == {}


KILLED_AFTER_WORK = """
    import json, os, signal, sys
    from pathlib import Path
    wid, runs = sys.argv[1], Path(sys.argv[0]).with_name("runs")
    n = int(runs.read_text()) if runs.exists() else 0
    runs.write_text(str(n + 1))
    if n == 0:  # the first run finishes a rollout, then is killed from outside (SIGKILL)
        print(json.dumps({"event": "rollout_finished", "worker_id": wid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if n == 1:  # the second starts a rollout and is SIGKILLed before it finishes one
        print(json.dumps({"event": "rollout_started", "worker_id": wid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if n == 2:  # the third is SIGKILLed before it starts any
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)  # every later run dies on start, before doing any work
"""


async def test_a_runner_killed_after_work_restarts_at_once_and_only_a_crash_loop_backs_off(
    tmp_path: Path,
) -> None:
    events = await run_until_crashes(write_script(tmp_path, KILLED_AFTER_WORK), 5)
    crashes = [e for e in events if e["event"] == "worker_crashed"]
    killed, killed_at_work, killed_idle, first_loop, second_loop = crashes[:5]
    assert killed["exit_code"] == -9 and killed["restart_in_s"] == 0.0
    assert "made progress (1 rollouts finished)" in killed["reason"]
    assert killed_at_work["exit_code"] == -9 and killed_at_work["restart_in_s"] == 0.0
    assert "SIGKILLed while it ran rollouts" in killed_at_work["reason"]
    # killed before any work: not known to be from outside, so it counts as a crash
    assert killed_idle["exit_code"] == -9 and killed_idle["restart_in_s"] == 0.5
    assert first_loop["exit_code"] == 3 and first_loop["restart_in_s"] == 1.0
    assert second_loop["restart_in_s"] == 2.0 and "3 in a row" in second_loop["reason"]
