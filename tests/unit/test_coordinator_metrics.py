"""Metric aggregation on known inputs (pure functions, no I/O)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from rollfleet.coordinator import metrics as m


def test_reward_stats_on_known_rewards_skip_missing() -> None:
    out = m.reward_stats([1.0, 0.0, None, 0.5, 0.5])
    assert out == {
        "reward/mean": 0.5,
        "reward/std": pytest.approx(math.sqrt(0.125)),
        "reward/max": 1.0,
        "reward/min": 0.0,
    }
    assert m.reward_stats([None]) == {}


def test_metric_aggregates_per_name_over_reporting_rollouts() -> None:
    out = m.metric_aggregates(
        [{"turns": 2, "ok": 1.0}, {"turns": 4}, {"turns": 6, "bad": float("nan")}]
    )
    assert out["metric/turns/mean"] == 4.0
    assert out["metric/turns/max"] == 6.0 and out["metric/turns/min"] == 2.0
    assert out["metric/turns/std"] == pytest.approx(statistics.pstdev([2, 4, 6]))
    assert out["metric/ok/mean"] == 1.0 and out["metric/ok/std"] == 0.0
    assert not any(k.startswith("metric/bad") for k in out)


def test_latency_percentiles_interpolate() -> None:
    out = m.latency_stats([4.0, 1.0, 3.0, 2.0])
    assert out == {
        "latency/mean": 2.5,
        "latency/p50": 2.5,
        "latency/p90": pytest.approx(3.7),
        "latency/max": 4.0,
    }
    with pytest.raises(ValueError):
        m.percentile([], 0.5)


def test_token_stats_totals_and_means() -> None:
    out = m.token_stats([10, 20], [5, 7])
    assert out == {
        "tokens/prompt_total": 30.0,
        "tokens/completion_total": 12.0,
        "tokens/completion_mean": 6.0,
        "tokens/prompt_mean": 15.0,
    }
    assert m.token_stats([], []) == {}


def _brute_extreme(rs: list[float], k: int, best: bool) -> float:
    pick = max if best else min
    subsets = list(itertools.combinations(rs, k))
    return sum(pick(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_best_and_worst_at_k_match_enumeration(k: int) -> None:
    rs = [0.1, 0.9, 0.4, 0.4]
    assert m.expected_extreme(rs, k, best=True) == pytest.approx(_brute_extreme(rs, k, True))
    assert m.expected_extreme(rs, k, best=False) == pytest.approx(_brute_extreme(rs, k, False))


def test_pass_at_k_unbiased_estimator() -> None:
    assert m.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert m.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert m.pass_at_k(4, 0, 4) == 0.0
    assert m.pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        m.pass_at_k(2, 3, 1)


def test_eval_metrics_average_over_tasks() -> None:
    out = m.eval_metrics({"a": [1.0, 0.0, 0.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0]})
    assert out["mean@4"] == pytest.approx(0.25)
    assert out["std@4"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert out["best@2"] == pytest.approx((5 / 6) / 2)  # task a: 1 - C(2,2)/C(4,2)
    assert out["worst@2"] == pytest.approx((1 / 6) / 2)
    assert out["pass@4"] == pytest.approx(0.5)
    assert sorted(k for k in out if k.startswith("pass@")) == ["pass@2", "pass@4"]
    assert m.eval_metrics({}) == {}


def test_eval_ks() -> None:
    assert m.eval_ks(1) == [1]
    assert m.eval_ks(8) == [2, 4, 8]
    assert m.eval_ks(6) == [2, 4, 6]


def test_failure_counts_by_kind() -> None:
    from rollfleet.errors import EngineError, describe_failure

    engine_down = describe_failure(EngineError("unreachable"), "EngineError: unreachable")
    assert engine_down.startswith("infrastructure: ")
    assert describe_failure(ValueError("x"), "ValueError: x") == "ValueError: x"
    out = m.failure_counts(
        [
            ("failed", engine_down),
            ("failed", "ValueError: x"),
            ("succeeded", None),
            ("failed", "timeout_s=3 exceeded"),
            ("cancelled", "cancelled"),
        ]
    )
    assert out == {"failures/infrastructure": 1.0, "failures/timeout": 1.0, "failures/agent": 1.0}
