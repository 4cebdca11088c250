"""Pure aggregation functions for batch results: no I/O, plain numbers in, plain dicts out.

Eval metrics follow the usual definitions for ``n`` samples per task: ``mean@n`` and ``std@n``
of the rewards; ``best@k``/``worst@k`` the *expected* maximum/minimum reward of ``k`` samples drawn
without replacement (computed exactly from order statistics, not by resampling); ``pass@k`` the
unbiased estimator ``1 - C(n-c, k) / C(n, k)`` with ``c`` the samples whose reward reaches a
threshold.
Every task-level figure is averaged over tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from rollfleet.errors import failure_kind
from rollfleet.stats import pass_at_k, percentile


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _pstd(xs: Sequence[float]) -> float:
    mean = _mean(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def summary(values: Iterable[float], prefix: str) -> dict[str, float]:
    """``{prefix}/mean, /std, /max, /min`` of the values (population std); empty for no values."""
    xs = [float(v) for v in values]
    if not xs:
        return {}
    return {
        f"{prefix}/mean": _mean(xs),
        f"{prefix}/std": _pstd(xs),
        f"{prefix}/max": max(xs),
        f"{prefix}/min": min(xs),
    }


def reward_stats(rewards: Iterable[float | None]) -> dict[str, float]:
    """Mean, std, max and min of the rewards that exist (``reward/mean`` …)."""
    return summary((r for r in rewards if r is not None), "reward")


def failure_counts(failures: Iterable[tuple[str, str | None]]) -> dict[str, float]:
    """``failures/infrastructure``, ``failures/timeout``, ``failures/agent``: the failed rollouts
    by kind, from (status, error) pairs. Infrastructure failures are never scored as reward 0."""
    kinds = [failure_kind(status, error) for status, error in failures]
    return {
        f"failures/{kind}": float(kinds.count(kind))
        for kind in ("infrastructure", "timeout", "agent")
    }


def metric_aggregates(metrics: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Mean, std, max and min of every named metric over the rollouts that report it."""
    by_name: dict[str, list[float]] = {}
    for row in metrics:
        for name, value in row.items():
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                by_name.setdefault(name, []).append(float(value))
    out: dict[str, float] = {}
    for name in sorted(by_name):
        out.update(summary(by_name[name], f"metric/{name}"))
    return out


def latency_stats(durations: Iterable[float]) -> dict[str, float]:
    """Mean, p50, p90 and max of rollout durations in seconds (``latency/…``)."""
    xs = [float(d) for d in durations]
    if not xs:
        return {}
    return {
        "latency/mean": _mean(xs),
        "latency/p50": percentile(xs, 0.5),
        "latency/p90": percentile(xs, 0.9),
        "latency/max": max(xs),
    }


def token_stats(prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> dict[str, float]:
    """Totals and per-rollout means of prompt and completion tokens (``tokens/…``)."""
    if not prompt_tokens and not completion_tokens:
        return {}
    out: dict[str, float] = {
        "tokens/prompt_total": float(sum(prompt_tokens)),
        "tokens/completion_total": float(sum(completion_tokens)),
    }
    if completion_tokens:
        out["tokens/completion_mean"] = _mean([float(c) for c in completion_tokens])
    if prompt_tokens:
        out["tokens/prompt_mean"] = _mean([float(p) for p in prompt_tokens])
    return out


def expected_extreme(rewards: Sequence[float], k: int, *, best: bool) -> float:
    """Expected max (``best``) or min of ``k`` samples drawn without replacement from
    ``rewards``."""
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and {n}, got {k}")
    xs = sorted(rewards, reverse=not best)
    # xs[i] (0-based, ascending for best) is the max of a k-subset in C(i, k-1) of C(n, k) subsets
    total = math.comb(n, k)
    return sum(xs[i] * math.comb(i, k - 1) for i in range(k - 1, n)) / total


def eval_ks(n: int) -> list[int]:
    """The k values reported for n samples: powers of two below n, then n itself."""
    ks = [k for k in (2**i for i in range(1, 12)) if k < n]
    return [*ks, n] if n >= 1 else []


def eval_metrics(
    groups: Mapping[str, Sequence[float]], *, pass_threshold: float = 1.0
) -> dict[str, float]:
    """mean@n, std@n, best@k, worst@k and pass@k averaged over tasks; n is the largest group's
    size."""
    tasks = [[float(r) for r in rs] for rs in groups.values() if rs]
    if not tasks:
        return {}
    n = max(len(rs) for rs in tasks)
    out = {
        f"mean@{n}": _mean([_mean(rs) for rs in tasks]),
        f"std@{n}": _mean([_pstd(rs) for rs in tasks]),
    }
    for k in eval_ks(min(len(rs) for rs in tasks)):  # a k every task has samples for
        out[f"best@{k}"] = _mean([expected_extreme(rs, k, best=True) for rs in tasks])
        out[f"worst@{k}"] = _mean([expected_extreme(rs, k, best=False) for rs in tasks])
        out[f"pass@{k}"] = _mean(
            [pass_at_k(len(rs), sum(r >= pass_threshold for r in rs), k) for rs in tasks]
        )
    return out
