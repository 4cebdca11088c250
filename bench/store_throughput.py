"""Store throughput: enqueue/s, claim+complete/s and dispatch latency, ours vs Agent Lightning 0.3.0.

In-process and over HTTP, 1 and 4 concurrent workers, on SQLite and PostgreSQL, all in one run.
Both sides get the same queue before every claim phase (SEED rollouts), so the claims of either
never run on an emptier or fuller queue. Every write of ours that acknowledges data is durable before it is answered (SQLite: the WAL is
fdatasync'ed first; PostgreSQL: synchronous_commit on); Agent Lightning's store here is its
in-memory one (what `agl store` serves), not durable. Over HTTP, the n client processes of a
figure start timing together, once all of them have imported and connected.
PostgreSQL over HTTP (4 workers batched) is also measured before and after issue 19's changes (the
`src/` of commit PG_AB_BASE, default 63c15b3, against this tree) and on 1 against 2 `rollfleet serve`
replicas of one schema, in alternating rounds, each on fresh servers and a fresh schema.
The fair cells (issue 34, :mod:`bench._store_fair`): a fresh server per measurement, 60,000 seeded,
4 client processes behind a barrier, 1 s warm-up, a 5 s window, interleaved rounds, against Agent
Lightning (both completion styles) and against the ``src/`` of commit STORE_AB_BASE (6b6bcfe).
Run: `python -m bench store_throughput` (peers: `make peers`); only the PostgreSQL rounds, keeping
the other figures: `python -m bench.store_throughput postgres`; only the fair cells:
`python -m bench.store_throughput fair` (BENCH_ROUNDS rounds, default 3).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from typing import Any
from urllib.parse import quote

from bench._common import (
    PEERS_PY,
    PY,
    ROOT,
    free_port,
    machine,
    peers_available,
    start,
    stop,
    table,
    write_results,
)
from bench._store_fair import BASE, fair

WORKER = str(ROOT / "bench" / "_store_worker.py")
SECONDS = float(os.environ.get("BENCH_SECONDS", "3"))
SEED = 30000
PG = os.environ.get("ROLLFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def worker_command(
    py: str, impl: str, url: str, op: str, *flags: str, seconds: float = SECONDS, **kw: Any
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one bench/_store_worker.py process."""
    argv = [py, WORKER, "--impl", impl, "--url", url, "--op", op, "--seconds", str(seconds), *flags]
    for k, v in kw.items():
        argv += [f"--{k}", str(v)]
    # a PYTHONPATH already set comes first: bench/refactor_ab.py points it at another tree's src/
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    return argv, {**os.environ, "PYTHONPATH": path}


def client(py: str, impl: str, url: str, op: str, **kw: Any) -> dict[str, Any]:
    argv, env = worker_command(py, impl, url, op, **kw)
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {op} failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def clients(py: str, impl: str, url: str | list[str], op: str, n: int) -> float:
    """Run n client processes at once; ops/s over the slowest one's time.

    Each process imports and connects first, then all start timing together (a barrier): Agent
    Lightning's client takes seconds to import, and staggered windows would not be n at once.
    Given several URLs (replicas), client k talks to URL k mod their number.
    """
    results = run_clients(py, impl, url, op, n)
    return sum(r["ops"] for r in results) / max(r["seconds"] for r in results)


def run_clients(
    py: str, impl: str, url: str | list[str], op: str, n: int, *flags: str, **kw: Any
) -> list[dict[str, Any]]:
    """Run n client processes behind a start barrier; each one's JSON answer."""
    urls = [url] if isinstance(url, str) else url
    commands = [
        worker_command(py, impl, urls[k % len(urls)], op, "--barrier", *flags, **kw)
        for k in range(n)
    ]
    procs = [
        subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for argv, env in commands
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdin is not None
            for line in proc.stdout:  # a peer's import may print first
                if line.strip() == "ready":
                    break
            else:
                raise RuntimeError(
                    f"{impl} {op} client failed to start: {proc.communicate()[1][-2000:]}"
                )
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        with ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(lambda proc: proc.communicate(timeout=600), procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_out, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"{impl} {op} failed: {err[-2000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _err in outs]


def inproc(py: str, impl: str, url: str, op: str, n: int) -> float:
    r = client(py, impl, url, op, inproc=n, n=SEED)
    return float(r["ops"] / r["seconds"])


_SCHEMAS: list[str] = []  # made by this run; dropped when it exits


def pg_schema_url() -> str | None:
    """A URL on a fresh PostgreSQL schema (dropped at exit), or None without PostgreSQL."""
    try:
        import psycopg

        schema = f"bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        _SCHEMAS.append(schema)
        return f"{PG}?options={quote(f'-c search_path={schema}')}"
    except Exception:
        return None


@atexit.register
def _drop_schemas() -> None:
    """Leave nothing behind in the database: every schema this run made goes."""
    if not _SCHEMAS:
        return
    import psycopg

    with psycopg.connect(PG, autocommit=True, connect_timeout=3) as conn:
        for schema in _SCHEMAS:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def ours_server(db_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start `rollfleet serve` on a database; return the process and its URL."""
    port = free_port()
    proc = start(
        [PY, "-m", "rollfleet.cli", "serve", "--db", db_url, "--port", str(port)],
        f"http://127.0.0.1:{port}/health",
    )
    return proc, f"http://127.0.0.1:{port}"


def agl_server() -> tuple[subprocess.Popen[bytes], str]:
    """Start Agent Lightning's `agl store`; return the process and its URL."""
    port = free_port()
    proc = start(
        [
            str(ROOT / ".venv-peers" / "bin" / "agl"),
            "store",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
        f"http://127.0.0.1:{port}/v1/agl/health",
    )
    return proc, f"http://127.0.0.1:{port}"


def ours_backend(name: str, make_url: Any) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for workers in (1, 4):
        row[f"inproc_enqueue_{workers}"] = inproc(PY, "ours", make_url(), "enqueue", workers)
        row[f"inproc_claim_complete_{workers}"] = inproc(PY, "ours", make_url(), "claim", workers)
        row[f"inproc_claim_complete_batched_{workers}"] = inproc(
            PY, "ours", make_url(), "claim_batch", workers
        )
    server, url = ours_server(make_url())
    try:
        if (
            name == "sqlite"
        ):  # first, while the queue is empty: an idle worker must get the new task
            row["dispatch_latency"] = client(PY, "ours", url, "latency", n=50)
        for workers in (1, 4):
            row[f"http_enqueue_{workers}"] = clients(PY, "ours", url, "enqueue", workers)
        for workers in (1, 4):
            client(PY, "ours", url, "seed", n=SEED)
            row[f"http_claim_complete_{workers}"] = clients(PY, "ours", url, "claim", workers)
            client(PY, "ours", url, "seed", n=SEED)
            row[f"http_claim_complete_batched_{workers}"] = clients(
                PY, "ours", url, "claim_batch", workers
            )
    finally:
        stop(server)
    return row


def agl() -> dict[str, Any]:
    py = str(PEERS_PY)
    row: dict[str, Any] = {}
    for workers in (1, 4):
        row[f"inproc_enqueue_{workers}"] = inproc(py, "agl", "memory", "enqueue", workers)
        row[f"inproc_claim_complete_{workers}"] = inproc(py, "agl", "memory", "claim", workers)
        row[f"inproc_claim_complete_batched_{workers}"] = inproc(
            py, "agl", "memory", "claim_batch", workers
        )
    server, url = agl_server()
    try:
        row["dispatch_latency"] = client(py, "agl", url, "latency", n=6)  # first, on an empty queue
        for workers in (1, 4):
            row[f"http_enqueue_{workers}"] = clients(py, "agl", url, "enqueue", workers)
        for workers in (1, 4):
            client(py, "agl", url, "seed", n=SEED)
            row[f"http_claim_complete_{workers}"] = clients(py, "agl", url, "claim", workers)
            client(py, "agl", url, "seed", n=SEED)
            row[f"http_claim_complete_batched_{workers}"] = clients(
                py, "agl", url, "claim_batch", workers
            )
    finally:
        stop(server)
    return row


ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


PG_BASE = os.environ.get("PG_AB_BASE", "63c15b3")  # the commit before issue 19's PostgreSQL changes


def spread(xs: list[float]) -> dict[str, Any]:
    """Rounds, their median and range."""
    return {"rounds": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


@contextlib.contextmanager
def on_src(src: str | None) -> Iterator[None]:
    """Servers and clients started inside import rollfleet from ``src`` (None: this tree)."""
    saved = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def src_of(rev: str) -> str:
    """The ``src/`` of commit ``rev``, extracted into a temporary directory."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    tmp = tempfile.mkdtemp(prefix="rollfleet-pg-base-")
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(tmp, filter="data")
    return f"{tmp}/src"


def pg_round(replicas: int, src: str | None = None, used: bool = False) -> float:
    """claim+complete/s over HTTP, 4 client processes batching 16, on ``replicas`` fresh servers
    sharing one fresh PostgreSQL schema (client k talks to replica k mod ``replicas``). ``used``:
    the same servers have first seeded and served one untimed phase like it."""
    db = pg_schema_url()
    assert db is not None
    with on_src(src):
        servers = [ours_server(db) for _ in range(replicas)]
        urls = [url for _, url in servers]
        try:
            for _ in range(2 if used else 1):
                client(PY, "ours", urls[0], "seed", n=SEED)
                rate = clients(PY, "ours", urls, "claim_batch", 4)
            return rate
        finally:
            for proc, _ in servers:
                stop(proc)


def postgres_rounds() -> dict[str, Any]:
    """PostgreSQL over HTTP, 4 workers batched: before (``PG_BASE``) and after, 1 and 2 replicas, and
    before and after on servers that have already served one such phase (``_used``), in alternating
    rounds on the same machine state, a fresh schema and servers each round."""
    base = src_of(PG_BASE)
    sides: dict[str, tuple[int, str | None, bool]] = {
        "before": (1, base, False),
        "after": (1, None, False),
        "after_2_replicas": (2, None, False),
        "before_used": (1, base, True),
        "after_used": (1, None, True),
    }
    rounds: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(ROUNDS):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for k in order:
            rounds[k].append(pg_round(*sides[k]))
            print(f"postgres round {r + 1}/{ROUNDS} {k}: {rounds[k][-1]:,.0f}/s", flush=True)
    out: dict[str, Any] = {
        "workload": "http_claim_complete_batched_4",
        "before_commit": PG_BASE,
        **{k: spread(v) for k, v in rounds.items()},
    }
    out["after_vs_before"] = out["after"]["median"] / out["before"]["median"]
    out["replicas_2_vs_1"] = out["after_2_replicas"]["median"] / out["after"]["median"]
    out["used_after_vs_before"] = out["after_used"]["median"] / out["before_used"]["median"]
    table(
        "PostgreSQL over HTTP, 4 workers batched (16), alternating rounds",
        ["", "rounds", "median"],
        [[k, ", ".join(f"{x:,.0f}" for x in rounds[k]), out[k]["median"]] for k in sides],
    )
    return out


def main_postgres() -> dict[str, Any]:
    """Only the PostgreSQL rounds; the other figures of bench/results/store_throughput.json stay."""
    path = ROOT / "bench" / "results" / "store_throughput.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.pop("benchmark", None)
    command = results.pop("command", "python -m bench store_throughput")
    results["postgres"] = {
        **postgres_rounds(),
        "command": "python -m bench.store_throughput postgres",
        "machine": machine(),
    }
    return write_results(
        "store_throughput", results, command
    )  # the older figures keep their machine


def main_fair() -> dict[str, Any]:
    """Only the fair cells (:mod:`bench._store_fair`); the other figures of the results stay."""
    path = ROOT / "bench" / "results" / "store_throughput.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.pop("benchmark", None)
    command = results.pop("command", "python -m bench store_throughput")
    results.pop("headline", None)  # the older, unfair cell: replaced by "fair"
    results["fair"] = {
        **fair(ROUNDS, src_of(BASE)),
        "command": "python -m bench.store_throughput fair",
        "machine": machine(),
    }
    return write_results("store_throughput", results, command)


def main() -> dict[str, Any]:
    """Measure everything side by side and write bench/results/store_throughput.json."""
    tmp = tempfile.mkdtemp(prefix="rollfleet-bench-")
    results: dict[str, Any] = {
        "ours_sqlite": ours_backend("sqlite", lambda: f"sqlite:///{tmp}/{uuid.uuid4().hex}.db")
    }
    if pg_schema_url() is not None:
        results["ours_postgres"] = ours_backend("postgres", pg_schema_url)
        results["postgres"] = {**postgres_rounds(), "command": "python -m bench store_throughput"}
    else:
        results["ours_postgres"] = "PostgreSQL not reachable at " + PG
    results["agentlightning_0_3_0"] = (
        agl() if peers_available("agentlightning") else "not installed (make peers)"
    )
    if isinstance(results["agentlightning_0_3_0"], dict):
        results["fair"] = fair(ROUNDS, src_of(BASE))
    keys = [k for k in results["ours_sqlite"] if k != "dispatch_latency"]
    rows = []
    for k in keys:
        theirs = results["agentlightning_0_3_0"]
        peer = theirs.get(k) if isinstance(theirs, dict) else None
        pg = results["ours_postgres"].get(k) if isinstance(results["ours_postgres"], dict) else None
        ratio = results["ours_sqlite"][k] / peer if peer else None
        rows.append(
            [
                k,
                results["ours_sqlite"][k],
                pg or "-",
                peer or "-",
                f"{ratio:.1f}×" if ratio else "-",
            ]
        )
    table(
        "store ops/s (higher is better)",
        ["workload", "ours SQLite", "ours PostgreSQL", "AGL 0.3.0 memory", "SQLite / AGL"],
        rows,
    )
    if isinstance(results["agentlightning_0_3_0"], dict):
        peer = results["agentlightning_0_3_0"]
        results["ratios"] = {k: results["ours_sqlite"][k] / peer[k] for k in keys if peer.get(k)}
        if isinstance(results["ours_postgres"], dict):
            results["ratios_postgres"] = {
                k: results["ours_postgres"][k] / peer[k] for k in keys if peer.get(k)
            }
    return write_results("store_throughput", results, "python -m bench store_throughput")


if __name__ == "__main__":
    {"postgres": main_postgres, "fair": main_fair}.get(" ".join(sys.argv[1:]), main)()
