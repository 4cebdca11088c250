"""Store writes: the rollout lifecycle, one function per operation, identical for every SQL dialect.

Each function runs inside one transaction (``tx``) and takes the time ``now`` as an argument
so tests can drive the clock. The transition table in :mod:`rollfleet.model` decides what is
legal; the SQL repeats the guard (``WHERE status IN (…)``) so a racing writer changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollfleet.errors import Conflict, InvalidInput, RollfleetError
from rollfleet.model import (
    ACTIVE_ATTEMPT,
    ATTEMPT_STATUS,
    ROLLOUT_STATUS,
    AttemptStatus,
    Charge,
    Completion,
    CompletionOutcome,
    HeartbeatReply,
    ReapReport,
    Rollout,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    StepIn,
    WorkerStatus,
    check_rollout_transition,
    new_id,
)
from rollfleet.store.blobs import MARKER, Blob, extract_images
from rollfleet.store.ends import (
    Counts,
    End,
    attempt_rows,
    check_live,
    count_outcomes,
    decide_end,
    end_attempt,
    expire,
    live_attempt,
    write_ends,
)
from rollfleet.store.records import _ids, dumps, get_rollout, get_rollouts, rollout_doc
from rollfleet.store.tx import Row, Tx

TIMEOUT_GRACE_S = 2.0  # the runner enforces timeout_s itself; the reaper is the backstop


def migrate(tx: Tx) -> None:
    """Create the schema if it is not there; add the columns a database made by an older
    version lacks."""
    tx.script("schema")
    if "available_at" not in {r["name"] for r in tx.all("rollout_columns")}:
        tx.script("add_retry_columns")


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
                "max_lost": spec.config.max_lost,
                "retry_delay_s": spec.config.retry_delay_s,
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


def _attempt_of(row: Row, worker_id: str | None, now: float) -> dict[str, Any]:
    """The PREPARING attempt a just-leased rollout row opens (the claiming UPDATE chose its id)."""
    return {
        "attempt_id": row["current_attempt_id"],
        "rollout_id": row["rollout_id"],
        "sequence": row["num_attempts"],
        "worker_id": worker_id,
        "now": now,
        "lease_expires_at": now + row["heartbeat_s"],
        "deadline_at": None if row["timeout_s"] is None else now + row["timeout_s"],
    }


def _leased_docs(
    claimed: list[Row], attempts: list[dict[str, Any]], worker_id: str | None, now: float
) -> list[dict[str, Any]]:
    """The leased rollouts as documents, each with its new attempt: built from the claiming
    UPDATE's RETURNING, never read back."""
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


def _open_attempts(
    tx: Tx, claimed: list[Row], worker_id: str | None, now: float, counted: Counts = (0, 0)
) -> list[dict[str, Any]]:
    """Insert a PREPARING attempt for each just-leased rollout row; return the leased rollouts as
    documents. ``counted``: outcomes of the worker's attempts to add to its row in the same
    update as its heartbeat."""
    attempts = [_attempt_of(row, worker_id, now) for row in claimed]
    tx.many("insert_attempt", attempts)
    if worker_id is not None:  # the worker's heartbeat, and BUSY once it holds work
        tx.run(
            "touch_worker",
            worker_id=worker_id,
            status=WorkerStatus.BUSY.value if claimed else None,
            now=now,
            succeeded=counted[0],
            failed=counted[1],
        )
    return _leased_docs(claimed, attempts, worker_id, now)


def claim(
    tx: Tx,
    worker_id: str,
    max_n: int,
    now: float,
    reap_first: bool = True,
    counted: Counts = (0, 0),
) -> list[dict[str, Any]]:
    """Lease up to ``max_n`` queued rollouts to a worker, highest priority first, then FIFO; as
    documents. A requeued rollout is not leased before its retry delay has passed. With
    ``reap_first``, lapsed leases are expired first (their rollouts may be leased at once).
    ``counted``: the worker's outcomes not yet added to its row (see ``write_ends``)."""
    if reap_first:
        reap(tx, now)
    if not tx.fused_writes:
        rows = tx.all("claim_rollouts", max_n=max_n, now=now)
        return _open_attempts(tx, _in_claim_order(rows), worker_id, now, counted)
    # the lease, the attempts and the worker's row in one statement
    rows = tx.all(
        "claim_open",
        max_n=max_n,
        now=now,
        worker_id=worker_id,
        succeeded=counted[0],
        failed=counted[1],
    )
    claimed = _in_claim_order(rows)
    return _leased_docs(claimed, [_attempt_of(r, worker_id, now) for r in claimed], worker_id, now)


def _in_claim_order(rows: list[Row]) -> list[Row]:
    """Leased rollout rows highest priority first, then FIFO (RETURNING keeps no order)."""
    return sorted(rows, key=lambda r: (-r["priority"], r["seq"]))


def claim_or_next(
    tx: Tx, worker_id: str, max_n: int, now: float, reap_first: bool = True
) -> tuple[list[dict[str, Any]], float | None]:
    """``claim``; when nothing could be leased, also when the first rollout held back by its
    retry delay becomes claimable (None if none is), so a waiting claim wakes for it."""
    got = claim(tx, worker_id, max_n, now, reap_first)
    if got:
        return got, None
    row = tx.one("next_available", now=now)
    return got, None if row is None else row["at"]


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
        tx.run("touch_worker", worker_id=worker_id, status=None, now=now, succeeded=0, failed=0)
    replies = []
    for row in tx.all("heartbeat_replies", ids=ids):
        status = ATTEMPT_STATUS[row["status"]]
        replies.append(
            HeartbeatReply(
                attempt_id=row["attempt_id"],
                status=status,
                rollout_status=ROLLOUT_STATUS[row["rollout_status"]],
                lease_expires_at=row["lease_expires_at"],
                keep_going=status in ACTIVE_ATTEMPT,
            )
        )
    return replies


def add_steps(tx: Tx, attempt_id: str, steps: Sequence[StepIn], now: float) -> int:
    """Append trajectory steps from the attempt that owns the rollout; refused from any other."""
    row = live_attempt(tx, attempt_id)
    if not steps:
        return 0
    images: dict[str, Blob] = {}
    payloads = [_without_images(s.payload, images) for s in steps]
    last = tx.one("bump_steps", rollout_id=row["rollout_id"], n=len(steps))
    first = int(last["num_steps"]) - len(steps) + 1 if last else 1
    tx.many(
        "insert_blob",
        [
            {"sha256": b.sha256, "media_type": b.media_type, "size": len(b.data), "data": b.data}
            | {"now": now}
            for b in images.values()
        ],
    )
    tx.many(
        "insert_step",
        [
            {
                "rollout_id": row["rollout_id"],
                "attempt_id": attempt_id,
                "sequence": first + i,
                "kind": s.kind,
                "payload": payload,
                "timestamp": s.timestamp or now,
            }
            for i, (s, payload) in enumerate(zip(steps, payloads, strict=True))
        ],
    )
    return len(steps)


def _without_images(payload: dict[str, Any], images: dict[str, Blob]) -> str:
    """A step's payload as stored: JSON, with its images moved into ``images`` (by content)."""
    text = dumps(payload)
    if MARKER not in text:  # the common case: no image, nothing to walk
        return text
    return dumps(extract_images(payload, images))


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


def _decide_completion(
    row: Row | None, item: Completion, ends: list[End]
) -> tuple[str, RolloutStatus]:
    if item.status not in COMPLETE_STATUSES:
        raise InvalidInput(
            f"complete: status must be one of {sorted(s.value for s in COMPLETE_STATUSES)}"
        )
    if (
        row is not None and ATTEMPT_STATUS[row["status"]] == item.status
    ):  # a retry of a completion already applied
        return row["rollout_id"], ROLLOUT_STATUS[row["rollout_status"]]
    end = decide_end(
        check_live(row, item.attempt_id), item.status, result=item.result, error=item.error
    )
    ends.append(end)
    return end.row["rollout_id"], end.new


def _complete_all(
    tx: Tx, items: Sequence[Completion], now: float, counted_by: str | None = None
) -> tuple[list[Answer], Counts]:
    """Decide every completion from one read, then write those that stand in a few set-wise
    statements; with the outcomes of ``counted_by``'s attempts, left for the caller to count.

    Raises Conflict when an attempt repeats in ``items`` or another writer changed a row meanwhile.
    """
    ids = [item.attempt_id for item in items]
    if len(set(ids)) != len(ids):
        raise Conflict("the same attempt appears twice in one batch of completions")
    rows = attempt_rows(tx, ids)
    answers: list[Answer] = []
    ends: list[End] = []
    for item in items:
        try:
            answers.append(_decide_completion(rows.get(item.attempt_id), item, ends))
        except RollfleetError as exc:
            answers.append(exc)
    return answers, write_ends(tx, ends, now, counted_by)


def _complete_alone(
    tx: Tx, item: Completion, now: float, counted_by: str | None
) -> tuple[Answer, Counts]:
    try:
        with tx.savepoint():
            answers, counted = _complete_all(tx, [item], now, counted_by)
            return answers[0], counted
    except RollfleetError as exc:
        return exc, (0, 0)


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
    )[0][0]
    if isinstance(answer, RollfleetError):
        raise answer
    return get_rollout(tx, answer[0])


def complete_many(tx: Tx, items: Sequence[Completion], now: float) -> list[CompletionOutcome]:
    """Finish many attempts in one transaction; each is fenced and answered on its own.

    No savepoint around the batch: the attempts it reads are locked (PostgreSQL) or read inside
    the one writer's transaction (SQLite), so nothing can change them before they are written,
    and the Conflict ``write_ends`` guards against would end the whole operation. Only a batch
    that names an attempt twice is settled one completion at a time, each in a savepoint."""
    return _complete_many(tx, items, now, None)[0]


def _complete_many(
    tx: Tx, items: Sequence[Completion], now: float, counted_by: str | None
) -> tuple[list[CompletionOutcome], Counts]:
    ids = [item.attempt_id for item in items]
    if len(set(ids)) == len(ids):
        answers, counted = _complete_all(tx, items, now, counted_by)
    else:
        settled = [_complete_alone(tx, item, now, counted_by) for item in items]
        answers = [a for a, _ in settled]
        counted = (sum(c[0] for _, c in settled), sum(c[1] for _, c in settled))
    outcomes = [
        CompletionOutcome(attempt_id=item.attempt_id, error_type=type(a).__name__, error=a.message)
        if isinstance(a, RollfleetError)
        else CompletionOutcome(attempt_id=item.attempt_id, rollout_id=a[0], rollout_status=a[1])
        for item, a in zip(items, answers, strict=True)
    ]
    return outcomes, counted


def complete_and_claim(
    tx: Tx,
    items: Sequence[Completion],
    worker_id: str,
    max_n: int,
    now: float,
    reap_first: bool = True,
) -> tuple[list[CompletionOutcome], list[dict[str, Any]]]:
    """``complete_many``, then, only if every completion stood, ``claim`` up to ``max_n`` for
    ``worker_id``, in the same transaction: a refused (fenced) completion claims nothing. The
    worker's row is updated once: its outcomes, heartbeat and status together."""
    outcomes, counted = _complete_many(tx, items, now, counted_by=worker_id)
    if max_n < 1 or any(o.rollout_status is None for o in outcomes):
        count_outcomes(tx, {worker_id: list(counted)})
        return outcomes, []
    return outcomes, claim(tx, worker_id, max_n, now, reap_first, counted)


def release(tx: Tx, attempt_id: str, reason: str, now: float) -> Rollout:
    """Give a live attempt's rollout back to the queue without charging its retry budget."""
    row = live_attempt(tx, attempt_id)
    end_attempt(tx, row, AttemptStatus.LOST, now, error=reason, charge=Charge.NONE)
    return get_rollout(tx, row["rollout_id"])


# --- operator actions ---------------------------------------------------------------------------


def cancel(tx: Tx, rollout_id: str, now: float) -> Rollout:
    """Cancel a rollout that has not finished; cancelling a cancelled one changes nothing."""
    rollout = get_rollout(tx, rollout_id)
    if rollout.status is RolloutStatus.CANCELLED:
        return rollout
    check_rollout_transition(rollout_id, rollout.status, RolloutStatus.CANCELLED)
    if rollout.attempt is not None and rollout.attempt.status in ACTIVE_ATTEMPT:
        row = live_attempt(tx, rollout.attempt.attempt_id)
        end_attempt(tx, row, AttemptStatus.CANCELLED, now, error="cancelled")
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
            charged_own=0,
            charged_lost=0,
            available_at=now,
            suspect=0,
            finished_at=now,
        )
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
        row = live_attempt(tx, live["attempt_id"])
        end_attempt(
            tx, row, AttemptStatus.LOST, now, error="requeued by operator", charge=Charge.NONE
        )
    return ids


def reap(tx: Tx, now: float) -> ReapReport:
    """Expire lapsed leases and deadlines: LOST/TIMEOUT, then requeue or fail by the retry
    budget."""
    report: dict[str, list[str]] = {"lost": [], "timed_out": [], "requeued": [], "failed": []}
    expired = tx.all("expired_attempts", now=now, grace=TIMEOUT_GRACE_S)
    for end in expire(
        tx,
        {
            e["attempt_id"]: (
                (AttemptStatus.LOST, "lease expired: no heartbeat")
                if e["outcome"] == AttemptStatus.LOST.value
                else (AttemptStatus.TIMEOUT, "timeout_s exceeded")
            )
            for e in expired
        },
        now,
    ):
        lost = end.outcome is AttemptStatus.LOST
        report["lost" if lost else "timed_out"].append(end.row["attempt_id"])
        queued = end.new is RolloutStatus.QUEUING
        report["requeued" if queued else "failed"].append(end.row["rollout_id"])
    offline = [r["worker_id"] for r in tx.all("stale_workers", now=now)]
    return ReapReport(workers_offline=offline, **report)
