"""The tiny interface the operations need from a backend: named queries inside one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

Row = dict[str, Any]


class Tx(Protocol):
    """One open transaction that runs named queries."""

    # Whether one statement writes several tables (PostgreSQL's data-modifying CTEs), where each
    # statement is a round trip and ~0.1 ms of the server's CPU: a claim leases, opens the attempts
    # and touches the worker in ``claim_open``; each end is ``finish_one`` (``finish_attempt`` and
    # ``finish_rollout`` composed). False (SQLite, whose statements run in-process):
    # ``claim_rollouts``, ``insert_attempt``, ``touch_worker``; ``finish_attempt`` then
    # ``finish_rollout``, each over the whole batch.
    fused_writes: bool

    def all(self, name: str, **params: Any) -> list[Row]:
        """Run a named query and return every row."""
        ...

    def one(self, name: str, **params: Any) -> Row | None:
        """Run a named query and return its first row, or None."""
        ...

    def run(self, name: str, **params: Any) -> int:
        """Run a named statement and return the number of rows it changed."""
        ...

    def many(self, name: str, rows: Sequence[dict[str, Any]]) -> int:
        """Run a named statement once per parameter set; return the total number of rows changed."""
        ...

    def script(self, name: str) -> None:
        """Run a named block of several statements (the schema)."""
        ...

    def commit_durably(self) -> None:
        """Make this transaction's commit wait for the disk even in a write that need not
        (PostgreSQL: a reaper pass that ends a rollout; SQLite: reads wait for the sync instead)."""
        ...

    def savepoint(self) -> AbstractContextManager[None]:
        """A nested transaction: an exception inside undoes only what ran inside, then
        propagates."""
        ...
