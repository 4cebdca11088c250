"""Store writes: the rollout lifecycle, one function per operation, identical for every SQL dialect.

Each function runs inside one transaction (``tx``) and takes the time ``now`` as an argument
so tests can drive the clock. The transition table in :mod:`rollfleet.model` decides what is
legal; the SQL repeats the guard (``WHERE status IN (…)``) so a racing writer changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollfleet.errors import Conflict, InvalidInput, NotFound, RollfleetError
from rollfleet.model import (
    ACTIVE_ATTEMPT,
    OUTCOME,
    AttemptStatus,
    Completion,
    CompletionOutcome,
    HeartbeatReply,
    ReapReport,
    Resources,
    RetryDecision,
    Rollout,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    StepIn,
    Worker,
    WorkerStatus,
    check_attempt_transition,
    check_rollout_transition,
    new_id,
    retry_decision,
)
from rollfleet.store.reads import get_resources, query_workers
from rollfleet.store.records import _ids, dumps, get_rollout, get_rollouts, rollout_doc
from rollfleet.store.tx import Row, Tx

TIMEOUT_GRACE_S = 2.0  # the runner enforces timeout_s itself; the reaper is the backstop


def migrate(tx: Tx) -> None:
    """Create the schema if it is not there."""
    tx.script("schema")


# --- enqueue and claim -------------------------------------------------------------------------


def _insert(
    tx: Tx,
    specs: Sequence[RolloutSpec],
    rollout_ids: Sequence[str],
    status: RolloutStatus,
    now: float,
) -> None:
    tx.many(
        "insert_rollout",
        [
            {
                "rollout_id": rollout_id,
                "input": dumps(spec.input),
                "mode": spec.mode,
                "status": status.value,
                "priority": spec.priority,
                "batch_id": spec.batch_id,
                "group_id": spec.group_id,
                "config": spec.config.model_dump_json(),
                "timeout_s": spec.config.timeout_s,
                "heartbeat_s": spec.config.heartbeat_s,
                "max_attempts": spec.config.max_attempts,
                "metadata": dumps(spec.metadata),
                "now": now,
            }
            for spec, rollout_id in zip(specs, rollout_ids, strict=True)
        ],
    )


def enqueue_many(tx: Tx, specs: Sequence[RolloutSpec], now: float) -> list[Rollout]:
    """Insert QUEUING rollouts, all or nothing; an id that exists already returns that rollout."""
    ids = [spec.rollout_id or new_id("ro") for spec in specs]
    if len(set(ids)) != len(ids):
        raise InvalidInput("enqueue: the same rollout_id appears twice in one request")
    _insert(tx, specs, ids, RolloutStatus.QUEUING, now)
    tx.run("notify_queued")
    return get_rollouts(tx, ids)


def _open_attempts(
    tx: Tx, claimed: list[Row], worker_id: str | None, now: float
) -> list[dict[str, Any]]:
    """Insert a PREPARING attempt for each just-leased rollout row; return the leased rollouts as
    documents.

    The rows come from the claiming UPDATE's RETURNING, so the answer is built without reading back.
    """
    attempts = [
        {
            "attempt_id": row["current_attempt_id"],
            "rollout_id": row["rollout_id"],
            "sequence": row["num_attempts"],
            "worker_id": worker_id,
            "now": now,
            "lease_expires_at": now + row["heartbeat_s"],
            "deadline_at": None if row["timeout_s"] is None else now + row["timeout_s"],
        }
        for row in claimed
    ]
    tx.many("insert_attempt", attempts)
    if worker_id is not None:  # the worker's heartbeat, and BUSY once it holds work
        tx.run(
            "touch_worker",
            worker_id=worker_id,
            status=WorkerStatus.BUSY.value if claimed else None,
            now=now,
        )
    return [
        rollout_doc(
            row,
            {
                "attempt_id": a["attempt_id"],
                "rollout_id": a["rollout_id"],
                "sequence": a["sequence"],
                "worker_id": worker_id,
                "status": AttemptStatus.PREPARING.value,
                "started_at": now,
                "lease_expires_at": a["lease_expires_at"],
                "last_heartbeat_at": None,
                "finished_at": None,
                "error": None,
            },
        )
        for row, a in zip(claimed, attempts, strict=True)
    ]


def claim(tx: Tx, worker_id: str, max_n: int, now: float) -> list[dict[str, Any]]:
    """Lease up to ``max_n`` queued rollouts to a worker, highest priority first, then FIFO; as
    documents."""
    reap(tx, now)
    claimed = sorted(
        tx.all("claim_rollouts", max_n=max_n, now=now), key=lambda r: (-r["priority"], r["seq"])
    )
    return _open_attempts(tx, claimed, worker_id, now)


def start_rollout(tx: Tx, spec: RolloutSpec, worker_id: str | None, now: float) -> Rollout:
    """Create a rollout already PREPARING and leased to the caller (released if the caller dies)."""
    rollout_id = spec.rollout_id or new_id("ro")
    _insert(tx, [spec], [rollout_id], RolloutStatus.QUEUING, now)
    claimed = tx.all("start_rollout", rollout_id=rollout_id, attempt_id=new_id("at"), now=now)
    if not claimed:
        raise Conflict(f"rollout {rollout_id} exists already and is not queuing")
    return Rollout.model_validate(_open_attempts(tx, claimed, worker_id, now)[0])


# --- attempts: heartbeat, steps, completion --------------------------------------------------


def heartbeat(
    tx: Tx, attempt_ids: Sequence[str], worker_id: str | None, now: float
) -> list[HeartbeatReply]:
    """Extend the leases of live attempts; each reply says whether to keep going."""
    ids = _ids(attempt_ids)
    tx.run("heartbeat_attempts", ids=ids, now=now)
    tx.run("run_rollouts", ids=ids, now=now)
    if worker_id is not None:
        tx.run("touch_worker", worker_id=worker_id, status=None, now=now)
    replies = []
    for row in tx.all("heartbeat_replies", ids=ids):
        status = AttemptStatus(row["status"])
        replies.append(
            HeartbeatReply(
                attempt_id=row["attempt_id"],
                status=status,
                rollout_status=RolloutStatus(row["rollout_status"]),
                lease_expires_at=row["lease_expires_at"],
                keep_going=status in ACTIVE_ATTEMPT,
            )
        )
    return replies


def _live_attempt(tx: Tx, attempt_id: str) -> Row:
    return _check_live(_attempt_rows(tx, [attempt_id]).get(attempt_id), attempt_id)


def _check_live(row: Row | None, attempt_id: str) -> Row:
    if row is None:
        raise NotFound(f"attempt {attempt_id} not found")
    if (
        AttemptStatus(row["status"]) not in ACTIVE_ATTEMPT
        or row["current_attempt_id"] != attempt_id
    ):
        raise Conflict(
            f"attempt {attempt_id} is {row['status']}: "
            f"it no longer owns rollout {row['rollout_id']}"
        )
    return row


def add_steps(tx: Tx, attempt_id: str, steps: Sequence[StepIn], now: float) -> int:
    """Append trajectory steps from the attempt that owns the rollout; refused from any other."""
    row = _live_attempt(tx, attempt_id)
    if not steps:
        return 0
    last = tx.one("bump_steps", rollout_id=row["rollout_id"], n=len(steps))
    first = int(last["num_steps"]) - len(steps) + 1 if last else 1
    tx.many(
        "insert_step",
        [
            {
                "rollout_id": row["rollout_id"],
                "attempt_id": attempt_id,
                "sequence": first + i,
                "kind": s.kind,
                "payload": dumps(s.payload),
                "timestamp": s.timestamp or now,
            }
            for i, s in enumerate(steps)
        ],
    )
    return len(steps)


@dataclass(frozen=True)
class _End:
    """A decided end of one live attempt, not yet written."""

    row: Row
    outcome: AttemptStatus
    new: RolloutStatus
    charges: int
    result: RolloutResult | None = None
    error: str | None = None


def _decide_end(
    row: Row,
    outcome: AttemptStatus,
    *,
    result: RolloutResult | None = None,
    error: str | None = None,
    charged: bool = True,
) -> _End:
    """Check the transitions and apply the retry policy to one live attempt (nothing is written)."""
    check_attempt_transition(row["attempt_id"], AttemptStatus(row["status"]), outcome)
    charges = int(charged)
    decision = retry_decision(outcome, row["attempts_charged"] + charges, row["max_attempts"])
    new = RolloutStatus.QUEUING if decision is RetryDecision.REQUEUE else OUTCOME[outcome]
    check_rollout_transition(row["rollout_id"], RolloutStatus(row["rollout_status"]), new)
    return _End(row, outcome, new, charges, result, error)


def _write_ends(tx: Tx, ends: Sequence[_End], now: float) -> None:
    """Write decided ends set-wise; Conflict (undo the enclosing savepoint) if any row changed
    meanwhile."""
    if not ends:
        return
    what = (
        f"attempt {ends[0].row['attempt_id']}" if len(ends) == 1 else f"one of {len(ends)} attempts"
    )
    changed = tx.many(
        "finish_attempt",
        [
            {
                "attempt_id": e.row["attempt_id"],
                "status": e.outcome.value,
                "now": now,
                "error": e.error,
                "charged": e.charges,
            }
            for e in ends
        ],
    )
    if changed != len(ends):
        raise Conflict(f"{what} was ended by someone else")
    changed = tx.many(
        "finish_rollout",
        [
            {
                "rollout_id": e.row["rollout_id"],
                "attempt_id": e.row["attempt_id"],
                "status": e.new.value,
                "now": now,
                "result": None if e.result is None else e.result.model_dump_json(),
                "reward": None if e.result is None else e.result.reward,
                "error": e.error,
                "charged": e.charges,
                "finished_at": None if e.new is RolloutStatus.QUEUING else now,
            }
            for e in ends
        ],
    )
    if changed != len(ends):
        raise Conflict(f"the rollout of {what} changed under it")
    counts: dict[str, list[int]] = {}
    for e in ends:
        if e.row.get("worker_id") and e.new.terminal:
            counts.setdefault(e.row["worker_id"], [0, 0])[e.new is not RolloutStatus.SUCCEEDED] += 1
    tx.many(
        "count_worker_outcome",
        [{"worker_id": w, "succeeded": ok, "failed": bad} for w, (ok, bad) in counts.items()],
    )
    if any(e.new is RolloutStatus.QUEUING for e in ends):
        tx.run("notify_queued")
    if any(e.new.terminal for e in ends):
        tx.run("notify_finished")


def _end_attempt(
    tx: Tx,
    row: Row,
    outcome: AttemptStatus,
    now: float,
    *,
    result: RolloutResult | None = None,
    error: str | None = None,
    charged: bool = True,
) -> RolloutStatus:
    """End one live attempt and move its rollout by the retry policy; returns the rollout's new
    status."""
    end = _decide_end(row, outcome, result=result, error=error, charged=charged)
    _write_ends(tx, [end], now)
    return end.new


COMPLETE_STATUSES = frozenset(
    {
        AttemptStatus.SUCCEEDED,
        AttemptStatus.FAILED,
        AttemptStatus.TIMEOUT,
        AttemptStatus.CANCELLED,
    }
)
# (rollout id, its new status) or why it was refused
Answer = tuple[str, RolloutStatus] | RollfleetError


def _attempt_rows(tx: Tx, attempt_ids: Sequence[str]) -> dict[str, Row]:
    return {
        row["attempt_id"]: row for row in tx.all("select_attempts_by_ids", ids=_ids(attempt_ids))
    }


def _decide_completion(
    row: Row | None, item: Completion, ends: list[_End]
) -> tuple[str, RolloutStatus]:
    if item.status not in COMPLETE_STATUSES:
        raise InvalidInput(
            f"complete: status must be one of {sorted(s.value for s in COMPLETE_STATUSES)}"
        )
    if (
        row is not None and AttemptStatus(row["status"]) == item.status
    ):  # a retry of a completion already applied
        return row["rollout_id"], RolloutStatus(row["rollout_status"])
    end = _decide_end(
        _check_live(row, item.attempt_id), item.status, result=item.result, error=item.error
    )
    ends.append(end)
    return end.row["rollout_id"], end.new


def _complete_all(tx: Tx, items: Sequence[Completion], now: float) -> list[Answer]:
    """Decide every completion from one read, then write those that stand in a few set-wise
    statements.

    Raises Conflict when an attempt repeats in ``items`` or another writer changed a row meanwhile.
    """
    ids = [item.attempt_id for item in items]
    if len(set(ids)) != len(ids):
        raise Conflict("the same attempt appears twice in one batch of completions")
    rows = _attempt_rows(tx, ids)
    answers: list[Answer] = []
    ends: list[_End] = []
    for item in items:
        try:
            answers.append(_decide_completion(rows.get(item.attempt_id), item, ends))
        except RollfleetError as exc:
            answers.append(exc)
    _write_ends(tx, ends, now)
    return answers


def _complete_alone(tx: Tx, item: Completion, now: float) -> Answer:
    try:
        with tx.savepoint():
            return _complete_all(tx, [item], now)[0]
    except RollfleetError as exc:
        return exc


def complete(
    tx: Tx,
    attempt_id: str,
    status: AttemptStatus,
    result: RolloutResult | None,
    error: str | None,
    now: float,
) -> Rollout:
    """Finish an attempt with its outcome; a repeat of the same completion returns the rollout
    again."""
    answer = _complete_all(
        tx, [Completion(attempt_id=attempt_id, status=status, result=result, error=error)], now
    )[0]
    if isinstance(answer, RollfleetError):
        raise answer
    return get_rollout(tx, answer[0])


def complete_many(tx: Tx, items: Sequence[Completion], now: float) -> list[CompletionOutcome]:
    """Finish many attempts in one transaction; each is fenced and answered on its own."""
    try:
        with tx.savepoint():
            answers = _complete_all(tx, items, now)
    except Conflict:  # a repeated attempt, or a racing writer: settle each completion alone
        answers = [_complete_alone(tx, item, now) for item in items]
    return [
        CompletionOutcome(attempt_id=item.attempt_id, error_type=type(a).__name__, error=a.message)
        if isinstance(a, RollfleetError)
        else CompletionOutcome(attempt_id=item.attempt_id, rollout_id=a[0], rollout_status=a[1])
        for item, a in zip(items, answers, strict=True)
    ]


def release(tx: Tx, attempt_id: str, reason: str, now: float) -> Rollout:
    """Give a live attempt's rollout back to the queue without charging its retry budget."""
    row = _live_attempt(tx, attempt_id)
    _end_attempt(tx, row, AttemptStatus.LOST, now, error=reason, charged=False)
    return get_rollout(tx, row["rollout_id"])


# --- operator actions ---------------------------------------------------------------------------


def cancel(tx: Tx, rollout_id: str, now: float) -> Rollout:
    """Cancel a rollout that has not finished; cancelling a cancelled one changes nothing."""
    rollout = get_rollout(tx, rollout_id)
    if rollout.status is RolloutStatus.CANCELLED:
        return rollout
    check_rollout_transition(rollout_id, rollout.status, RolloutStatus.CANCELLED)
    if rollout.attempt is not None and rollout.attempt.status in ACTIVE_ATTEMPT:
        row = _live_attempt(tx, rollout.attempt.attempt_id)
        _end_attempt(tx, row, AttemptStatus.CANCELLED, now, error="cancelled")
    else:
        tx.run(
            "finish_rollout",
            rollout_id=rollout_id,
            attempt_id=None,
            status=RolloutStatus.CANCELLED.value,
            now=now,
            result=None,
            reward=None,
            error="cancelled",
            charged=0,
            finished_at=now,
        )
        tx.run("notify_finished")
    return get_rollout(tx, rollout_id)


def requeue(
    tx: Tx,
    statuses: Sequence[RolloutStatus],
    rollout_ids: Sequence[str] | None,
    older_than_s: float,
    now: float,
) -> list[str]:
    """Put stuck PREPARING/RUNNING rollouts back in the queue (operator reset); returns their
    ids."""
    bad = [s.value for s in statuses if s.terminal or s is RolloutStatus.QUEUING]
    if bad:
        raise InvalidInput(
            f"requeue: status {bad[0]!r} cannot be requeued (only preparing and running)"
        )
    rows = tx.all(
        "requeue_candidates",
        statuses=dumps([s.value for s in statuses]),
        ids=None if rollout_ids is None else _ids(rollout_ids),
        older_than=now - older_than_s,
    )
    ids = [r["rollout_id"] for r in rows]
    for live in tx.all("active_attempts_of", ids=_ids(ids)):
        row = _live_attempt(tx, live["attempt_id"])
        _end_attempt(tx, row, AttemptStatus.LOST, now, error="requeued by operator", charged=False)
    return ids


def reap(tx: Tx, now: float) -> ReapReport:
    """Expire lapsed leases and deadlines: LOST/TIMEOUT, then requeue or fail by the retry
    budget."""
    report: dict[str, list[str]] = {"lost": [], "timed_out": [], "requeued": [], "failed": []}
    expired = tx.all("expired_attempts", now=now, grace=TIMEOUT_GRACE_S)
    rows = _attempt_rows(tx, [e["attempt_id"] for e in expired]) if expired else {}
    ends = []
    for e in expired:
        outcome = AttemptStatus(e["outcome"])
        reason = (
            "lease expired: no heartbeat" if outcome is AttemptStatus.LOST else "timeout_s exceeded"
        )
        end = _decide_end(
            _check_live(rows.get(e["attempt_id"]), e["attempt_id"]), outcome, error=reason
        )
        ends.append(end)
        report["lost" if outcome is AttemptStatus.LOST else "timed_out"].append(e["attempt_id"])
        report["requeued" if end.new is RolloutStatus.QUEUING else "failed"].append(e["rollout_id"])
    _write_ends(tx, ends, now)
    if report["failed"]:  # a rollout ended: never visible before it is on disk
        tx.commit_durably()
    offline = [r["worker_id"] for r in tx.all("stale_workers", now=now)]
    return ReapReport(workers_offline=offline, **report)


# --- workers --------------------------------------------------------------------------------------


def register_worker(
    tx: Tx, worker_id: str, metadata: dict[str, Any], lease_s: float, now: float
) -> Worker:
    """Create or revive a worker row as IDLE."""
    tx.run("upsert_worker", worker_id=worker_id, metadata=dumps(metadata), lease_s=lease_s, now=now)
    return query_workers(tx, worker_id, None, 1).items[0]


def update_worker(tx: Tx, worker_id: str, status: WorkerStatus | None, now: float) -> Worker:
    """Record a worker's heartbeat and, if given, its new status."""
    if not tx.run(
        "touch_worker",
        worker_id=worker_id,
        status=None if status is None else status.value,
        now=now,
    ):
        raise NotFound(f"worker {worker_id} not found")
    return query_workers(tx, worker_id, None, 1).items[0]


def add_resources(
    tx: Tx, values: dict[str, Any], resources_id: str | None, now: float
) -> Resources:
    """Store a new version of the named resources."""
    rid = resources_id or new_id("res")
    tx.run("insert_resources", resources_id=rid, vals=dumps(values), now=now)
    found = get_resources(tx, rid)
    assert found is not None
    return found


def kv_put(tx: Tx, key: str, value: Any, now: float) -> None:
    """Store a JSON value under a key (used by the coordinator to persist batches)."""
    tx.run("kv_put", key=key, value=dumps(value), now=now)
