"""How an attempt ends: the retry policy decided per attempt, then written set-wise.

Two budgets (docs/store.md, "Retries"): an attempt that fails or times out spends the rollout's
own ``max_attempts``; one lost with its runner (its lease lapsed, or its runner restarted under the
same id) spends ``max_lost``; one given back (a runner's shutdown, an operator's requeue) spends
nothing. A rollout requeued after a charged end waits ``retry_delay`` before it may be claimed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from rollfleet.errors import Conflict, NotFound
from rollfleet.model import (
    ACTIVE_ATTEMPT,
    ATTEMPT_STATUS,
    OUTCOME,
    ROLLOUT_STATUS,
    SUSPECT_RUNNERS,
    AttemptStatus,
    Charge,
    RetryDecision,
    RolloutResult,
    RolloutStatus,
    check_attempt_transition,
    check_rollout_transition,
    retry_decision,
    retry_delay,
)
from rollfleet.store.records import _ids
from rollfleet.store.tx import Row, Tx

Counts = tuple[int, int]  # rollouts (succeeded, failed) of one worker's attempts
_jitter = random.Random()  # retry delays: spread, not reproduced


def live_attempt(tx: Tx, attempt_id: str) -> Row:
    """The row of a live attempt that still owns its rollout; NotFound or Conflict otherwise."""
    return check_live(attempt_rows(tx, [attempt_id]).get(attempt_id), attempt_id)


def check_live(row: Row | None, attempt_id: str) -> Row:
    """``row`` if it is a live attempt that owns its rollout; NotFound or Conflict otherwise."""
    if row is None:
        raise NotFound(f"attempt {attempt_id} not found")
    if (
        ATTEMPT_STATUS[row["status"]] not in ACTIVE_ATTEMPT
        or row["current_attempt_id"] != attempt_id
    ):
        raise Conflict(
            f"attempt {attempt_id} is {row['status']}: "
            f"it no longer owns rollout {row['rollout_id']}"
        )
    return row


@dataclass(frozen=True)
class End:
    """A decided end of one live attempt, not yet written."""

    row: Row
    outcome: AttemptStatus
    new: RolloutStatus
    charge: Charge
    result: RolloutResult | None = None
    error: str | None = None
    delay_s: float = 0.0  # before the requeued rollout may be claimed again
    suspect: bool = False


def lost_streak(tx: Tx, row: Row) -> list[str]:
    """The runners of this rollout's latest attempts lost in a row, this one first (attempts
    given back by a release neither count nor break the streak)."""
    streak = [row.get("worker_id") or "?"]
    for r in tx.all("recent_attempts", rollout_id=row["rollout_id"]):
        if r["status"] in ("preparing", "running"):
            continue  # the attempt being ended
        if r["status"] != "lost" or r["charged"] == Charge.OWN:
            break
        if r["charged"] == Charge.LOST:
            streak.append(r["worker_id"] or "?")
    return streak


def decide_end(
    row: Row,
    outcome: AttemptStatus,
    *,
    result: RolloutResult | None = None,
    error: str | None = None,
    charge: Charge = Charge.OWN,
    streak: Sequence[str] = (),
) -> End:
    """Check the transitions and apply the retry policy to one live attempt (nothing is written).

    A LOST charge spends ``max_lost``, an OWN one ``max_attempts``; ``streak`` names the runners
    this rollout was lost with in a row (for LOST charges).
    """
    check_attempt_transition(row["attempt_id"], ATTEMPT_STATUS[row["status"]], outcome)
    if charge is Charge.LOST:
        used, budget = row["attempts_lost"] + 1, row["max_lost"]
    else:
        used, budget = row["attempts_charged"] + (charge is Charge.OWN), row["max_attempts"]
    decision = retry_decision(outcome, used, budget)
    new = RolloutStatus.QUEUING if decision is RetryDecision.REQUEUE else OUTCOME[outcome]
    check_rollout_transition(row["rollout_id"], ROLLOUT_STATUS[row["rollout_status"]], new)
    suspect = len(set(streak)) >= SUSPECT_RUNNERS
    delay = 0.0
    if new is RolloutStatus.QUEUING and charge is not Charge.NONE:
        retries = row["attempts_charged"] + row["attempts_lost"] + 1
        delay = retry_delay(row["retry_delay_s"], retries, _jitter)
    elif charge is Charge.LOST and new.terminal:
        runners = ", ".join(dict.fromkeys(streak))
        error = f"{error}; lost with its runner {used} times (max_lost {budget}), last on {runners}"
    return End(row, outcome, new, charge, result, error, delay, suspect)


def write_ends(tx: Tx, ends: Sequence[End], now: float, counted_by: str | None = None) -> Counts:
    """Write decided ends set-wise; Conflict (undo the enclosing savepoint) if any row changed
    meanwhile. The outcomes of ``counted_by``'s attempts are not added to its worker row but
    returned, ``(succeeded, failed)``, for the caller's own update of that row."""
    if not ends:
        return 0, 0
    what = (
        f"attempt {ends[0].row['attempt_id']}" if len(ends) == 1 else f"one of {len(ends)} attempts"
    )
    attempts = [
        {
            "attempt_id": e.row["attempt_id"],
            "attempt_status": e.outcome.value,
            "now": now,
            "error": e.error,
            "charged": e.charge.value,
        }
        for e in ends
    ]
    rollouts = [
        {
            "rollout_id": e.row["rollout_id"],
            "attempt_id": e.row["attempt_id"],
            "status": e.new.value,
            "now": now,
            "result": None if e.result is None else e.result.model_dump_json(),
            "reward": None if e.result is None else e.result.reward,
            "error": e.error,
            "charged_own": int(e.charge is Charge.OWN),
            "charged_lost": int(e.charge is Charge.LOST),
            "available_at": now + e.delay_s,
            "suspect": int(e.suspect),
            "finished_at": None if e.new is RolloutStatus.QUEUING else now,
        }
        for e in ends
    ]
    if tx.fused_writes:  # each end one statement: its attempt and its rollout
        changed = [
            tx.all("finish_one", **(a | r))[0] for a, r in zip(attempts, rollouts, strict=True)
        ]
        ended, moved = sum(c["attempts"] for c in changed), sum(c["rollouts"] for c in changed)
    else:
        ended = tx.many("finish_attempt", attempts)
        moved = tx.many("finish_rollout", rollouts) if ended == len(ends) else 0
    if ended != len(ends):
        raise Conflict(f"{what} was ended by someone else")
    if moved != len(ends):
        raise Conflict(f"the rollout of {what} changed under it")
    counts: dict[str, list[int]] = {}
    for e in ends:
        if e.row.get("worker_id") and e.new.terminal:
            counts.setdefault(e.row["worker_id"], [0, 0])[e.new is not RolloutStatus.SUCCEEDED] += 1
    own = counts.pop(counted_by, [0, 0]) if counted_by is not None else [0, 0]
    count_outcomes(tx, counts)
    return own[0], own[1]


def count_outcomes(tx: Tx, counts: dict[str, list[int]]) -> None:
    """Add rollouts succeeded and failed, ``{worker id: [succeeded, failed]}``, to worker rows."""
    tx.many(
        "count_worker_outcome",
        [
            {"worker_id": w, "succeeded": ok, "failed": bad}
            for w, (ok, bad) in counts.items()
            if ok or bad
        ],
    )


def end_attempt(
    tx: Tx,
    row: Row,
    outcome: AttemptStatus,
    now: float,
    *,
    result: RolloutResult | None = None,
    error: str | None = None,
    charge: Charge = Charge.OWN,
) -> RolloutStatus:
    """End one live attempt and move its rollout by the retry policy; returns the rollout's new
    status."""
    end = decide_end(row, outcome, result=result, error=error, charge=charge)
    write_ends(tx, [end], now)
    return end.new


def attempt_rows(tx: Tx, attempt_ids: Sequence[str]) -> dict[str, Row]:
    """Attempts joined with their rollouts' retry fields, by attempt id (locked on PostgreSQL)."""
    return {
        row["attempt_id"]: row for row in tx.all("select_attempts_by_ids", ids=_ids(attempt_ids))
    }


def expire(tx: Tx, why: dict[str, tuple[AttemptStatus, str]], now: float) -> list[End]:
    """End live attempts that nobody will finish (LOST: with their runner, charged to
    ``max_lost``; TIMEOUT: the rollout's own failure) and requeue or fail their rollouts."""
    if not why:
        return []
    rows = attempt_rows(tx, list(why))
    ends = []
    for attempt_id, (outcome, reason) in why.items():
        row = check_live(rows.get(attempt_id), attempt_id)
        lost = outcome is AttemptStatus.LOST
        ends.append(
            decide_end(
                row,
                outcome,
                error=reason,
                charge=Charge.LOST if lost else Charge.OWN,
                streak=lost_streak(tx, row) if lost else (),
            )
        )
    write_ends(tx, ends, now)
    if any(e.new.terminal for e in ends):  # a rollout ended: never visible before it is on disk
        tx.commit_durably()
    return ends
