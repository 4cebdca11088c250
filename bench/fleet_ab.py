"""Two sides of the fleet bench at one runner count (1,000 by default), side by side:
``python -m bench.fleet_ab handover`` (runners' completions sent alone, or as complete-and-claim)
and ``AB_BASE=<commit> python -m bench.fleet_ab before_after`` (that commit's servers against this
tree's). Each side runs :func:`bench.fleet.measure` on 1 replica, in alternating rounds with the
order reversed every other round; the figures go into bench/results/fleet.json under ``handover``
and ``before_after`` (one entry per base commit).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import RESULTS, ROOT
from bench.fleet import ROUNDS, measure
from rollfleet.web.serving import raise_fd_limit

HANDOVER_FIGURES = ("completions_per_s", "server_ms_per_rollout", "postgres_ms_per_rollout")


def _alternate(runners: int, sides: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Server and PostgreSQL CPU a rollout at ``runners`` runners on 1 replica, for each side (the
    environment its servers and clients start with), in alternating rounds, the order reversed
    every other round."""
    raise_fd_limit()
    logdir = Path(tempfile.mkdtemp(prefix="rollfleet-fleet-"))
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    saved = {k: os.environ.get(k) for env in sides.values() for k in env}
    try:
        for rnd in range(ROUNDS):
            for side in list(sides) if rnd % 2 == 0 else list(reversed(sides)):
                os.environ.update(sides[side])
                point = asyncio.run(measure(runners, 1, logdir))
                rounds[side].append({k: point[k] for k in HANDOVER_FIGURES})
                print(side, json.dumps(rounds[side][-1]), flush=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "runners": runners,
        "replicas": 1,
        "rounds": rounds,
        **{
            f"{side}_{k}": _spread([x[k] for x in xs])
            for side, xs in rounds.items()
            for k in HANDOVER_FIGURES
        },
    }


def _record(
    key: str, result: dict[str, Any], command: str, sub: str | None = None
) -> dict[str, Any]:
    """Put ``result`` under ``key`` (and ``sub`` inside it, beside the others there) in
    bench/results/fleet.json, with its command and date."""
    result = {**result, "command": command, "date": time.strftime("%Y-%m-%d")}
    path = RESULTS / "fleet.json"
    doc = json.loads(path.read_text())
    if sub is None:
        doc[key] = result
    else:
        doc.setdefault(key, {})[sub] = result
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return result


def handover_ab(runners: int = 1000) -> dict[str, Any]:
    """Server CPU a rollout with the runners' completions sent alone (``complete_many``) or as
    complete-and-claim (``FLEET_HANDOVER=1``); into fleet.json under ``handover``."""
    sides = {"complete_then_claim": {"FLEET_HANDOVER": "0"}, "handover": {"FLEET_HANDOVER": "1"}}
    return _record(
        "handover", _alternate(runners, sides), f"python -m bench.fleet_ab handover {runners}"
    )


def before_after(runners: int = 1000) -> dict[str, Any]:
    """Server CPU a rollout of the servers of commit ``AB_BASE`` (default ``HEAD``) against this
    tree's, runners completing and claiming in one request; into fleet.json under
    ``before_after``, keyed by the base commit (each step's A/B kept; ``<commit>-<runners>`` for
    a count other than 1,000)."""
    from bench.refactor_ab import worktree

    base = os.environ.get("AB_BASE", "HEAD")
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", base],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = worktree(rev)
    try:
        sides = {
            side: {"FLEET_HANDOVER": "1", "PYTHONPATH": f"{src / 'src'}{os.pathsep}{ROOT}"}
            for side, src in (("before", tree), ("after", ROOT))
        }
        result = _alternate(runners, sides)
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
        )
    ms = "server_ms_per_rollout"
    result["base"] = rev
    result["after_vs_before_server_ms"] = (
        result[f"after_{ms}"]["median"] / result[f"before_{ms}"]["median"]
    )
    return _record(
        "before_after",
        result,
        f"BENCH_ROUNDS={ROUNDS} AB_BASE={rev} python -m bench.fleet_ab before_after {runners}",
        sub=rev if runners == 1000 else f"{rev}-{runners}",  # other counts beside the 1,000 one
    )


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["before_after"]:
        before_after(*(int(a) for a in sys.argv[2:3]))
    else:
        handover_ab(*(int(a) for a in sys.argv[2:3]))
