"""The named SQL queries: both dialects define the same ones, and SQLite's indexes are read."""

from __future__ import annotations

import re
from pathlib import Path

from rollfleet.store import queries
from rollfleet.store.ops import migrate
from rollfleet.store.postgres import _queries
from rollfleet.store.sqlite import SqliteTx, _connect

# PostgreSQL writes several tables in one statement (Tx.fused_writes); SQLite runs the parts apart
POSTGRES_ONLY = {"claim_open"}
SQLITE_ONLY = {"claim_rollouts"}  # PostgreSQL claims only through claim_open


def test_dialects_define_the_same_queries() -> None:
    sqlite, postgres = set(queries.load("sqlite")), set(queries.load("postgresql"))
    assert sqlite - SQLITE_ONLY == postgres - POSTGRES_ONLY


def test_postgres_parameters_are_rewritten_but_casts_kept() -> None:
    sql = _queries()["finish_rollout"]
    assert "%(status)s" in sql and "::text" in sql and ":status" not in sql


# Written once per enqueue, never moved; batch queries filter ``(:batch_id IS NULL OR …)`` over a seq
# range, which SQLite cannot serve from it (a follow-up: a query variant for one batch)
UNREAD = {"rollouts_batch"}


def test_every_sqlite_index_is_read_by_some_named_query(tmp_path: Path) -> None:
    # an index no plan reads is only write cost, paid by every write that moves its entries
    conn = _connect(str(tmp_path / "plans.db"))  # the store's own connection: rows as dicts
    tx = SqliteTx(conn)
    migrate(tx)
    tx.run("pool_leases_table")  # made on first use
    tx.run("pool_leases_index")
    indexes = {
        row["name"]
        for row in conn.execute(
            'SELECT il.name, il."unique" FROM sqlite_master m, pragma_index_list(m.name) il '
            "WHERE m.type = 'table'"
        )
        if not row["unique"]  # a UNIQUE index is there for integrity, read or not
    }
    read: set[str] = set()
    for sql in queries.load("sqlite").values():
        if ";" in sql.rstrip(";") or sql.startswith(("CREATE", "DROP", "ALTER")):
            continue  # the schema: no plan
        params = dict.fromkeys(re.findall(r"(?<!:):(\w+)", sql))
        for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params):
            read.update(index for index in indexes if f"INDEX {index}" in row["detail"])
    assert indexes - UNREAD <= read, f"indexes no query reads: {sorted(indexes - UNREAD - read)}"
    assert UNREAD <= indexes - read  # read now: take it off the list


def test_a_database_made_before_loses_the_unread_updated_index(tmp_path: Path) -> None:
    conn = _connect(str(tmp_path / "old.db"))
    migrate(SqliteTx(conn))
    conn.execute("CREATE INDEX rollouts_updated ON rollouts (updated_at)")  # as made before
    migrate(SqliteTx(conn))  # what opening the store does
    names = {row["name"] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert "rollouts_updated" not in names and "rollouts_status" in names
