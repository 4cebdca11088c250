"""A simulated fleet of 100 to 10,000 runners against 1 and 2 ``rollfleet serve`` replicas.

Each simulated runner is an asyncio task holding its own ``HttpStore`` (so its own keep-alive
connection, kept open across its agent time): it long-polls ``POST /claims`` (``wait_s`` 2, one
rollout, as ``Runner`` does), "runs the agent" by sleeping uniform 0.5–2 s, and sends its result
with ``POST /attempts/complete`` (``complete_many``, one item, as ``Runner`` batches them). All
runners of a point live in one client process (two at 10,000). On the 2-replica side each
runner is given both URLs, half of them starting at the other replica (``tests/acceptance/
test_replicas.py`` spreads runners the same way). Servers run on one fresh PostgreSQL schema per
point, dropped afterwards.

Work never runs out because of the bench: before the runners start, the queue is filled with
``max(5,000, 3 × runners)`` rollouts, written straight into PostgreSQL by this process (not
through the servers, so their CPU is only the runners' traffic), and topped up in batches of
5,000 whenever it falls below that. A claim that comes back empty is counted (``empty``).

Figures, taken over a fixed window (``BENCH_FLEET_SECONDS``, 20 s) after the runners connected
and warmed up for 5 s:

- **claim latency**: the claim's round trip, request sent → rollout in hand, with work waiting in
  the queue. (With an idle fleet this would be dispatch latency; ``store_throughput`` measures that:
  p50 3.3 ms.) p50 / p99 of every claim that returned in the window.
- **claims/s, completions/s**: answered in the window, by the client's clock.
- **server CPU**: user+sys seconds per second of the replicas together (psutil), 1.0 = a core;
  **PostgreSQL CPU** the same for the backends serving those replicas (found by their client
  ports); **machine CPU** busy cores of the whole machine.
- **CPU ms a rollout**: server (and PostgreSQL) CPU divided by completions: what one rollout's
  claim + completion costs, the figure docs/scale.md sizes a fleet with.
- **RSS**: the replicas' resident memory at the window's end, summed.
- **errors**: every failed call by kind (a 503 over ``limit_concurrency``, a reset, a timeout),
  never retried silently; the failed runner waits 0.5 s as ``Runner`` does.

Sides alternate per point (1 replica, 2 replicas, per runner count, per round: A B A B); each
figure is the median over ``BENCH_ROUNDS`` (2) rounds with [min–max].
Runner counts: 100, 300, 1,000, 3,000, 10,000 (300 and 3,000 locate the knee and the servers'
2,048-connection limit). Run: ``python -m bench fleet`` (``BENCH_FLEET_COUNTS=100,1000`` for fewer
points).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
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

from bench._common import PY, ROOT, free_port, stop, table, wait_healthy, write_results

PG = os.environ.get("ROLLFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
SECONDS = float(os.environ.get("BENCH_FLEET_SECONDS", "20"))
WARMUP = 5.0
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
COUNTS = [
    int(x) for x in os.environ.get("BENCH_FLEET_COUNTS", "100,300,1000,3000,10000").split(",")
]
RUNNERS_PER_CLIENT = 5000
CLAIM_WAIT_S = 2.0
AGENT_S = (0.5, 2.0)
TOPUP = 5000


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- the client process: N simulated runners --------------------------------------------------


class Tally:
    """What one client process saw inside the window."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.claim_ms: list[float] = []
        self.complete_ms: list[float] = []
        self.completions = 0
        self.empty = 0
        self.refused = 0  # completions answered with an error (a lapsed lease)
        self.errors: dict[str, int] = {}

    def inside(self, t: float) -> bool:
        """Whether wall time ``t`` falls in the window."""
        return self.start <= t < self.end

    def error(self, exc: BaseException, what: str) -> None:
        """Count a failed call by kind."""
        if self.inside(time.time()):
            key = f"{what}: {type(exc).__name__} {str(exc)[:60]}"
            self.errors[key] = self.errors.get(key, 0) + 1


async def one_runner(index: int, urls: list[str], tally: Tally) -> None:
    """Claim, sleep the agent's time, complete; forever (cancelled at the end)."""
    from rollfleet.client import HttpStore
    from rollfleet.model import AttemptStatus, Completion, RolloutResult

    order = urls[index % len(urls) :] + urls[: index % len(urls)]
    store = HttpStore(order)
    worker = f"sim-{os.getpid()}-{index}"
    rng = random.Random(index)
    while True:
        t0 = time.time()
        try:
            docs = await store.claim_documents(worker, CLAIM_WAIT_S, 1)
        except Exception as exc:
            tally.error(exc, "claim")
            await asyncio.sleep(0.5)
            continue
        t1 = time.time()
        if not docs:
            tally.empty += tally.inside(t1)
            continue
        if tally.inside(t1):
            tally.claim_ms.append((t1 - t0) * 1000)
        await asyncio.sleep(rng.uniform(*AGENT_S))
        done = Completion(
            attempt_id=docs[0]["attempt"]["attempt_id"],
            status=AttemptStatus.SUCCEEDED,
            result=RolloutResult(reward=1.0),
        )
        t2 = time.time()
        try:
            outcome = (await store.complete_many([done]))[0]
        except Exception as exc:
            tally.error(exc, "complete")
            continue
        t3 = time.time()
        if tally.inside(t3):
            tally.completions += 1
            tally.complete_ms.append((t3 - t2) * 1000)
            tally.refused += outcome.error_type is not None


async def client_main(n: int, offset: int, urls: list[str]) -> None:
    """Start n runners over ``RAMP`` seconds, wait for the window from stdin, print the tally."""
    raise_fd_limit()
    print("ready", flush=True)
    start, end = (float(x) for x in (await asyncio.to_thread(sys.stdin.readline)).split())
    tally = Tally(start, end)
    ramp = max(0.5, n / 2000)
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one_runner(offset + i, urls, tally)))
        if i % 100 == 99:
            await asyncio.sleep(ramp / (n / 100))
    await asyncio.sleep(max(0.0, end - time.time()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(
        json.dumps(
            {
                "claim_ms": tally.claim_ms,
                "complete_ms": tally.complete_ms,
                "completions": tally.completions,
                "empty": tally.empty,
                "refused": tally.refused,
                "errors": tally.errors,
            }
        ),
        flush=True,
    )


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
                [PY, "-m", "bench.fleet", "client", str(n), str(offset), ",".join(urls)],
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
        start = time.time() + ramp + WARMUP
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
        over = sum(
            log.read_text(errors="replace").count("Exceeded concurrency limit") for log in logs
        )
        return {
            "runners": runners,
            "replicas": replicas,
            "seconds": round(dt, 2),
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


async def run_all(logdir: Path) -> list[dict[str, Any]]:
    """Every point, sides alternating per runner count, for ROUNDS rounds."""
    raw = []
    for rnd in range(ROUNDS):
        for runners in COUNTS:
            for replicas in (1, 2):
                print(
                    f"round {rnd + 1}/{ROUNDS}: {runners} runners, {replicas} replica(s)",
                    flush=True,
                )
                point = await measure(runners, replicas, logdir)
                point["round"] = rnd + 1
                print(
                    json.dumps({k: v for k, v in point.items() if k != "errors"}),
                    point["errors"],
                    flush=True,
                )
                raw.append(point)
    return raw


def main() -> dict[str, Any]:
    """Measure every point and write bench/results/fleet.json."""
    fd_limit = raise_fd_limit()
    began = time.time()
    logdir = Path(tempfile.mkdtemp(prefix="rollfleet-fleet-"))
    raw = asyncio.run(run_all(logdir))
    points = []
    for runners in COUNTS:
        for replicas in (1, 2):
            mine = [p for p in raw if p["runners"] == runners and p["replicas"] == replicas]
            errors: dict[str, int] = {}
            for p in mine:
                for k, v in p["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            points.append(
                {
                    "runners": runners,
                    "replicas": replicas,
                    "rounds": len(mine),
                    **summarise(mine),
                    "errors_all_rounds": errors,
                }
            )
    table(
        "fleet: medians [min–max] over rounds",
        [
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
        ],
        [
            [
                p["runners"],
                p["replicas"],
                fmt(p["claims_per_s"]),
                fmt(p["completions_per_s"]),
                fmt(p["claim_p50_ms"], 1),
                fmt(p["claim_p99_ms"], 1),
                fmt(p["server_cpu"], 2),
                fmt(p["postgres_cpu"], 2),
                fmt(p["server_rss_mib"]),
                fmt(p["error_count"]),
            ]
            for p in points
        ],
    )
    return write_results(
        "fleet",
        {
            "seconds_per_point": SECONDS,
            "warmup_s": WARMUP,
            "rounds": ROUNDS,
            "agent_s": list(AGENT_S),
            "claim_wait_s": CLAIM_WAIT_S,
            "fd_limit": fd_limit,
            "wall_s": round(time.time() - began, 1),
            "points": points,
            "raw": raw,
        },
        "python -m bench fleet",
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        asyncio.run(client_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")))
    else:
        main()
