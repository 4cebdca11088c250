"""The transition table and the retry policy: pure functions, no I/O."""

from __future__ import annotations

import pytest

from rollfleet.errors import Conflict
from rollfleet.model import (
    ROLLOUT_TRANSITIONS,
    TERMINAL_ROLLOUT,
    AttemptStatus,
    RetryDecision,
    RolloutStatus,
    check_attempt_transition,
    check_rollout_transition,
    retry_decision,
)


def test_terminal_states_never_change() -> None:
    for status in TERMINAL_ROLLOUT:
        assert ROLLOUT_TRANSITIONS[status] == frozenset()
        for target in RolloutStatus:
            with pytest.raises(Conflict):
                check_rollout_transition("r", status, target)


def test_queued_rollouts_can_only_be_claimed_or_cancelled() -> None:
    check_rollout_transition("r", RolloutStatus.QUEUING, RolloutStatus.PREPARING)
    check_rollout_transition("r", RolloutStatus.QUEUING, RolloutStatus.CANCELLED)
    with pytest.raises(Conflict, match="queuing → succeeded"):
        check_rollout_transition("r", RolloutStatus.QUEUING, RolloutStatus.SUCCEEDED)


def test_finished_attempts_are_final() -> None:
    check_attempt_transition("a", AttemptStatus.PREPARING, AttemptStatus.RUNNING)
    with pytest.raises(Conflict):
        check_attempt_transition("a", AttemptStatus.LOST, AttemptStatus.SUCCEEDED)


@pytest.mark.parametrize(
    ("outcome", "charged", "budget", "decision"),
    [
        (AttemptStatus.SUCCEEDED, 1, 3, RetryDecision.FINISH),
        (AttemptStatus.CANCELLED, 1, 3, RetryDecision.FINISH),
        (AttemptStatus.FAILED, 1, 3, RetryDecision.REQUEUE),
        (AttemptStatus.LOST, 2, 3, RetryDecision.REQUEUE),
        (AttemptStatus.TIMEOUT, 3, 3, RetryDecision.FINISH),
        (AttemptStatus.LOST, 0, 1, RetryDecision.REQUEUE),
    ],
)
def test_retry_decision(
    outcome: AttemptStatus, charged: int, budget: int, decision: RetryDecision
) -> None:
    assert retry_decision(outcome, charged, budget) is decision


def test_new_ids_start_with_the_millisecond_and_stay_unique(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollfleet.model import new_id

    ticks = iter(
        [1_700_000_000_000_000_000, 1_700_000_000_001_000_000] + [1_700_000_000_001_000_000] * 1000
    )
    monkeypatch.setattr("rollfleet.model.time.time_ns", lambda: next(ticks))
    early, late = new_id("ro"), new_id("ro")
    assert early.startswith("ro-018bcfe56800") and early < late
    same_ms = {
        new_id("ro") for _ in range(1000)
    }  # the random tail tells apart ids of one millisecond
    assert len(same_ms) == 1000


def test_retry_delay_doubles_is_jittered_and_capped() -> None:
    import random

    from rollfleet.model import MAX_RETRY_DELAY_S, retry_delay

    rng = random.Random(1)
    assert retry_delay(0.5, 0, rng) == 0.0 and retry_delay(0.0, 5, rng) == 0.0
    for n in range(1, 8):
        full = 0.5 * 2 ** (n - 1)
        got = [retry_delay(0.5, n, rng) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in got)
        assert (
            max(got) - min(got) > full / 4
        )  # spread, not one value for every rollout lost together
    assert retry_delay(60.0, 100, rng) <= MAX_RETRY_DELAY_S
