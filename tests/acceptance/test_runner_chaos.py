"""Chaos (issue 21): 1,000 rollouts of 0.2–1.5 s on 4 runners x 4, a runner SIGKILLed after each
random interval (exponential, mean 2 s), and the server killed and restarted once.

Every rollout SUCCEEDED exactly once, within 4 minutes, on the default retry budgets
(max_attempts 3, max_lost 10); killed runners restarted at once, since each had made progress.
The throughput against the same run without kills is measured in bench/chaos.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollfleet.chaos import ChaosOptions, run_chaos

pytestmark = pytest.mark.timeout(330)


async def test_a_thousand_rollouts_survive_random_kills_and_a_server_restart(
    tmp_path: Path,
) -> None:
    report = await run_chaos(
        ChaosOptions(rollouts=1000, kill_mean_s=2.0, restart_server_at=0.2, seed=21), tmp_path
    )
    assert report.failed == {}, f"failed, with why: {dict(list(report.failed.items())[:5])}"
    assert report.open == 0, f"{report.open} rollouts not finished after {report.seconds:.0f} s"
    assert report.succeeded == 1000 and report.succeeded_twice == []
    assert report.seconds <= 240
    assert report.kills >= 10 and report.lost >= 1, report  # the chaos really hit running work
    assert report.restarts.get("at once", 0) >= report.kills // 2, (
        report.restarts
    )  # no crash-loop backoff
