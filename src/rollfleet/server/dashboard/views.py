"""What the dashboard shows, computed from store records: slim rollout rows, attempts with where
they started, runners, history.

These are pure functions and one small accumulator; the router and the live hub call them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollfleet.model import Attempt, Rollout, RolloutStatus, Statistics, Worker, WorkerStatus

HISTORY_S = 3600.0  # the overview's charts cover the last hour
BUCKET_S = 60.0  # one bar per minute
ERROR_CHARS = 300  # rows carry the start of an error; the detail page has all of it


def rollout_row(r: Rollout) -> dict[str, Any]:
    """The fields one table row needs (no input, no output: pages stay small)."""
    att = r.attempt
    return {
        "rollout_id": r.rollout_id,
        "status": r.status.value,
        "mode": r.mode,
        "batch_id": r.batch_id,
        "group_id": r.group_id,
        "attempts": r.num_attempts,
        "suspect": r.suspect,
        "worker_id": att.worker_id if att else None,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "finished_at": r.finished_at,
        "started_at": att.started_at if att else None,
        "reward": r.result.reward if r.result else None,
        "error": (r.error or (att.error if att else None) or "")[:ERROR_CHARS] or None,
    }


def _count(value: Any) -> int:
    """A non-negative count from a runner's payload; 0 for anything else."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else 0


def attempt_start(resume: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where an attempt started and what it took over from earlier attempts, from the payload of
    its ``resume`` step (rollfleet.agents.resume); without one it started at turn 0, reusing
    nothing. ``restarted``: a resume step says it started over from turn 0 (the mode cannot
    resume, or a replay diverged; ``reason`` says which)."""
    if resume is None:
        return {
            "recorded": False,
            "strategy": None,
            "from_turn": 0,
            "reused_calls": 0,
            "reused_results": 0,
            "from_attempts": [],
            "reason": None,
            "restarted": False,
        }
    strategy, reason = resume.get("strategy"), resume.get("reason")
    calls, earlier = resume.get("reused_calls"), resume.get("from_attempts")
    from_turn = _count(resume.get("from_turn"))
    return {
        "recorded": True,
        "strategy": strategy if isinstance(strategy, str) else None,
        "from_turn": from_turn,
        "reused_calls": len(calls) if isinstance(calls, list) else 0,
        "reused_results": _count(resume.get("reused_results")),
        "from_attempts": [a for a in earlier if isinstance(a, str)]
        if isinstance(earlier, list)
        else [],
        "reason": reason if isinstance(reason, str) and reason else None,
        "restarted": from_turn == 0,
    }


def attempt_row(a: Attempt, resume: Mapping[str, Any] | None) -> dict[str, Any]:
    """One row of a rollout's attempts: the attempt, and where it started (``start``)."""
    return {**a.model_dump(mode="json"), "start": attempt_start(resume)}


def effective_status(w: Worker) -> WorkerStatus:
    """OFFLINE as stored (lease lapsed or signed off); otherwise BUSY exactly while it holds a live
    attempt."""
    if w.status is WorkerStatus.OFFLINE:
        return WorkerStatus.OFFLINE
    return WorkerStatus.BUSY if w.current_attempts else WorkerStatus.IDLE


def worker_row(w: Worker, rollouts_by_attempt: dict[str, str], now: float) -> dict[str, Any]:
    """One Runners-page row: status, current rollouts, heartbeat, counters, lifetime throughput."""
    done = w.rollouts_succeeded + w.rollouts_failed
    minutes = max((now - w.registered_at) / 60.0, 1e-9)
    return {
        "worker_id": w.worker_id,
        "status": effective_status(w).value,
        "current_attempts": list(w.current_attempts),
        "current_rollouts": [
            rollouts_by_attempt[a] for a in w.current_attempts if a in rollouts_by_attempt
        ],
        "registered_at": w.registered_at,
        "last_heartbeat_at": w.last_heartbeat_at,
        "succeeded": w.rollouts_succeeded,
        "failed": w.rollouts_failed,
        "per_min": round(done / minutes, 3),
        "metadata": w.metadata,
    }


def stats_view(s: Statistics) -> dict[str, Any]:
    """Statistics as plain JSON."""
    return s.model_dump(mode="json")


@dataclass
class History:
    """Per-minute finished counts and rewards over the last hour, fed by rollouts as they finish.

    A finished rollout never changes again, so each one is counted once, by id.
    """

    buckets: dict[int, dict[str, float]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    per_worker: dict[str, dict[int, int]] = field(default_factory=dict)

    def add(self, rollouts: Iterable[Rollout], now: float) -> bool:
        """Fold finished rollouts in; True when anything new was counted."""
        changed = False
        for r in rollouts:
            if not r.terminal or r.rollout_id in self.seen or r.finished_at is None:
                continue
            if r.finished_at < now - HISTORY_S:
                continue
            minute = int(r.finished_at // BUCKET_S)
            self.seen[r.rollout_id] = minute
            b = self.buckets.setdefault(
                minute,
                {"succeeded": 0, "failed": 0, "cancelled": 0, "reward_sum": 0.0, "reward_n": 0},
            )
            b[r.status.value] += 1
            reward = r.result.reward if r.result else None
            if reward is not None and math.isfinite(reward):
                b["reward_sum"] += reward
                b["reward_n"] += 1
            if r.attempt and r.attempt.worker_id and r.status is not RolloutStatus.CANCELLED:
                per = self.per_worker.setdefault(r.attempt.worker_id, {})
                per[minute] = per.get(minute, 0) + 1
            changed = True
        self.prune(now)
        return changed

    def prune(self, now: float) -> None:
        """Forget minutes older than the window."""
        oldest = int((now - HISTORY_S) // BUCKET_S)
        for minute in [m for m in self.buckets if m < oldest]:
            del self.buckets[minute]
        self.seen = {k: m for k, m in self.seen.items() if m >= oldest}
        for per in self.per_worker.values():
            for minute in [m for m in per if m < oldest]:
                del per[minute]

    def series(self, now: float) -> dict[str, Any]:
        """The last hour as parallel lists, one entry per minute, oldest first."""
        last = int(now // BUCKET_S)
        minutes = list(range(last - int(HISTORY_S // BUCKET_S) + 1, last + 1))
        empty = {"succeeded": 0, "failed": 0, "cancelled": 0, "reward_sum": 0.0, "reward_n": 0}
        rows = [self.buckets.get(m, empty) for m in minutes]
        return {
            "t": [m * BUCKET_S for m in minutes],
            "succeeded": [int(b["succeeded"]) for b in rows],
            "failed": [int(b["failed"]) for b in rows],
            "cancelled": [int(b["cancelled"]) for b in rows],
            "reward_mean": [
                b["reward_sum"] / b["reward_n"] if b["reward_n"] else None for b in rows
            ],
            "failed_last_hour": sum(int(b["failed"]) for b in rows),
            "finished_last_hour": sum(int(b["succeeded"] + b["failed"]) for b in rows),
        }

    def worker_rate(self, worker_id: str, now: float, window_s: float = 300.0) -> float:
        """Rollouts per minute finished by one worker over the last ``window_s`` seconds."""
        first = int((now - window_s) // BUCKET_S)
        per = self.per_worker.get(worker_id, {})
        return round(sum(n for m, n in per.items() if m > first) / (window_s / 60.0), 3)
