"""Random claim/heartbeat/complete/expire/cancel/requeue sequences against the real SQLite store.

Checked after every step: no rollout has two live attempts, no terminal status ever changes,
and at the end every rollout can be driven to a terminal state.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollfleet.errors import Conflict, NotFound
from rollfleet.model import ACTIVE_ATTEMPT, AttemptStatus, RolloutResult, RolloutSpec, RolloutStatus
from rollfleet.store import open_sql_store
from rollfleet.testing import FakeClock

OUTCOMES = [
    AttemptStatus.SUCCEEDED,
    AttemptStatus.FAILED,
    AttemptStatus.TIMEOUT,
    AttemptStatus.CANCELLED,
]


class StoreMachine(RuleBasedStateMachine):
    """Drives one store; remembers every attempt it was ever handed, live or stale."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.store = open_sql_store(f"sqlite:///{Path(self.dir.name) / 's.db'}", clock=self.clock)
        self.rollouts: list[str] = []
        self.attempts: list[str] = []
        self.final: dict[str, RolloutStatus] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @rule(n=st.integers(1, 3), max_attempts=st.integers(1, 3))
    def enqueue(self, n: int, max_attempts: int) -> None:
        specs = [
            RolloutSpec(
                input=len(self.rollouts) + i,
                config={"heartbeat_s": 10, "max_attempts": max_attempts},
            )
            for i in range(n)
        ]
        self.rollouts += [r.rollout_id for r in self.run(self.store.enqueue_many(specs))]

    @rule(worker=st.sampled_from(["w1", "w2", "w3"]), n=st.integers(1, 3))
    def claim(self, worker: str, n: int) -> None:
        self.attempts += [r.attempt.attempt_id for r in self.run(self.store.claim(worker, max_n=n))]

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        attempt = data.draw(st.sampled_from(self.attempts))
        reply = self.run(self.store.heartbeat(attempt))
        assert reply.keep_going == (reply.status in ACTIVE_ATTEMPT)

    @precondition(lambda self: self.attempts)
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES))
    def complete(self, data: st.DataObject, outcome: AttemptStatus) -> None:
        attempt = data.draw(st.sampled_from(self.attempts))
        try:
            self.run(self.store.complete(attempt, outcome, RolloutResult(reward=1.0)))
        except Conflict:
            pass  # a stale attempt is fenced: exactly what must happen

    @rule(worker=st.sampled_from(["w1", "w2", "w3"]))
    def restart(self, worker: str) -> None:
        """The worker's process died and came back under its id: what it held is lost now."""
        self.run(self.store.register_worker(worker))
        page = self.run(self.store.query_attempts(status=list(ACTIVE_ATTEMPT), limit=1000))
        assert all(a.worker_id != worker for a in page.items)

    @rule(seconds=st.sampled_from([1.0, 5.0, 11.0]))
    def expire(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.run(self.store.reap())

    @precondition(lambda self: self.rollouts)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rollout = data.draw(st.sampled_from(self.rollouts))
        try:
            self.run(self.store.cancel(rollout))
        except Conflict:
            assert self.final.get(rollout) in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED)

    @rule()
    def requeue(self) -> None:
        self.run(self.store.requeue([RolloutStatus.PREPARING, RolloutStatus.RUNNING]))

    @invariant()
    def one_live_attempt_and_final_states_hold(self) -> None:
        page = self.run(self.store.query_attempts(status=list(ACTIVE_ATTEMPT), limit=1000))
        live = [a.rollout_id for a in page.items]
        assert len(live) == len(set(live)), "a rollout has two live attempts"
        for rid in self.rollouts:
            status = self.run(self.store.get_rollout(rid)).status
            if rid in self.final:
                assert status is self.final[rid], (
                    f"terminal {rid} changed {self.final[rid]} → {status}"
                )
            elif status.terminal:
                self.final[rid] = status

    def teardown(self) -> None:
        try:
            for _ in range(
                50
            ):  # drive everything home: claim and finish until no rollout is left open
                self.clock.advance(11)
                self.run(self.store.reap())
                for r in self.run(self.store.claim("finisher", max_n=100)):
                    self.run(self.store.complete(r.attempt.attempt_id, AttemptStatus.SUCCEEDED))
                if all(self.run(self.store.get_rollout(rid)).terminal for rid in self.rollouts):
                    break
            open_ = [
                rid for rid in self.rollouts if not self.run(self.store.get_rollout(rid)).terminal
            ]
            assert not open_, f"rollouts never reached a terminal state: {open_}"
            with_missing = [rid for rid in self.rollouts if rid not in self.final]
            for rid in with_missing:
                assert self.run(self.store.get_rollout(rid)).terminal
        except NotFound as exc:  # pragma: no cover - would be a lost rollout
            raise AssertionError(f"rollout lost: {exc}") from exc
        finally:
            self.run(self.store.close())
            self.loop.close()
            self.dir.cleanup()


StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_store_state_machine = StoreMachine.TestCase
