"""Rows to records, and the JSON encoding both SQL dialects share (JSON is stored as TEXT)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from rollfleet.errors import NotFound
from rollfleet.model import ATTEMPT_STATUS, Attempt, Rollout
from rollfleet.store.tx import Row, Tx


def dumps(value: Any) -> str:
    """Encode a JSON value as text."""
    return orjson.dumps(value).decode()


def loads(text: str | bytes | None) -> Any:
    """Decode JSON text (None stays None)."""
    return None if text is None else orjson.loads(text)


def _ids(ids: Sequence[str]) -> str:
    return dumps(list(ids))


def rollout_doc(row: Row, attempt: dict[str, Any] | None = None) -> dict[str, Any]:
    """A rollout as plain JSON values, from a joined rollouts/attempts row (or a rollouts row and
    its
    attempt's fields): the wire form of a Rollout, and what the record is validated from."""
    if attempt is None and row.get("a_attempt_id"):
        attempt = {
            "attempt_id": row["a_attempt_id"],
            "rollout_id": row["rollout_id"],
            "sequence": row["a_sequence"],
            "worker_id": row["a_worker_id"],
            "status": row["a_status"],
            "started_at": row["a_started_at"],
            "lease_expires_at": row["a_lease_expires_at"],
            "last_heartbeat_at": row["a_last_heartbeat_at"],
            "finished_at": row["a_finished_at"],
            "error": row["a_error"],
        }
    return {
        "rollout_id": row["rollout_id"],
        "input": loads(row["input"]),
        "mode": row["mode"],
        "status": row["status"],
        "priority": row["priority"],
        "batch_id": row["batch_id"],
        "group_id": row["group_id"],
        "config": loads(row["config"]),
        "metadata": loads(row["metadata"]),
        "result": loads(row["result"]),
        "error": row["error"],
        "num_attempts": row["num_attempts"],
        "attempts_charged": row["attempts_charged"],
        "attempts_lost": row["attempts_lost"],
        "suspect": bool(row["suspect"]),
        "available_at": row["available_at"],
        "attempt": attempt,
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "finished_at": row["finished_at"],
    }


def rollout_from_row(row: Row, attempt: dict[str, Any] | None = None) -> Rollout:
    """Build a Rollout record from a row (see :func:`rollout_doc`).

    pydantic's Rust validator builds the nested records in one pass: measured faster than building
    them in Python, and 2.5× faster than ``model_construct``.
    """
    return Rollout.model_validate(rollout_doc(row, attempt))


def attempt_from_row(row: Row) -> Attempt:
    """Build an Attempt record from an attempts row."""
    return Attempt(
        attempt_id=row["attempt_id"],
        rollout_id=row["rollout_id"],
        sequence=row["sequence"],
        worker_id=row["worker_id"],
        status=ATTEMPT_STATUS[row["status"]],
        started_at=row["started_at"],
        lease_expires_at=row["lease_expires_at"],
        last_heartbeat_at=row["last_heartbeat_at"],
        finished_at=row["finished_at"],
        error=row["error"],
    )


def get_rollouts(tx: Tx, ids: Sequence[str]) -> list[Rollout]:
    """Return the rollouts with these ids, in the order given (unknown ids are left out)."""
    by_id = {
        row["rollout_id"]: rollout_from_row(row)
        for row in tx.all("select_rollouts_by_ids", ids=_ids(ids))
    }
    return [by_id[i] for i in ids if i in by_id]


def get_rollout(tx: Tx, rollout_id: str) -> Rollout:
    """Return one rollout or raise NotFound."""
    found = get_rollouts(tx, [rollout_id])
    if not found:
        raise NotFound(f"rollout {rollout_id} not found")
    return found[0]
