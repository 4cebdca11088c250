"""PostgreSQL backend: psycopg 3, a connection pool, claims with ``FOR UPDATE SKIP LOCKED``.

Operations are the same functions as on SQLite (:mod:`rollfleet.store.ops`), run in a worker
thread on a pooled connection, one transaction each, retried on serialization failures and
deadlocks. Writes that queue or finish work ``NOTIFY``; every store process ``LISTEN``s, so a
long-poll in one process wakes the moment another process enqueues.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from rollfleet.errors import Conflict, RollfleetError, StoreUnavailable
from rollfleet.store import queries
from rollfleet.store.ops import migrate
from rollfleet.store.tx import Row

if TYPE_CHECKING:
    from rollfleet.store.sql_store import SqlStore

log = logging.getLogger("rollfleet.store")
T = TypeVar("T")
_PARAM = re.compile(r"(?<!:):(?!:)([A-Za-z_]\w*)")
RETRIES = 5


@cache
def _schema_names() -> tuple[frozenset[str], frozenset[str]]:
    """The tables and indexes the schema script makes, and the old indexes it drops."""
    script = queries.load("postgresql")["schema"]
    made = re.findall(r"(?:TABLE|INDEX) IF NOT EXISTS (\w+)", script)
    dropped = re.findall(r"DROP INDEX IF EXISTS (\w+)", script)
    return frozenset(made), frozenset(dropped)


def _schema_current(conn: Any) -> bool:
    """Whether the schema is already as this version makes it: every table and index there,
    none it drops, the newest columns added. Read from the catalogs, which lock no table: the
    DDL itself does (CREATE INDEX IF NOT EXISTS takes a SHARE lock on its table even when the
    index exists), and a replica (re)starting beside live ones deadlocked with their writes."""
    made, dropped = _schema_names()
    names = {
        row["relname"]
        for row in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema()"
        ).fetchall()
    }
    if not made <= names or dropped & names:
        return False
    columns = conn.execute(_queries()["rollout_columns"]).fetchall()
    return "available_at" in {row["name"] for row in columns}


@cache
def _queries() -> dict[str, str]:
    named = {name: _PARAM.sub(r"%(\1)s", sql) for name, sql in queries.load("postgresql").items()}
    return {**named, "finish_one": _finish_one(named)}


def _finish_one(named: dict[str, str]) -> str:
    """``finish_attempt`` and ``finish_rollout`` for one end, as one statement (data-modifying
    CTEs; ``Tx.fused_writes``), answering how many attempts and rollouts it changed."""
    attempt, rollout = (named[n].strip().rstrip(";") for n in ("finish_attempt", "finish_rollout"))
    return (
        f"WITH a AS ({attempt}\nRETURNING 1), r AS ({rollout}\n)\n"
        "SELECT (SELECT count(*) FROM a) AS attempts, (SELECT count(*) FROM r) AS rollouts"
    )


@cache
def _setwise() -> frozenset[str]:
    """The queries written over ``:rows``: every parameter set, as one JSON array, in one
    statement (``json_to_recordset``) rather than one statement per set."""
    return frozenset(name for name, sql in _queries().items() if "%(rows)s" in sql)


@cache
def _planned_each_run() -> frozenset[str]:
    """The queries that look rows up by a list of keys (``= ANY (ARRAY(…))``): never prepared.

    psycopg prepares a statement after its fifth run on a connection, and PostgreSQL then keeps
    one generic plan, costed on the table's size at that moment. Made while the table was nearly
    empty, that plan scans it whole — and keeps doing so as it grows, until an ANALYZE (there is
    none without autovacuum) or a new connection. Planned at each run, a key list is always looked
    up through its index.
    """
    return frozenset(name for name, sql in _queries().items() if "= ANY (ARRAY(" in sql)


_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _rows_json(rows: Sequence[dict[str, Any]]) -> str:
    """Parameter sets as a JSON array; NaN and infinities (no JSON numbers) as the strings
    PostgreSQL reads them from."""
    try:
        return json.dumps(rows, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(
            [{k: _finite(v) for k, v in row.items()} for row in rows], separators=(",", ":")
        )


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE[value]
    return value


class PostgresTx:
    """Runs named PostgreSQL queries on one connection."""

    fused_writes = True

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._q = _queries()
        self._setwise = _setwise()
        self._planned_each_run = _planned_each_run()

    def _exec(self, name: str, params: Any) -> Any:
        prepare = False if name in self._planned_each_run else None
        return self._conn.execute(self._q[name], params, prepare=prepare)

    def all(self, name: str, **params: Any) -> list[Row]:
        """Run a named query and return every row."""
        return list(self._exec(name, params).fetchall())

    def one(self, name: str, **params: Any) -> Row | None:
        """Run a named query and return its first row, or None."""
        row: Row | None = self._exec(name, params).fetchone()
        return row

    def run(self, name: str, **params: Any) -> int:
        """Run a named statement and return the number of rows it changed."""
        if name in self._setwise:
            return self.many(name, [params])
        return int(self._exec(name, params).rowcount)

    def many(self, name: str, rows: Sequence[dict[str, Any]]) -> int:
        """Run a named statement once per parameter set; return the total number of rows changed."""
        if not rows:
            return 0
        if name in self._setwise:
            return int(self._exec(name, {"rows": _rows_json(rows)}).rowcount)
        if len(rows) == 1:  # one row (a runner's own completion): no pipeline to set up and sync
            return int(self._exec(name, rows[0]).rowcount)
        with self._conn.cursor() as cur:
            cur.executemany(self._q[name], rows)
            return int(cur.rowcount)

    def script(self, name: str) -> None:
        """Run a named block of several statements."""
        self._conn.execute(queries.load("postgresql")[name])

    def commit_durably(self) -> None:
        """Commit this transaction synchronously, whatever ``synchronous_commit`` it began with."""
        self._conn.execute("SET LOCAL synchronous_commit TO ON")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested transaction: an exception inside undoes only what ran inside, then
        propagates."""
        with self._conn.transaction():
            yield


class PostgresBackend:
    """Runs store operations against a PostgreSQL database."""

    dialect = "postgresql"

    def __init__(self, url: str, *, min_size: int = 2, max_size: int = 8) -> None:
        try:
            import psycopg
            from psycopg.rows import dict_row
            from psycopg_pool import ConnectionPool
        except ImportError as exc:
            raise StoreUnavailable(
                "PostgreSQL support needs: pip install 'rollfleet[postgres]'"
            ) from exc
        self._psycopg = psycopg
        self.url = url
        try:
            self._pool = ConnectionPool(
                url,
                min_size=min_size,
                max_size=max_size,
                open=True,
                timeout=30,
                kwargs={"row_factory": dict_row, "autocommit": False},
            )
            self._pool.wait(timeout=30)
            for attempt in range(RETRIES):
                try:
                    with self._pool.connection() as conn:
                        if _schema_current(conn):
                            break
                        conn.execute("SELECT pg_advisory_xact_lock(7740113)")  # one migrator
                        migrate(PostgresTx(conn))
                    break
                except psycopg.errors.DeadlockDetected:  # its transaction was rolled back
                    if attempt == RETRIES - 1:
                        raise
        except psycopg.Error as exc:
            raise StoreUnavailable(f"cannot reach PostgreSQL at {url}: {exc}") from exc
        except Exception as exc:  # psycopg_pool.PoolTimeout and friends
            raise StoreUnavailable(f"cannot reach PostgreSQL at {url}: {exc}") from exc
        self._listener: asyncio.Task[None] | None = None

    async def write(
        self,
        fn: Callable[..., T],
        *args: Any,
        durable: bool = True,
        bulk: bool = False,
        committed: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn(tx, *args)`` in its own transaction, retrying serialization failures.

        A write that is not durable (claims, heartbeats, reaper passes) commits with
        ``synchronous_commit = off``: never corrupt, at worst forgotten by a server crash.
        ``bulk`` changes nothing here: every PostgreSQL write runs on a thread; ``committed`` is
        called once the transaction has committed.
        """
        result = await asyncio.to_thread(self._run, fn, args, durable)
        if committed is not None:
            committed()
        return result

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` in its own transaction."""
        return await asyncio.to_thread(self._run, fn, args, True)

    async def durable(self) -> None:
        """Nothing to wait for: a transaction committed with ``synchronous_commit`` on becomes
        visible only after its WAL is flushed, and every write that ends a rollout commits so
        (durable writes, and reaper passes that fail one: ``Tx.commit_durably``)."""

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], durable: bool) -> T:
        errors = self._psycopg.errors
        for attempt in range(RETRIES):
            try:
                with self._pool.connection() as conn, conn.transaction():
                    if not durable:
                        conn.execute("SET LOCAL synchronous_commit TO OFF")
                    return fn(PostgresTx(conn), *args)
            except (errors.SerializationFailure, errors.DeadlockDetected) as exc:
                if attempt == RETRIES - 1:
                    raise Conflict(f"concurrent update, retries exhausted: {exc}") from exc
            except errors.UniqueViolation as exc:
                raise Conflict(f"refused by the database: {exc}") from exc
            except RollfleetError:
                raise
            except self._psycopg.Error as exc:
                raise StoreUnavailable(f"postgresql: {exc}") from exc
        raise AssertionError("unreachable")

    def listen(self, store: SqlStore) -> None:
        """Wake the store's long-polls when any process queues or finishes work."""
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(store), name="rollfleet-pg-listen")

    async def _listen(self, store: SqlStore) -> None:
        while True:
            try:
                conn = await self._psycopg.AsyncConnection.connect(self.url, autocommit=True)
                async with conn:
                    await conn.execute("LISTEN rollfleet_queued")
                    await conn.execute("LISTEN rollfleet_finished")
                    store.wake()  # anything missed while not listening
                    async for note in conn.notifies():
                        store.wake(
                            queued=note.channel == "rollfleet_queued",
                            finished=note.channel == "rollfleet_finished",
                        )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnect; long-polls fall back to periodic checks meanwhile
                log.warning("postgres LISTEN connection lost (%s); reconnecting", exc)
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        """Stop listening and close the pool."""
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        await asyncio.to_thread(self._pool.close)
