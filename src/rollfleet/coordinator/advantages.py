"""Advantage estimators: each sample's reward against the other samples of its task's group.

- ``grpo``: ``(r - mean) / (std + 1e-6)``, std with n - 1 (GRPO, DeepSeekMath).
- ``drgrpo``: ``r - mean``, no division by the std (Dr. GRPO: the std favours groups that
  almost all scored alike).
- ``rloo``: ``r - mean of the other members``, the REINFORCE leave-one-out baseline
  (``n / (n - 1) * (r - mean)``).

A group of one carries no signal: its advantage is 0 under every estimator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rollfleet.errors import InvalidInput

ESTIMATORS = ("grpo", "drgrpo", "rloo")
GRPO_EPS = 1e-6


def check_estimator(name: str) -> str:
    """``name`` when it is a known estimator; InvalidInput naming the valid ones otherwise."""
    if name not in ESTIMATORS:
        raise InvalidInput(
            f"unknown advantage estimator {name!r}: use one of {', '.join(ESTIMATORS)}"
        )
    return name


def group_advantages(
    rewards: Mapping[str, float], groups: Mapping[str, str], estimator: str = "grpo"
) -> dict[str, float]:
    """Rollout id → advantage, by ``estimator``, from ``rewards`` (rollout id → reward) and
    ``groups`` (rollout id → group id; a rollout it does not name is a group of its own)."""
    check_estimator(estimator)
    members: dict[str, list[str]] = {}
    for rid in rewards:
        members.setdefault(groups.get(rid, rid), []).append(rid)
    out: dict[str, float] = {}
    for ids in members.values():
        out.update(zip(ids, _estimate([rewards[i] for i in ids], estimator), strict=True))
    return out


def _estimate(rs: Sequence[float], estimator: str) -> list[float]:
    """One group's advantages, in the order of its rewards."""
    n = len(rs)
    if n < 2:
        return [0.0] * n
    if estimator == "rloo":
        total = sum(rs)
        return [r - (total - r) / (n - 1) for r in rs]
    mean = sum(rs) / n
    if estimator == "drgrpo":
        return [r - mean for r in rs]
    std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
    return [(r - mean) / (std + GRPO_EPS) for r in rs]
