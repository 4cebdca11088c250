"""Before and after a change, side by side: the same workloads from two commits, in alternate rounds.

For each round, each tree (``BASE`` first, then the working tree) runs (1) the store's headline
workload, claim+complete/s over HTTP with 4 client processes batching 16 on a fresh durable SQLite
server (bench/store_throughput.py's figure) and (2) end to end, rollouts/s of 4 local runner
processes × concurrency 64 with the 50 ms sleep agent (bench/_ab_e2e.py). The base tree is a git
worktree of ``BASE`` (default: the commit in ``AB_BASE``, else ``HEAD~1``); each side imports its own
``src/``. Medians and the spread of each side are reported, and their ratio.
Run: ``AB_BASE=<commit> python -m bench refactor_ab``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench._common import PY, ROOT, free_port, median_range, start, stop, table, write_results
from bench.store_throughput import SEED, clients

ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))


def worktree(rev: str) -> Path:
    """A detached git worktree of ``rev`` in a temporary directory."""
    path = Path(tempfile.mkdtemp(prefix="rollfleet-ab-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True
    )
    return path


def on_tree(tree: Path) -> dict[str, str]:
    """The environment that makes a process import ``tree``'s rollfleet and this tree's bench."""
    return {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{ROOT}"}


def store_round(tree: Path) -> float:
    """claim+complete/s, HTTP, 4 workers batched, on a fresh server of ``tree``."""
    saved = dict(os.environ)
    os.environ.update(on_tree(tree))  # the server, the seed client and the clients inherit it
    try:
        port = free_port()
        db = f"sqlite:///{tempfile.mkdtemp()}/ab.db"
        server = start(
            [PY, "-m", "rollfleet.cli", "serve", "--db", db, "--port", str(port)],
            f"http://127.0.0.1:{port}/health",
        )
        try:
            url = f"http://127.0.0.1:{port}"
            seed = subprocess.run(
                [
                    PY,
                    str(ROOT / "bench" / "_store_worker.py"),
                    "--impl",
                    "ours",
                    "--url",
                    url,
                    "--op",
                    "seed",
                    "--n",
                    str(SEED),
                ],
                capture_output=True,
                text=True,
                env=on_tree(tree),
                timeout=600,
            )
            if seed.returncode != 0:
                raise RuntimeError(seed.stderr[-2000:])
            return clients(PY, "ours", url, "claim_batch", 4)
        finally:
            stop(server)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def e2e_round(tree: Path) -> float:
    """rollouts/s end to end with ``tree``'s server and runners."""
    out = subprocess.run(
        [PY, "-m", "bench._ab_e2e"],
        capture_output=True,
        text=True,
        env=on_tree(tree),
        cwd=ROOT,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(json.loads(out.stdout.strip().splitlines()[-1])["rollouts_per_s"])


def main() -> dict[str, Any]:
    """Alternate base and head over ROUNDS rounds; write bench/results/refactor_ab.json."""
    base_rev = os.environ.get("AB_BASE", "HEAD~1")
    base = worktree(base_rev)
    head = ROOT
    rounds: dict[str, dict[str, list[float]]] = {
        w: {"base": [], "head": []} for w in ("store", "e2e")
    }
    try:
        for i in range(ROUNDS):
            for side, tree in (("base", base), ("head", head)):
                rounds["store"][side].append(store_round(tree))
                rounds["e2e"][side].append(e2e_round(tree))
                print(
                    f"round {i + 1} {side}: store {rounds['store'][side][-1]:.0f}/s, "
                    f"e2e {rounds['e2e'][side][-1]:.0f}/s",
                    flush=True,
                )
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
        )
    figures: dict[str, Any] = {
        "base": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", base_rev], capture_output=True, text=True
        ).stdout.strip(),
        "rounds": rounds,
    }
    rows = []
    for workload, label in (
        ("store", "claim+complete/s, HTTP, 4 workers batched"),
        ("e2e", "rollouts/s, 4 local runners x 64, 50 ms sleep agent"),
    ):
        b, h = median_range(rounds[workload]["base"]), median_range(rounds[workload]["head"])
        figures[workload] = {"base": b, "head": h, "ratio": h["median"] / b["median"]}
        rows.append(
            [
                label,
                f"{b['median']:.0f} [{b['min']:.0f}-{b['max']:.0f}]",
                f"{h['median']:.0f} [{h['min']:.0f}-{h['max']:.0f}]",
                f"{h['median'] / b['median']:.2f}x",
            ]
        )
    table(
        "before / after",
        ["workload", "base median [range]", "head median [range]", "head/base"],
        rows,
    )
    return write_results("refactor_ab", figures, f"AB_BASE={base_rev} python -m bench refactor_ab")
