"""``rollfleet workers --llm-url``: runners on another machine get ``ctx.llm`` from the control
plane's gateway, each attempt with a capability minted from the token (never the token), and
every call is recorded as an ``llm`` Step of its own attempt."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ServeProcess

from rollfleet.client import HttpStore
from rollfleet.model import RolloutStatus

pytestmark = pytest.mark.timeout(180)
ROLLFLEET = str(Path(sys.executable).with_name("rollfleet"))
AGENT = """
async def agent(input, ctx):
    reply = await ctx.llm.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": input["q"]}], max_tokens=4
    )
    return {"reply": reply.choices[0].message.content}
"""


async def test_workers_give_rollouts_the_gateway_and_record_their_calls(tmp_path: Path) -> None:
    token = "operator-s3cret"
    agent = tmp_path / "asks.py"
    agent.write_text(AGENT)
    server = ServeProcess(
        f"sqlite:///{tmp_path}/w.db", "--engine", "hf", "--model", "tiny", "--token", token
    ).start(timeout=120)
    store = HttpStore(server.url, token=token)
    workers = subprocess.Popen(
        [ROLLFLEET, "workers", "-n", "1", "--agent", f"{agent}:agent", "--store", server.url]
        + ["--llm-url", f"{server.url}/v1", "--llm-mint"],
        env={**os.environ, "ROLLFLEET_TOKEN": token},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        made = [await store.enqueue_rollout({"q": f"hello {i}"}) for i in range(3)]
        done = await store.wait_for_rollouts([r.rollout_id for r in made], 150)
        assert {r.status for r in done} == {RolloutStatus.SUCCEEDED}
        for rollout in done:
            assert rollout.attempt is not None
            page = await store.query_steps(rollout.rollout_id)
            calls = [s.attempt_id for s in page.items if s.kind == "llm"]
            # each call recorded to the attempt that made it, by its capability: one for the
            # attempt that succeeded, at most one for an earlier attempt a loaded machine lost
            assert calls.count(rollout.attempt.attempt_id) == 1, (calls, rollout.attempt)
            assert len(set(calls)) == len(calls) <= rollout.attempt.sequence, (calls, rollout)
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in _children(workers.pid)]
        assert cmdlines and not [c for c in cmdlines if token.encode() in c]
    finally:
        workers.send_signal(signal.SIGTERM)
        await asyncio.to_thread(workers.wait, 60)
        await store.close()
        server.kill()


def _children(pid: int) -> list[int]:
    """The process ids ``pid`` started (its runner processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                found.append(int(entry.name))
    return found
