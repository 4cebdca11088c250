"""A simulated fleet of 100 to 10,000 runners against 1 and 2 ``rollfleet serve`` replicas.

The runners are ``bench/_fleet_client.py`` processes (5,000 runners each): every runner holds its
own connection, long-polls claims, sleeps 0.5–2 s as its agent and completes, claiming its next
rollout in the same request and backing off after a failed claim as ``Runner`` does
(``FLEET_HANDOVER=0``: a claim and a completion apart, as runners sent them before; claims/s
counts the claims sent apart). On the 2-replica side each runner is given both URLs, half of
them starting at the other replica (as ``tests/acceptance/test_replicas.py`` spreads runners).
Servers run with their default connection limit (``--max-connections``, from the open-file
limit, which the bench raises to the hard limit) on one fresh PostgreSQL schema per point.

Work never runs out because of the bench: before the runners start, the queue is filled with
``max(5,000, 3 × runners)`` rollouts, written straight into PostgreSQL (not through the servers,
so their CPU is only the runners' traffic), and topped up in batches of 5,000. A claim that comes
back empty is counted (``empty``).

Figures, over a fixed window (``BENCH_FLEET_SECONDS``, 20 s) after the runners connected and
warmed up for 5 s, or as long as serving every runner's first claim takes (``warmup_s``: 25 s
for 10,000 runners): claim latency (request sent → rollout in hand, work waiting; p50 / p99),
claims/s and completions/s by the client's clock; server CPU (user+sys s/s of the replicas,
1.0 = a core), PostgreSQL CPU (the backends serving them, found by client port), machine CPU;
CPU ms a rollout (server or PostgreSQL CPU / completions: what docs/scale.md sizes a fleet with);
the replicas' RSS; errors by kind (a 503 over the connection limit, a reset, a timeout), never
retried silently; and the 503s the servers logged.

Sides alternate per point (1 replica, 2 replicas, per runner count, per round: A B A B); each
figure is the median over ``BENCH_ROUNDS`` (2) rounds with [min–max]. Run:
``python -m bench fleet`` (100, 300, 1,000, 3,000, 10,000 runners) or ``python -m bench fleet
3000,10000`` for chosen points, merged into bench/results/fleet.json (the points measured before
and replaced are kept under ``before``). Two A/B runs at one count go into the same file:
bench/fleet_ab.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil

from bench._common import PY, RESULTS, ROOT, free_port, stop, table, wait_healthy, write_results
from bench._fleet_client import AGENT_S, CLAIM_WAIT_S, HANDOVER
from rollfleet.web.serving import raise_fd_limit

PG = os.environ.get("ROLLFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
SECONDS = float(os.environ.get("BENCH_FLEET_SECONDS", "20"))
WARMUP = 5.0  # seconds, at least; a larger fleet warms up until its first claims were served
FIRST_CLAIMS_PER_S = 400  # how fast a replica here serves a fleet's first claims (a low bound)
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
COUNTS = os.environ.get("BENCH_FLEET_COUNTS", "100,300,1000,3000,10000")
RUNNERS_PER_CLIENT = 5000
TOPUP = 5000
REFUSED = re.compile(r"Exceeded concurrency limit\.(?: \((\d+) more refused)?")
LIMIT = re.compile(r"up to (\d+) connections")


# --- the parent: schema, servers, queue, sampling ---------------------------------------------


def new_schema() -> tuple[str, str]:
    """A fresh schema and a URL whose search_path is it."""
    import psycopg

    schema = f"fleet_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG else "?"
    return schema, f"{PG}{sep}options={quote(f'-c search_path={schema}')}"


def drop_schema(schema: str) -> None:
    """Drop a bench schema."""
    import psycopg

    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def start_replicas(
    db_url: str, n: int, logdir: Path
) -> tuple[list[subprocess.Popen[bytes]], list[str], list[Path]]:
    """Start n ``rollfleet serve`` replicas on one database; their processes, URLs and logs."""
    procs, urls, logs = [], [], []
    for i in range(n):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = logdir / f"replica-{i}-{port}.log"
        argv = [PY, "-m", "rollfleet.cli", "serve", "--db", db_url, "--port", str(port)]
        with log.open("wb") as err:  # kept: the 503s over the connection limit are counted in it
            proc = subprocess.Popen(
                [*argv, "--advertise-url", url], stdout=subprocess.DEVNULL, stderr=err
            )
        procs.append(proc)
        urls.append(url)
        logs.append(log)
    for proc, url in zip(procs, urls, strict=True):
        wait_healthy(f"{url}/health", proc)
    return procs, urls, logs


class Feeder:
    """Keeps the queue at ``target`` rollouts or more, enqueuing straight into PostgreSQL."""

    def __init__(self, db_url: str, target: int) -> None:
        self.db_url, self.target = db_url, target
        self.enqueued = 0

    async def fill(self, store: Any) -> None:
        """Enqueue in batches until ``target`` rollouts are queued."""
        from rollfleet.model import RolloutSpec

        queued = await asyncio.to_thread(self.queued)
        while queued < self.target:
            batch = TOPUP
            await store.enqueue_many(
                [RolloutSpec(input={"i": self.enqueued + k}) for k in range(batch)]
            )
            self.enqueued += batch
            queued += batch

    def queued(self) -> int:
        """Rollouts queued now."""
        import psycopg

        with psycopg.connect(self.db_url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM rollouts WHERE status = 'queuing'").fetchone()
        return int(row[0]) if row else 0

    async def run(self, store: Any, until: float) -> None:
        """Top the queue up every half second until ``until``."""
        while time.time() < until:
            await self.fill(store)
            await asyncio.sleep(0.5)


def pg_backends(servers: list[subprocess.Popen[bytes]]) -> list[int]:
    """The PostgreSQL backend pids serving these server processes (matched by client port)."""
    import psycopg

    ports = set()
    for proc in servers:
        for c in psutil.Process(proc.pid).net_connections(kind="tcp"):
            if c.raddr and c.raddr.port == 5432:
                ports.add(c.laddr.port)
    with psycopg.connect(PG, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, client_port FROM pg_stat_activity WHERE client_port IS NOT NULL"
        ).fetchall()
    return [int(pid) for pid, port in rows if port in ports]


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """user+sys CPU seconds of each live pid."""
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two samples (a pid born in between counts whole)."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs (nearest rank), or None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def launch_clients(runners: int, urls: list[str]) -> list[subprocess.Popen[str]]:
    """Start the client processes and wait until each has imported."""
    procs, offset = [], 0
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p),
    }
    while offset < runners:
        n = min(RUNNERS_PER_CLIENT, runners - offset)
        procs.append(
            subprocess.Popen(
                [PY, "-m", "bench._fleet_client", str(n), str(offset), ",".join(urls)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
        offset += n
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"fleet client failed to start ({proc.poll()})")
    return procs


def warmup_s(runners: int) -> float:
    """Seconds from the fleet's start to its window: :data:`WARMUP`, or longer for a fleet whose
    every runner's first claim takes longer to serve (10,000 runners: 25 s). A window inside
    that start-up wave counts claims whose completions fall after it, so its CPU per completed
    rollout is too high (at 10,000 runners it read 3.7-5.7 ms where 1,000 read 2.0-2.4)."""
    return max(WARMUP, runners / FIRST_CLAIMS_PER_S)


async def measure(runners: int, replicas: int, logdir: Path) -> dict[str, Any]:
    """One point: fresh schema, servers, a full queue, the fleet, then the window's figures."""
    import rollfleet

    schema, db_url = new_schema()
    servers: list[subprocess.Popen[bytes]] = []
    clients: list[subprocess.Popen[str]] = []
    store = rollfleet.connect(db_url)
    try:
        servers, urls, logs = start_replicas(db_url, replicas, logdir)
        feeder = Feeder(db_url, max(5000, 3 * runners))
        await feeder.fill(store)
        clients = launch_clients(runners, urls)
        ramp = max(0.5, min(runners, RUNNERS_PER_CLIENT) / 2000)
        start = time.time() + ramp + warmup_s(runners)
        end = start + SECONDS
        for proc in clients:
            assert proc.stdin is not None
            proc.stdin.write(f"{start} {end}\n")
            proc.stdin.flush()
        feeding = asyncio.create_task(feeder.run(store, end + 5))
        await asyncio.sleep(start - time.time())
        backends = pg_backends(servers)
        spids, cpids = [p.pid for p in servers], [p.pid for p in clients]
        before = (
            cpu_seconds(spids),
            cpu_seconds(backends),
            cpu_seconds(cpids),
            machine_busy(),
            time.time(),
        )
        enq0 = feeder.enqueued
        await asyncio.sleep(max(0.0, end - time.time()))
        backends = sorted(set(backends) | set(pg_backends(servers)))
        after = (
            cpu_seconds(spids),
            cpu_seconds(backends),
            cpu_seconds(cpids),
            machine_busy(),
            time.time(),
        )
        rss = sum(psutil.Process(pid).memory_info().rss for pid in spids) / 2**20
        client_rss = sum(psutil.Process(pid).memory_info().rss for pid in cpids) / 2**20
        enqueued = feeder.enqueued - enq0
        outs = [
            json.loads(out.strip().splitlines()[-1])
            for out, _ in (p.communicate(timeout=120) for p in clients)
        ]
        feeding.cancel()
        dt = after[4] - before[4]
        claim_ms = [x for o in outs for x in o["claim_ms"]]
        complete_ms = [x for o in outs for x in o["complete_ms"]]
        errors: dict[str, int] = {}
        for o in outs:
            for k, v in o["errors"].items():
                errors[k] = errors.get(k, 0) + v
        done = sum(o["completions"] for o in outs) / dt
        server_cpu, pg_cpu = (
            cpu_delta(before[0], after[0]) / dt,
            cpu_delta(before[1], after[1]) / dt,
        )
        texts = [log.read_text(errors="replace") for log in logs]
        over = sum(1 + int(m.group(1) or 0) for t in texts for m in REFUSED.finditer(t))
        limits = [int(m.group(1)) for t in texts for m in LIMIT.finditer(t)]
        return {
            "runners": runners,
            "replicas": replicas,
            "seconds": round(dt, 2),
            "warmup_s": warmup_s(runners),
            "claims_per_s": len(claim_ms) / dt,
            "completions_per_s": done,
            "claim_p50_ms": quantile(claim_ms, 0.5),
            "claim_p99_ms": quantile(claim_ms, 0.99),
            "complete_p50_ms": quantile(complete_ms, 0.5),
            "complete_p99_ms": quantile(complete_ms, 0.99),
            "server_cpu": server_cpu,
            "postgres_cpu": pg_cpu,
            "server_ms_per_rollout": 1000 * server_cpu / done if done else None,
            "postgres_ms_per_rollout": 1000 * pg_cpu / done if done else None,
            "client_cpu": cpu_delta(before[2], after[2]) / dt,
            "machine_cpu": (after[3] - before[3]) / dt,
            "server_rss_mib": rss,
            "client_rss_mib": client_rss,
            "enqueued_in_window": enqueued,
            "empty_claims": sum(o["empty"] for o in outs),
            "refused_completions": sum(o["refused"] for o in outs),
            "errors": errors,
            "error_count": sum(errors.values()),
            "over_limit_503_logged": over,
            "max_connections": limits[0] if limits else None,
        }
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in servers:
            stop(server)
        await store.close()
        drop_schema(schema)


FIGURES = [
    "claims_per_s",
    "completions_per_s",
    "claim_p50_ms",
    "claim_p99_ms",
    "complete_p50_ms",
    "complete_p99_ms",
    "server_cpu",
    "postgres_cpu",
    "server_ms_per_rollout",
    "postgres_ms_per_rollout",
    "client_cpu",
    "machine_cpu",
    "server_rss_mib",
    "error_count",
    "empty_claims",
]


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and [min, max] of each figure over the rounds of one (runners, replicas) point."""
    out: dict[str, Any] = {}
    for key in FIGURES:
        xs = [p[key] for p in points if p[key] is not None]
        out[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None
    return out


def fmt(fig: dict[str, float] | None, digits: int = 0) -> str:
    """``median [min–max]``."""
    if fig is None:
        return "-"
    return f"{fig['median']:,.{digits}f} [{fig['min']:,.{digits}f}–{fig['max']:,.{digits}f}]"


async def run_all(counts: list[int], logdir: Path) -> list[dict[str, Any]]:
    """Every point, sides alternating per runner count, for ROUNDS rounds."""
    raw = []
    for rnd in range(ROUNDS):
        for runners in counts:
            for replicas in (1, 2):
                print(f"round {rnd + 1}/{ROUNDS}: {runners} runners, {replicas} replica(s)")
                sys.stdout.flush()
                point = await measure(runners, replicas, logdir)
                point["round"] = rnd + 1
                print(json.dumps({k: v for k, v in point.items() if k != "errors"}), flush=True)
                raw.append(point)
    return raw


def point_of(raw: list[dict[str, Any]], runners: int, replicas: int) -> dict[str, Any]:
    """The medians [min–max] of one (runners, replicas) point over its rounds, errors summed."""
    mine = [p for p in raw if p["runners"] == runners and p["replicas"] == replicas]
    errors: dict[str, int] = {}
    for p in mine:
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
    limits = {p.get("max_connections") for p in mine}
    return {
        "runners": runners,
        "replicas": replicas,
        "rounds": len(mine),
        "complete_and_claim": HANDOVER,
        "warmup_s": warmup_s(runners),
        **summarise(mine),
        "max_connections": limits.pop() if len(limits) == 1 else sorted(limits, key=str),
        "over_limit_503_logged": sum(p["over_limit_503_logged"] for p in mine),
        "errors_all_rounds": errors,
    }


def merged(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``new``'s points and raw rounds over ``old``'s: same points replaced (kept in ``before``);
    what other commands keep in the file (``connection_memory``, bench/fleet_ab.py's runs) stays."""
    mine = {(p["runners"], p["replicas"]) for p in new["points"]}
    key = lambda p: (p["runners"], p["replicas"])  # noqa: E731
    replaced = [p for p in old.get("points", []) if key(p) in mine]
    run = {k: old.get(k) for k in ("command", "wall_s", "machine", "seconds_per_point", "rounds")}
    before = [*old.get("before", []), {"run": run, "points": replaced}] if replaced else []
    kept = {k: v for k, v in old.items() if k not in ("benchmark", "command", "machine")}
    return {
        **kept,  # write_results names this run's command and machine
        **new,
        "points": sorted(
            [*(p for p in old.get("points", []) if key(p) not in mine), *new["points"]], key=key
        ),
        "raw": [*(p for p in old.get("raw", []) if key(p) not in mine), *new["raw"]],
        "before": before or old.get("before", []),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure the chosen points (``3000,10000``, or every count) and merge them into
    bench/results/fleet.json."""
    chosen = [a for a in (sys.argv[1:] if argv is None else argv) if re.fullmatch(r"[\d,]+", a)]
    counts = [int(x) for x in (chosen[0] if chosen else COUNTS).split(",")]
    fd_limit = raise_fd_limit()[1]
    began = time.time()
    logdir = Path(tempfile.mkdtemp(prefix="rollfleet-fleet-"))
    raw = asyncio.run(run_all(counts, logdir))
    points = [point_of(raw, runners, replicas) for runners in counts for replicas in (1, 2)]
    columns = [
        "runners",
        "replicas",
        "claims/s",
        "completions/s",
        "claim p50 ms",
        "claim p99 ms",
        "server CPU",
        "PG CPU",
        "RSS MiB",
        "errors",
    ]
    figures = [
        ("claims_per_s", 0),
        ("completions_per_s", 0),
        ("claim_p50_ms", 1),
        ("claim_p99_ms", 1),
        ("server_cpu", 2),
        ("postgres_cpu", 2),
        ("server_rss_mib", 0),
        ("error_count", 0),
    ]
    rows = [[p["runners"], p["replicas"], *(fmt(p[k], d) for k, d in figures)] for p in points]
    table("fleet: medians [min–max] over rounds", columns, rows)
    command = "python -m bench fleet" + (f" {chosen[0]}" if chosen else "")
    new = {
        "seconds_per_point": SECONDS,
        "warmup_s": WARMUP,
        "rounds": ROUNDS,
        "agent_s": list(AGENT_S),
        "claim_wait_s": CLAIM_WAIT_S,
        "complete_and_claim": HANDOVER,  # runners claim their next rollout with each completion
        "fd_limit": fd_limit,
        "counts": counts,
        "wall_s": round(time.time() - began, 1),
        "points": points,
        "raw": raw,
    }
    path = RESULTS / "fleet.json"
    old = json.loads(path.read_text()) if chosen and path.exists() else {}
    return write_results("fleet", merged(new, old), command)


if __name__ == "__main__":
    main()
