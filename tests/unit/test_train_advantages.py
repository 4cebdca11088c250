"""The advantage estimators (GRPO, Dr. GRPO, RLOO) on groups of 3 and 4 rewards and a group of
one, against numbers computed by hand; GRPO's is exactly the formula the coordinator used
before (experiences.grpo_advantages)."""

from __future__ import annotations

import math

import pytest

from rollfleet.coordinator.advantages import ESTIMATORS, check_estimator, group_advantages
from rollfleet.errors import InvalidInput

# group a: 3, 1, 2 (mean 2, std 1); group b: 1, 0, 0, 0 (mean 0.25, std 0.5); c alone
REWARDS = {"a1": 3.0, "a2": 1.0, "a3": 2.0, "b1": 1.0, "b2": 0.0, "b3": 0.0, "b4": 0.0, "c": 5.0}
GROUPS = {rid: rid[0] for rid in REWARDS}


def former_grpo(rs: list[float], std_normalize: bool = True) -> list[float]:
    """The coordinator's former grpo_advantages on one group, as it was written."""
    if len(rs) < 2:
        return [0.0] * len(rs)
    mean = sum(rs) / len(rs)
    std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
    return [(r - mean) / (std + 1e-6) if std_normalize else r - mean for r in rs]


def former(std_normalize: bool = True) -> dict[str, float]:
    """``former_grpo`` over every group of REWARDS."""
    out: dict[str, float] = {}
    for group in "abc":
        ids = [rid for rid in REWARDS if GROUPS[rid] == group]
        out.update(zip(ids, former_grpo([REWARDS[i] for i in ids], std_normalize), strict=True))
    return out


def test_grpo_divides_by_the_groups_std_and_is_grpo_advantages() -> None:
    got = group_advantages(REWARDS, GROUPS, "grpo")
    eps = 1e-6
    want = {
        "a1": 1 / (1 + eps),
        "a2": -1 / (1 + eps),
        "a3": 0.0,
        "b1": 0.75 / (0.5 + eps),
        "b2": -0.25 / (0.5 + eps),
        "b3": -0.25 / (0.5 + eps),
        "b4": -0.25 / (0.5 + eps),
        "c": 0.0,
    }
    assert got == pytest.approx(want, abs=1e-12)
    assert got == former()  # exactly, bit for bit
    assert group_advantages(REWARDS, GROUPS) == got  # the default


def test_drgrpo_subtracts_the_groups_mean_only() -> None:
    got = group_advantages(REWARDS, GROUPS, "drgrpo")
    want = {
        "a1": 1.0,
        "a2": -1.0,
        "a3": 0.0,
        "b1": 0.75,
        "b2": -0.25,
        "b3": -0.25,
        "b4": -0.25,
        "c": 0.0,
    }
    assert got == pytest.approx(want, abs=1e-12)
    assert got == former(std_normalize=False)


def test_rloo_subtracts_the_mean_of_the_other_members() -> None:
    got = group_advantages(REWARDS, GROUPS, "rloo")
    # a1: 3 - (1 + 2) / 2; b1: 1 - 0; b2: 0 - 1/3; i.e. n / (n - 1) * (r - mean)
    want = {
        "a1": 1.5,
        "a2": -1.5,
        "a3": 0.0,
        "b1": 1.0,
        "b2": -1 / 3,
        "b3": -1 / 3,
        "b4": -1 / 3,
        "c": 0.0,
    }
    assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_group_of_one_and_a_group_that_scored_alike_give_zero(estimator: str) -> None:
    alike = {"x1": 0.5, "x2": 0.5, "x3": 0.5, "y": 1.0}
    got = group_advantages(alike, {"x1": "x", "x2": "x", "x3": "x"}, estimator)  # y: no group
    assert got == {"x1": 0.0, "x2": 0.0, "x3": 0.0, "y": 0.0}
    assert group_advantages({}, {}, estimator) == {}


def test_an_unknown_estimator_is_refused_naming_the_valid_ones() -> None:
    assert check_estimator("rloo") == "rloo"
    with pytest.raises(
        InvalidInput, match=r"unknown advantage estimator 'ppo': use one of grpo, drgrpo, rloo"
    ):
        group_advantages(REWARDS, GROUPS, "ppo")
    with pytest.raises(InvalidInput, match="'GRPO'"):
        check_estimator("GRPO")
