"""The rollout page's attempts: where each attempt started and what it took over from earlier
ones (its ``resume`` step), served by the dashboard's data route over a real SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollfleet.agents.resume import (
    REPLY_STEP,
    TOOL_RESULT_STEP,
    Strategy,
    recorded_turns,
    resume_payload,
    reusable,
)
from rollfleet.model import RESUME_STEP, Rollout, StepIn
from rollfleet.server.app import create_app
from rollfleet.server.dashboard import dashboard_router
from rollfleet.server.dashboard.views import attempt_start
from rollfleet.store import open_sql_store
from rollfleet.testing import FakeClock

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE_S = 5.0


@dataclass
class Fleet:
    """A store on a fake clock and an HTTP client of the dashboard over it."""

    store: Any
    clock: FakeClock
    http: httpx.AsyncClient

    async def lose_first_attempt(self, mode: str, steps: list[StepIn]) -> tuple[Rollout, Rollout]:
        """A rollout whose first attempt recorded ``steps`` and was lost with its runner (its
        lease lapsed), claimed again: the rollout as each attempt holds it."""
        await self.store.enqueue_rollout(
            {"task": mode}, mode=mode, config={"heartbeat_s": LEASE_S, "retry_delay_s": 0}
        )
        [first] = await self.store.claim("runner-a")
        assert first.attempt is not None
        await self.store.add_steps(first.attempt.attempt_id, steps)
        self.clock.advance(LEASE_S + 1)
        report = await self.store.reap()
        assert first.attempt.attempt_id in report.lost
        [second] = await self.store.claim("runner-b")
        assert second.rollout_id == first.rollout_id and second.attempt is not None
        assert second.attempt.sequence == 2
        return first, second

    async def attempts(self, rollout_id: str) -> list[dict[str, Any]]:
        """The rollout page's attempt rows."""
        res = await self.http.get(f"/dashboard/api/rollouts/{rollout_id}/attempts", headers=AUTH)
        assert res.status_code == 200, res.text
        items: list[dict[str, Any]] = res.json()["items"]
        return items


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    clock = FakeClock()
    store = open_sql_store(f"sqlite:///{tmp_path / 'd.db'}", clock=clock)
    app = create_app(
        store, token=TOKEN, routers=[("", dashboard_router(store))], reaper_interval_s=None
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dash") as http:
        yield Fleet(store, clock, http)
    await store.close()


def _two_turns() -> list[StepIn]:
    """What a resumable loop agent records over two turns, the second one's last tool lost."""
    calls = [{"name": "ls", "args": {}, "call_id": "c0"}]
    return [
        StepIn(kind="env", payload={"pool": None}),
        StepIn(kind=REPLY_STEP, payload={"turn": 0, "request_id": "req-0", "calls": calls}),
        StepIn(kind=TOOL_RESULT_STEP, payload={"turn": 0, "index": 0, "observation": "a.txt"}),
        StepIn(kind="turn", payload={"turn": 0, "request_id": "req-0"}),
        StepIn(
            kind=REPLY_STEP,
            payload={"turn": 1, "request_id": "req-1", "calls": calls + calls},
        ),
        StepIn(kind=TOOL_RESULT_STEP, payload={"turn": 1, "index": 0, "observation": "a.txt"}),
    ]


async def test_an_attempt_that_resumed_shows_the_turn_it_started_at_and_what_it_reused(
    fleet: Fleet,
) -> None:
    first, second = await fleet.lose_first_attempt("files", _two_turns())
    assert first.attempt is not None and second.attempt is not None
    earlier = (await fleet.store.query_steps(first.rollout_id)).items
    turns = reusable(recorded_turns(earlier), Strategy.REPLAY)
    await fleet.store.add_steps(
        second.attempt.attempt_id,
        [
            StepIn(kind="env", payload={"pool": None}),  # not the attempt's first step
            StepIn(kind=RESUME_STEP, payload=resume_payload(turns, Strategy.REPLAY, 2)),
            StepIn(kind="turn", payload={"turn": 0, "request_id": "req-0", "reused": True}),
        ],
    )
    rows = await fleet.attempts(first.rollout_id)
    assert [r["attempt_id"] for r in rows] == [first.attempt.attempt_id, second.attempt.attempt_id]
    assert rows[0]["status"] == "lost" and rows[0]["worker_id"] == "runner-a"
    assert rows[0]["start"]["recorded"] is False and rows[0]["start"]["from_turn"] == 0
    assert rows[1]["start"] == {
        "recorded": True,
        "strategy": "replay",
        "from_turn": 2,
        "reused_calls": 2,  # req-0 and req-1: the model was not asked again
        "reused_results": 2,  # turn 0's and the first of turn 1's; turn 1's second runs now
        "from_attempts": [first.attempt.attempt_id],
        "reason": None,
        "restarted": False,
    }


async def test_a_restart_shows_it_started_from_turn_0_and_why(fleet: Fleet) -> None:
    first, second = await fleet.lose_first_attempt("desktop", _two_turns())
    assert second.attempt is not None
    why = "mode desktop declares no resume: restarted from turn 0"
    payload = resume_payload([], Strategy.RESTART, 2, why)
    await fleet.store.add_steps(
        second.attempt.attempt_id, [StepIn(kind=RESUME_STEP, payload=payload)]
    )
    start = (await fleet.attempts(first.rollout_id))[1]["start"]
    assert start["restarted"] is True and start["strategy"] == "restart"
    assert start["from_turn"] == 0 and start["reused_calls"] == start["reused_results"] == 0
    assert start["reason"] == why


async def test_a_later_attempt_without_a_resume_step_started_at_turn_0(fleet: Fleet) -> None:
    first, _ = await fleet.lose_first_attempt("plain", [StepIn(kind="turn", payload={"turn": 0})])
    rows = await fleet.attempts(first.rollout_id)
    assert [r["sequence"] for r in rows] == [1, 2]
    assert [(r["start"]["recorded"], r["start"]["from_turn"]) for r in rows] == [(False, 0)] * 2
    missing = await fleet.http.get("/dashboard/api/rollouts/ro-nope/attempts", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"] == "NotFound"
    denied = await fleet.http.get(f"/dashboard/api/rollouts/{first.rollout_id}/attempts")
    assert denied.status_code == 401


def test_a_malformed_resume_payload_shows_what_it_can() -> None:
    payload = {"strategy": 3, "from_turn": True, "reused_calls": "req-0", "reused_results": -1}
    start = attempt_start({**payload, "from_attempts": ["at-1", 7], "reason": ""})
    assert start == {
        "recorded": True,
        "strategy": None,
        "from_turn": 0,
        "reused_calls": 0,
        "reused_results": 0,
        "from_attempts": ["at-1"],
        "reason": None,
        "restarted": True,
    }
