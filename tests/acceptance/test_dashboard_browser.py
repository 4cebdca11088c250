"""The dashboard in real headless Chromium against a real server, real store and real runners.

Every test checks that its pages logged no console error, and saves a screenshot of the page
it exercised under docs/screenshots/ (shown in the README).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from acceptance.dashboard_browser import ROOT, Page, expect, row, shot, wait_live

from rollfleet.client import connect_sync
from rollfleet.model import AttemptStatus, RolloutResult, RolloutStatus, StepIn
from rollfleet.server.dashboard import dashboard_router
from rollfleet.server.embedded import ServerThread
from rollfleet.server.parts import ServerParts


class Extras:
    """Batches, pools and engines the way the coordinator, pools and gateway report them."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    async def batches(self) -> list[dict[str, Any]]:
        state = "ABORTED" if self.aborted else "RUNNING"
        return [
            {
                "batch_id": "train-7",
                "batch_type": "train",
                "expected_task_count": 64,
                "completed_task_count": 41,
                "min_wait_num": 58,
                "state": state,
                "policy": "carry_over",
                "created_at": time.time() - 90,
            },
            {
                "batch_id": "eval-3",
                "batch_type": "eval",
                "expected_task_count": 16,
                "completed_task_count": 16,
                "min_wait_num": None,
                "state": "FINALIZED",
                "policy": "wait",
                "created_at": time.time() - 600,
                "final_result": {
                    "metrics": {"reward/mean": 0.62, "reward/std": 0.21, "mean@4": 0.6}
                },
            },
        ]

    async def pools(self) -> list[dict[str, Any]]:
        states = ["BUSY", "BUSY", "IDLE", "RESETTING"]
        return [
            {
                "name": "sandbox",
                "provider": "sandbox",
                "size": 4,
                "healthy": 4,
                "degraded": False,
                "states": {},
                "waiting": 2,
                "acquired": 310,
                "timeouts": 0,
                "replacements": 1,
                "instances": [{"instance_id": f"sb-{i}", "state": s} for i, s in enumerate(states)],
                "wait_p50_s": 0.004,
                "wait_p90_s": 0.21,
                "wait_p99_s": 0.9,
                "utilisation": 0.71,
            }
        ]

    async def engines(self) -> list[dict[str, Any]]:
        return [
            {
                "replica_id": f"llamacpp-{i}",
                "engine": "llamacpp",
                "model": "SmolLM2-135M-Instruct",
                "weights_version": 3,
                "capacity": 4,
                "in_flight": 3 - i,
                "served": 120 + i,
                "draining": False,
            }
            for i in range(2)
        ]

    async def abort_batch(self, batch_id: str, reason: str) -> None:
        self.aborted.append((batch_id, reason))


@pytest.fixture(scope="module")
def extras() -> Extras:
    return Extras()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, extras: Extras) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("dash") / "fleet.db"
    providers = {
        "batches": extras.batches,
        "pools": extras.pools,
        "engines": extras.engines,
        "abort_batch": extras.abort_batch,
    }
    with ServerThread(
        f"sqlite:///{db}",
        parts=lambda store: ServerParts(routers=[("", dashboard_router(store, providers))]),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def store(server: ServerThread) -> Iterator[Any]:
    """A client of the server's own store (writes wake the dashboard's live stream at once)."""
    client = connect_sync(server.url)
    yield client
    client.close()
    client._loop.close()  # SyncStore.close() stops its loop but does not close it (reported to the lead)


def test_runners_page_shows_four_workers_busy(server: ServerThread, store: Any, page: Page) -> None:
    tasks = [{"input": {"duration": 2.0, "task": i}, "mode": "sleep"} for i in range(20)]
    ids = [r.rollout_id for r in store.enqueue_many([_spec(t) for t in tasks])]
    page.goto(f"{server.url}/#/runners")
    wait_live(page)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "workers",
        "-n",
        "4",
        "--agent",
        "rollfleet.agents.sleep:agent",
        "--store",
        server.url,
        "--grace",
        "5",
        "--prefix",
        "dash",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        page.wait_for_function(
            "document.querySelectorAll('#runners tr[data-status=\"busy\"]').length === 4",
            timeout=60_000,
        )
        busy = page.locator('#runners tr[data-status="busy"]')
        expect(busy).to_have_count(4)
        for i in range(4):
            expect(busy.nth(i).locator("td.current a")).to_have_count(
                1
            )  # each shows the rollout it runs
        shot(page, "runners")
        done = store.wait_for_rollouts(ids, 90)
        assert all(r.status is RolloutStatus.SUCCEEDED for r in done)
        assert {r.attempt.worker_id for r in done if r.attempt} == {f"dash-{i}" for i in range(4)}
        page.wait_for_function(
            "document.querySelectorAll('#runners tr[data-status=\"idle\"]').length === 4",
            timeout=30_000,
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err


def _spec(task: dict[str, Any]) -> Any:
    from rollfleet.model import RolloutSpec

    return RolloutSpec(**task)


def test_rollout_status_changes_live_without_reload(
    server: ServerThread, store: Any, page: Page
) -> None:
    page.goto(f"{server.url}/#/rollouts")
    wait_live(page)
    page.evaluate("window.__sameDocument = true")
    rollout = store.enqueue_rollout({"q": "live"}, mode="live-test")
    expect(row(page, rollout.rollout_id).locator("td.status")).to_have_text("QUEUING")
    store.register_worker("live-worker")
    attempt = store.claim("live-worker")[0].attempt
    expect(row(page, rollout.rollout_id).locator("td.status")).to_have_text("PREPARING")
    store.heartbeat_many([attempt.attempt_id], "live-worker")
    expect(row(page, rollout.rollout_id).locator("td.status")).to_have_text("RUNNING")
    store.complete(attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.75))
    expect(row(page, rollout.rollout_id).locator("td.status")).to_have_text("SUCCEEDED")
    expect(row(page, rollout.rollout_id)).to_contain_text("0.750")
    assert page.evaluate("window.__sameDocument") is True  # no reload happened


def test_cancel_from_page_needs_confirmation_and_cancels_in_store(
    server: ServerThread, store: Any, page: Page
) -> None:
    rollout = store.enqueue_rollout({"q": "cancel me"}, mode="cancel-test")
    page.goto(f"{server.url}/#/rollouts?search={rollout.rollout_id}")
    target = row(page, rollout.rollout_id)
    target.locator("button.cancel").click()
    expect(page.locator("#confirm")).to_be_visible()
    page.locator("#confirm-no").click()
    expect(page.locator("#confirm")).to_be_hidden()
    assert store.get_rollout(rollout.rollout_id).status is RolloutStatus.QUEUING
    target.locator("button.cancel").click()
    expect(page.locator("#confirm-body")).to_contain_text(rollout.rollout_id)
    page.locator("#confirm-yes").click()
    expect(target.locator("td.status")).to_have_text("CANCELLED")
    assert store.get_rollout(rollout.rollout_id).status is RolloutStatus.CANCELLED
    expect(target.locator("button.cancel")).to_have_count(0)


def test_requeue_stuck_from_page(server: ServerThread, store: Any, page: Page) -> None:
    rollout = store.enqueue_rollout({"q": "stuck"}, mode="stuck-test", priority=100)
    store.register_worker("stuck-worker")
    claimed = store.claim("stuck-worker")[0]
    assert claimed.rollout_id == rollout.rollout_id
    page.goto(f"{server.url}/#/rollouts?mode=stuck-test")
    expect(row(page, rollout.rollout_id).locator("td.status")).to_have_text("PREPARING")
    page.locator("#requeue").click()
    page.locator("#rq-older").fill("0")
    page.locator("#confirm-yes").click()
    expect(page.locator(".toast.ok")).to_contain_text("Requeued")
    expect(row(page, rollout.rollout_id).locator("td.status")).to_have_text("QUEUING")
    assert store.get_rollout(rollout.rollout_id).status is RolloutStatus.QUEUING
    store.cancel(rollout.rollout_id)


def test_filters_search_and_pagination(server: ServerThread, store: Any, page: Page) -> None:
    from rollfleet.model import RolloutSpec

    made = store.enqueue_many(
        [
            RolloutSpec(input={"i": i}, mode="pager" if i % 3 else "other", batch_id="pb")
            for i in range(60)
        ]
    )
    pager = [r.rollout_id for r in made if r.mode == "pager"]  # 40, oldest first
    page.goto(f"{server.url}/#/rollouts?batch_id=pb&limit=25")
    expect(page.locator("#rollout-rows tr")).to_have_count(25)
    page.locator("#f-mode").fill("pager")
    page.locator("#filters button[type=submit]").click()
    expect(page).to_have_url(f"{server.url}/#/rollouts?mode=pager&batch_id=pb&limit=25")
    first = _ids(page, 25)
    assert first == list(reversed(pager))[:25]  # newest first
    page.locator("#page-older").click()
    second = _ids(page, 15)
    assert second == list(reversed(pager))[25:]
    expect(page.locator("#page-older")).to_be_disabled()
    expect(page.locator("#page-info")).to_contain_text("page 2")
    page.locator("#page-newer").click()
    assert _ids(page, 25) == first
    page.locator("#f-status").select_option("queuing")
    expect(page.locator("#rollout-rows tr")).to_have_count(25)
    assert set(page.locator("#rollout-rows td.status").all_inner_texts()) == {"QUEUING"}
    page.goto(f"{server.url}/#/rollouts?search={pager[3]}")
    expect(page.locator("#rollout-rows tr")).to_have_count(1)
    expect(row(page, pager[3])).to_be_visible()
    shot(page, "rollouts-filtered")
    page.goto(f"{server.url}/#/rollouts")
    expect(page.locator("#rollout-rows tr")).to_have_count(50)
    shot(page, "rollouts")
    for r in made:
        store.cancel(r.rollout_id)


def _ids(page: Page, n: int) -> list[str]:
    expect(page.locator("#rollout-rows tr[data-id]")).to_have_count(n)
    return [
        x
        for x in page.locator("#rollout-rows tr[data-id]").evaluate_all(
            "rs => rs.map(r => r.dataset.id)"
        )
    ]


def test_detail_page_shows_attempts_and_trajectory(
    server: ServerThread, store: Any, page: Page
) -> None:
    rollout = store.enqueue_rollout(
        {"question": "What is 6 * 7?"}, mode="math", priority=200, config={"retry_delay_s": 0}
    )  # claimed again at once below
    store.register_worker("detail-worker")
    first = store.claim("detail-worker")[0].attempt
    store.complete(first.attempt_id, AttemptStatus.FAILED, None, "ValueError: the sandbox crashed")
    second = store.claim("detail-worker")[0].attempt
    assert second.rollout_id == rollout.rollout_id
    store.add_steps(
        second.attempt_id,
        [
            StepIn(
                kind="llm",
                payload={
                    "messages": [{"role": "user", "content": "What is 6 * 7?"}],
                    "text": "Let me compute it.",
                    "usage": {"prompt_tokens": 14, "completion_tokens": 5},
                    "latency_s": 0.084,
                    "model": "SmolLM2-135M-Instruct",
                },
            ),
            StepIn(
                kind="tool",
                payload={"name": "python", "arguments": {"code": "6 * 7"}, "result": 42},
            ),
            StepIn(kind="reward", payload={"reward": 1.0}),
        ],
    )
    store.complete(
        second.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0, output="42")
    )
    page.goto(f"{server.url}/#/rollouts/{rollout.rollout_id}")
    expect(page.locator("dd[data-fact=status]")).to_have_text("SUCCEEDED")
    expect(page.locator("#detail table.grid tbody tr")).to_have_count(2)
    expect(page.locator("#detail")).to_contain_text("ValueError: the sandbox crashed")
    expect(page.locator("#detail")).to_contain_text("detail-worker")
    steps = page.locator(".timeline > li")
    expect(steps).to_have_count(3)
    expect(steps.nth(0)).to_contain_text("14 prompt tokens")
    expect(steps.nth(0)).to_contain_text("5 completion tokens")
    expect(steps.nth(0)).to_contain_text("latency 84 ms")
    expect(steps.nth(1)).to_contain_text("tool python")
    expect(steps.nth(2)).to_contain_text("reward 1")
    raw = page.locator("details.raw")
    expect(raw.locator("pre")).to_be_hidden()
    raw.locator("summary").click()
    expect(raw.locator("pre")).to_contain_text('"attempt_id"')
    shot(page, "rollout-detail")


def test_detail_page_shows_a_screenshot_stored_once_by_content(
    server: ServerThread, store: Any, page: Page
) -> None:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rollout = store.enqueue_rollout({"task": "click the red square"}, mode="osworld", priority=250)
    attempt = store.claim("shot-worker")[0].attempt
    turn = {
        "role": "user",
        "content": [
            {"type": "text", "text": "the screen:"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }
    store.add_steps(
        attempt.attempt_id,
        [
            StepIn(kind="llm", payload={"messages": [turn], "text": "CLICK"}),
            StepIn(kind="llm", payload={"messages": [turn, turn], "text": "DONE"}),
        ],
    )
    stored = store.query_steps(rollout.rollout_id).items
    assert "base64" not in str(stored[1].payload)  # a reference, twice, and the bytes once
    page.goto(f"{server.url}/#/rollouts/{rollout.rollout_id}")
    shots = page.locator(".timeline img.shot")
    expect(shots).to_have_count(3)
    for i in range(3):
        expect(shots.nth(i)).to_have_attribute("src", url)  # fetched from /blobs with the token
    size = shots.nth(0).evaluate("img => [img.naturalWidth, img.naturalHeight]")
    assert size == [64, 48]  # the browser decoded the real image


def _retried(
    store: Any, priority: int, first: list[StepIn], second: Callable[[str], list[StepIn]]
) -> str:
    """A rollout whose first attempt recorded ``first`` and failed, and whose second recorded
    ``second(<the first attempt's id>)`` and succeeded."""
    rollout = store.enqueue_rollout(
        {"task": priority}, mode="files", priority=priority, config={"retry_delay_s": 0}
    )  # claimed again at once below
    attempt = store.claim("resume-worker")[0].attempt
    store.add_steps(attempt.attempt_id, first)
    store.complete(attempt.attempt_id, AttemptStatus.FAILED, None, "runner killed")
    retry = store.claim("resume-worker")[0].attempt
    assert retry.rollout_id == rollout.rollout_id and retry.sequence == 2
    store.add_steps(retry.attempt_id, second(attempt.attempt_id))
    store.complete(retry.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0))
    return str(rollout.rollout_id)


def test_detail_page_shows_where_each_attempt_started_and_what_it_reused(
    server: ServerThread, store: Any, page: Page
) -> None:
    call = {"name": "ls", "args": {}, "call_id": "c0"}
    first = [
        StepIn(kind="reply", payload={"turn": 0, "request_id": "req-0", "calls": [call]}),
        StepIn(kind="tool_result", payload={"turn": 0, "index": 0, "observation": "a.txt"}),
        StepIn(kind="turn", payload={"turn": 0, "request_id": "req-0", "content": "ls"}),
    ]
    resumed = {"attempt": 2, "strategy": "replay", "from_turn": 1, "reused_results": 1}
    rollout_id = _retried(
        store,
        500,
        first,
        lambda earlier: [
            StepIn(
                kind="resume",
                payload={**resumed, "reused_calls": ["req-0"], "from_attempts": [earlier]},
            ),
            StepIn(kind="turn", payload={"turn": 0, "request_id": "req-0", "reused": True}),
            StepIn(kind="turn", payload={"turn": 1, "request_id": "req-1"}),
        ],
    )
    page.goto(f"{server.url}/#/rollouts/{rollout_id}")
    starts = page.locator("#detail td.start")
    expect(starts).to_have_count(2)
    expect(starts.nth(0)).to_have_text("turn 0")
    expect(starts.nth(1)).to_have_attribute("data-from-turn", "1")
    expect(starts.nth(1)).to_contain_text("turn 1 replay")
    expect(starts.nth(1)).to_contain_text("took over 1 turn from")
    expect(starts.nth(1)).to_contain_text("reused 1 call, 1 tool result")
    first_id = page.locator("#detail table.grid tbody tr").nth(0).locator("td").nth(1)
    expect(starts.nth(1).locator(".reused .mono")).to_have_attribute(
        "title", first_id.inner_text().strip()
    )
    reused = page.locator(".timeline > li.reused")
    expect(reused).to_have_count(1)
    expect(reused.locator(".tag.reused")).to_have_text("reused")
    expect(reused.locator(".summary")).to_have_text("turn 0")
    expect(page.locator(".timeline > li.k-resume .summary")).to_contain_text(
        "replay: from turn 1, reused 1 call, 1 tool result"
    )

    why = "mode desktop declares no resume: restarted from turn 0"
    restart = {"attempt": 2, "strategy": "restart", "from_turn": 0, "reused_calls": []}
    rollout_id = _retried(
        store,
        510,
        first,
        lambda _: [StepIn(kind="resume", payload={**restart, "reused_results": 0, "reason": why})],
    )
    page.goto(f"{server.url}/#/rollouts/{rollout_id}")
    start = page.locator("#detail td.start").nth(1)
    expect(start).to_have_attribute("data-strategy", "restart")
    expect(start).to_contain_text("turn 0 restart")
    expect(start.locator(".restarted")).to_have_text(why)
    expect(page.locator(".timeline > li.reused")).to_have_count(0)


def test_overview_counts_match_the_store(server: ServerThread, store: Any, page: Page) -> None:
    store.enqueue_rollout({"q": "overview"}, priority=300)
    store.register_worker("overview-worker")
    attempt = store.claim("overview-worker")[0].attempt
    store.complete(attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.5))
    page.goto(f"{server.url}/#/")
    wait_live(page)
    stats = store.statistics()
    cards = page.locator("#status-cards")
    expect(cards).to_contain_text(f"{stats.rollouts['succeeded']}SUCCEEDED")
    expect(cards).to_contain_text(f"{stats.rollouts['cancelled']}CANCELLED")
    expect(page.locator(".chart-box")).to_have_count(2)
    expect(page.locator(".chart-box rect").first).to_be_attached()  # finished rollouts show as bars
    shot(page, "overview")


def test_batches_page_aborts_with_confirmation(
    server: ServerThread, extras: Extras, page: Page
) -> None:
    page.goto(f"{server.url}/#/batches")
    train = page.locator('tr[data-batch="train-7"]')
    expect(train).to_contain_text("41 / 64")
    expect(page.locator('tr[data-batch="eval-3"]')).to_contain_text("mean@4=0.600")
    expect(page.locator('tr[data-batch="eval-3"] button.abort')).to_have_count(0)
    shot(page, "batches")
    train.locator("button.abort").click()
    page.locator("#abort-reason").fill("bad reward function")
    page.locator("#confirm-yes").click()
    expect(page.locator(".toast.ok")).to_contain_text("Aborted train-7")
    assert extras.aborted == [("train-7", "bad reward function")]
    expect(train.locator("td").nth(2)).to_have_text("ABORTED")  # pushed by the live hub


def test_pools_and_engines_page(server: ServerThread, page: Page) -> None:
    page.goto(f"{server.url}/#/pools")
    pool = page.locator('tr[data-pool="sandbox"]')
    expect(pool).to_contain_text("71%")
    expect(pool.locator(".chip")).to_have_count(4)
    expect(pool.locator(".chip.i-busy")).to_have_count(2)
    expect(page.locator('tr[data-replica="llamacpp-0"]')).to_contain_text("3 / 4")
    shot(page, "pools")
