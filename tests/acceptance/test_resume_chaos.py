"""Turn-level resume under chaos (issue 31): 500 five-turn rollouts of the scripted turn agent
(each turn a scripted model reply, then a side-effecting write to a ledger file) on 4 runners,
a random runner SIGKILLed every ~2 s (exponential intervals) and the server killed and restarted
once.

Every rollout SUCCEEDED exactly once; no recorded reply was asked for again; no write ran twice;
no attempt started from turn 0 once a turn had finished; every trajectory equals, token for token,
the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollfleet.chaos import ChaosOptions, run_chaos

pytestmark = pytest.mark.timeout(330)


async def test_five_hundred_five_turn_rollouts_resume_by_turn_through_kills(
    tmp_path: Path,
) -> None:
    report = await run_chaos(
        ChaosOptions(
            rollouts=500,
            turns=5,
            min_s=1.0,
            max_s=2.5,
            kill_mean_s=2.0,
            restart_server_at=0.3,
            seed=31,
        ),
        tmp_path,
    )
    assert report.failed == {}, f"failed, with why: {dict(list(report.failed.items())[:5])}"
    assert report.open == 0 and report.succeeded == 500 and report.succeeded_twice == []
    assert report.kills >= 10 and report.lost >= 10, report  # the kills hit running rollouts
    resume = report.resume
    assert resume is not None
    assert resume.resumed >= 10, resume  # attempts really went on from a later turn
    assert resume.replies_repeated == 0
    assert resume.writes_twice == 0
    assert resume.restarted_after_a_turn == 0
    assert resume.wrong_trajectories == []
