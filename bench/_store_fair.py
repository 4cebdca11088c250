"""The store's fair cells (issue 34): rollfleet against Agent Lightning 0.3.0 and against an older
rollfleet, on equal terms.

Every measurement starts a fresh server (SQLite, durable, for rollfleet; ``agl store``, in memory,
for Agent Lightning), seeds it with ``FAIR_SEED`` rollouts (not for enqueue), starts 4 client
processes that import and connect first and then start together (a barrier), runs 1 s of warm-up
and counts the completions (or enqueues) that finish in the next 5 s. The cells' sides run in
interleaved rounds, the order reversed every other round; medians and [min–max] over the rounds.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import uuid
from typing import Any

from bench._common import PEERS_PY, PY, stop, table

FAIR_SEED = 60_000
FAIR_WORKERS = 4
WARMUP_S = float(os.environ.get("BENCH_WARMUP", "1"))
WINDOW_S = float(os.environ.get("BENCH_WINDOW", "5"))
BASE = os.environ.get("STORE_AB_BASE", "6b6bcfe")  # the commit issue 34 measured against

# side -> (impl, which code: "today" | "base" | "peer"); each cell's sides -> the worker's op
SIDES: dict[str, tuple[str, str]] = {
    "rollfleet": ("ours", "today"),
    "rollfleet_handover": ("ours", "today"),
    "rollfleet_base": ("ours", "base"),
    "agl": ("agl", "peer"),
    "agl_sequential": ("agl", "peer"),
}
CELLS: dict[str, dict[str, str]] = {
    "batched_16": {
        "rollfleet": "claim_batch",
        "rollfleet_handover": "handover_batch",
        "rollfleet_base": "claim_batch",
        "agl": "claim_batch",  # dequeue_many_rollouts(16), then 16 update_attempt at once
        "agl_sequential": "claim_batch_seq",  # … then 16 update_attempt one after another
    },
    "one_per_request": {
        "rollfleet": "claim",
        "rollfleet_handover": "handover",
        "rollfleet_base": "claim",
        "agl": "claim",
    },
    "enqueue": {"rollfleet": "enqueue", "rollfleet_base": "enqueue", "agl": "enqueue"},
}


def spread(xs: list[float]) -> dict[str, Any]:
    """Rounds, their median and range."""
    return {"rounds": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(side: str, op: str, base_src: str) -> tuple[float, int]:
    """One measurement on a fresh server: ops/s in the counted window, and the ops run in all
    (warm-up included) against the seeded queue."""
    from bench.store_throughput import agl_server, client, on_src, ours_server, run_clients

    impl, code = SIDES[side]
    py = str(PEERS_PY) if impl == "agl" else PY
    with (
        on_src(base_src if code == "base" else None),
        tempfile.TemporaryDirectory(prefix="rollfleet-fair-") as folder,  # ~0.2 GB a measurement
    ):
        if impl == "agl":
            server, url = agl_server()
        else:
            server, url = ours_server(f"sqlite:///{folder}/{uuid.uuid4().hex}.db")
        try:
            if op != "enqueue":
                client(py, impl, url, "seed", n=FAIR_SEED)
            results = run_clients(
                py, impl, url, op, FAIR_WORKERS, "--warmup", str(WARMUP_S), seconds=WINDOW_S
            )
        finally:
            stop(server)
    rate = sum(r["ops"] for r in results) / WINDOW_S
    return rate, sum(int(r.get("total", r["ops"])) for r in results)


def fair(rounds: int, base_src: str, cells: list[str] | None = None) -> dict[str, Any]:
    """Every cell's sides in ``rounds`` interleaved rounds (order reversed every other round)."""
    cells = cells or os.environ.get("FAIR_CELLS", ",".join(CELLS)).split(",")
    keep = os.environ.get("FAIR_SIDES", ",".join(SIDES)).split(
        ","
    )  # a shorter run while developing
    chosen = {c: [s for s in CELLS[c] if s in keep] for c in cells}
    plan = [(cell, side) for cell in cells for side in chosen[cell]]
    found: dict[str, dict[str, list[float]]] = {c: {s: [] for s in chosen[c]} for c in cells}
    drained: dict[str, int] = {}
    for r in range(rounds):
        for cell, side in plan if r % 2 == 0 else list(reversed(plan)):
            rate, total = measure(side, CELLS[cell][side], base_src)
            found[cell][side].append(rate)
            drained[f"{cell}/{side}"] = max(drained.get(f"{cell}/{side}", 0), total)
            print(f"fair round {r + 1}/{rounds} {cell} {side}: {rate:,.0f}/s", flush=True)
    out: dict[str, Any] = {
        "settings": {
            "seeded": FAIR_SEED,
            "workers": FAIR_WORKERS,
            "warmup_s": WARMUP_S,
            "window_s": WINDOW_S,
            "rounds": rounds,
            "base_commit": BASE,
            "most_drained": drained,  # the queue never ran dry: the most any measurement took
        },
        "cells": {c: {s: spread(v) for s, v in sides.items()} for c, sides in found.items()},
    }
    out["ratios"] = ratios(found)
    show(out)
    return out


def ratios(found: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    """Each rollfleet side's median over each other side's median, and per round."""
    out: dict[str, dict[str, Any]] = {}
    for cell, sides in found.items():
        for ours in ("rollfleet", "rollfleet_handover"):
            for other in ("agl", "agl_sequential", "rollfleet_base"):
                if ours in sides and other in sides:
                    a, b = sides[ours], sides[other]
                    out.setdefault(cell, {})[f"{ours}/{other}"] = {
                        "median": statistics.median(a) / statistics.median(b),
                        "per_round": [x / y for x, y in zip(a, b, strict=True)],
                    }
    return out


def show(out: dict[str, Any]) -> None:
    """Print the cells as a table."""
    rows = []
    for cell, sides in out["cells"].items():
        for side, s in sides.items():
            rows.append([cell, side, f"{s['median']:,.0f} [{s['min']:,.0f}–{s['max']:,.0f}]"])
    table(
        "store, fair cells: 4 workers over HTTP, ops/s, median [min–max]",
        ["cell", "side", "ops/s"],
        rows,
    )
