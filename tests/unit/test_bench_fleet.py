"""bench/fleet.py merges a run of chosen points into bench/results/fleet.json without losing what
else the file holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def point(runners: int, replicas: int, rate: float) -> dict[str, Any]:
    """A measured point, as far as the merge reads it."""
    return {"runners": runners, "replicas": replicas, "completions_per_s": rate}


def test_a_run_of_chosen_points_replaces_them_and_keeps_everything_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.fleet import merged

    old = {
        "benchmark": "fleet",
        "command": "python -m bench fleet",
        "machine": {"date": "2026-11-25"},
        "points": [point(1000, 1, 300.0), point(10000, 1, 115.0)],
        "raw": [point(1000, 1, 300.0), point(10000, 1, 115.0)],
        "before": [{"run": {"command": "older"}, "points": []}],
        "connection_memory": {"kib_per_connection": 9.0},  # bench/_fleet_client.py's
        "before_after": [{"base": "abc1234"}],  # bench/fleet_ab.py's
    }
    new: dict[str, Any] = {"points": [point(10000, 1, 310.0)], "counts": [10000]}
    new["raw"] = new["points"]
    out = merged(new, old)
    assert out["points"] == [point(1000, 1, 300.0), point(10000, 1, 310.0)]
    assert out["before"][0] == old["before"][0]
    assert out["before"][1]["points"] == [point(10000, 1, 115.0)]
    assert out["before"][1]["run"]["command"] == "python -m bench fleet"
    assert out["connection_memory"] == old["connection_memory"]
    assert out["before_after"] == old["before_after"]
    assert out["counts"] == [10000]
    assert not {"benchmark", "command", "machine"} & set(out)  # write_results names this run's
