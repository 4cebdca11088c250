"""The tiny interface the operations need from a backend: named queries inside one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

Row = dict[str, Any]


class Tx(Protocol):
    """One open transaction that runs named queries."""

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
