"""The dashboard's routes over HTTP against a real server and SQLite store: auth, assets, data, SSE."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollfleet.errors import InvalidInput
from rollfleet.model import AttemptStatus, RolloutResult, RolloutSpec
from rollfleet.server.dashboard import dashboard_router
from rollfleet.server.dashboard.views import History
from rollfleet.server.embedded import ServerThread
from rollfleet.server.parts import ServerParts
from rollfleet.store import open_sql_store

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Recorder:
    """Extras providers: one of each kind, one that fails, and abort_batch recording its calls."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    def pools(self) -> list[dict[str, Any]]:  # a sync provider works too
        return [{"name": "p", "size": 1}]

    async def engines(self) -> list[dict[str, Any]]:
        raise RuntimeError("gateway unreachable")

    async def abort_batch(self, batch_id: str, reason: str) -> dict[str, str]:
        self.aborted.append((batch_id, reason))
        return {"state": "ABORTED"}


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def server(tmp_path: Path, recorder: Recorder) -> Iterator[ServerThread]:
    extras = {
        "pools": recorder.pools,
        "engines": recorder.engines,
        "abort_batch": recorder.abort_batch,
    }
    parts = lambda store: ServerParts(routers=[("", dashboard_router(store, extras))])  # noqa: E731
    with ServerThread(f"sqlite:///{tmp_path / 'd.db'}", token=TOKEN, parts=parts) as srv:
        yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


def test_shell_and_assets_are_public_but_data_needs_the_token(http: httpx.Client) -> None:
    page = http.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/dashboard/assets/js/app.js" in page.text and "{{version}}" not in page.text
    js = http.get("/dashboard/assets/js/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert (
        http.get(
            "/dashboard/assets/js/app.js", headers={"if-none-match": js.headers["etag"]}
        ).status_code
        == 304
    )
    assert http.get("/dashboard/assets/nope.js").status_code == 404
    for path in (
        "/dashboard/api/rollouts",
        "/dashboard/api/overview",
        "/dashboard/api/events",
        "/dashboard/api/extras/pools",
        "/rollouts",
    ):
        denied = http.get(path)
        assert denied.status_code == 401, path
        assert denied.json()["error"] == "Unauthorized"
    assert http.get("/dashboard/api/rollouts", headers=AUTH).status_code == 200


def test_rollout_rows_are_slim_filtered_and_paged(server: ServerThread, http: httpx.Client) -> None:
    specs = [
        RolloutSpec(input={"big": "x" * 1000, "i": i}, mode="a" if i % 2 else "b") for i in range(7)
    ]
    body = {"items": [s.model_dump(mode="json") for s in specs]}
    made = http.post("/rollouts/batch", json=body, headers=AUTH).json()
    ids_a = [r["rollout_id"] for r in made if r["mode"] == "a"]
    first = http.get(
        "/dashboard/api/rollouts", params={"mode": "a", "limit": 2}, headers=AUTH
    ).json()
    assert [r["rollout_id"] for r in first["items"]] == ids_a[::-1][:2]  # newest first
    assert "input" not in first["items"][0] and first["items"][0]["status"] == "queuing"
    rest = http.get(
        "/dashboard/api/rollouts",
        params={"mode": "a", "limit": 2, "cursor": first["next_cursor"]},
        headers=AUTH,
    ).json()
    assert [r["rollout_id"] for r in rest["items"]] == ids_a[::-1][2:]
    assert rest["next_cursor"] is None
    found = http.get(
        "/dashboard/api/rollouts", params={"search": ids_a[0][:12]}, headers=AUTH
    ).json()["items"]
    assert ids_a[0] in [r["rollout_id"] for r in found]
    bad = http.get("/dashboard/api/rollouts", params={"status": "sleeping"}, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["error"] == "InvalidInput"


def test_extras_configured_missing_and_failing(http: httpx.Client, recorder: Recorder) -> None:
    assert http.get("/dashboard/api/extras/pools", headers=AUTH).json() == {
        "configured": True,
        "items": [{"name": "p", "size": 1}],
    }
    assert http.get("/dashboard/api/extras/batches", headers=AUTH).json() == {
        "configured": False,
        "items": None,
    }
    assert http.get("/dashboard/api/extras/gpus", headers=AUTH).status_code == 404
    aborted = http.post(
        "/dashboard/api/batches/b-1/abort", json={"reason": "bad data"}, headers=AUTH
    )
    assert aborted.json() == {"batch_id": "b-1", "result": {"state": "ABORTED"}}
    assert recorder.aborted == [("b-1", "bad data")]


def test_unknown_extras_key_is_refused(tmp_path: Path) -> None:
    store = open_sql_store(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(InvalidInput, match="unknown keys \\['batch'\\]"):
        dashboard_router(store, {"batch": lambda: []})


def _events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, json.loads(line[6:])


def test_event_stream_pushes_changes_without_polling(
    server: ServerThread, http: httpx.Client
) -> None:
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as client:
        with client.stream("GET", "/dashboard/api/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = _events(stream)
            kind, snap = next(events)
            assert kind == "snapshot" and snap["configured"]["pools"] is True
            assert snap["configured"]["batches"] is False
            assert snap["engines"] == {"error": "RuntimeError: gateway unreachable"}
            made = http.post(
                "/rollouts", json={"input": {"q": 1}, "mode": "sse"}, headers=AUTH
            ).json()
            state = dict(snap)  # updates carry only what changed: fold them into the page's state
            update = _until(events, lambda u: "rollouts" in u, state)
            assert [r["rollout_id"] for r in update["rollouts"]] == [made["rollout_id"]]
            if state["stats"]["rollouts"]["queuing"] != 1:  # the count may come in the next frame
                _until(events, lambda u: "stats" in u, state)
            assert state["stats"]["rollouts"]["queuing"] == 1
            http.post("/workers", json={"worker_id": "w1"}, headers=AUTH)
            claimed = http.post("/claims", json={"worker_id": "w1"}, headers=AUTH).json()[0]
            seen = _until(
                events, lambda u: any(w["status"] == "busy" for w in u.get("workers", []))
            )
            worker = next(w for w in seen["workers"] if w["worker_id"] == "w1")
            assert worker["current_rollouts"] == [made["rollout_id"]]
            attempt = claimed["attempt"]["attempt_id"]
            http.post(
                f"/attempts/{attempt}/complete",
                json={"status": "succeeded", "result": {"reward": 2.0}},
                headers=AUTH,
            )
            done = _until(
                events, lambda u: any(r["status"] == "succeeded" for r in u.get("rollouts", []))
            )
            assert done["rollouts"][0]["reward"] == 2.0
            series = done.get("series") or _until(events, lambda u: "series" in u)["series"]
            assert sum(series["succeeded"]) == 1
            assert [m for m in series["reward_mean"] if m is not None] == [2.0]


def _until(
    events: Iterator[tuple[str, dict[str, Any]]], cond: Any, state: dict[str, Any] | None = None
) -> dict[str, Any]:
    for _, update in events:
        if state is not None:
            state.update(update)
        if cond(update):
            return update
    raise AssertionError("stream ended")


def test_overview_counts_and_history(server: ServerThread, http: httpx.Client) -> None:
    overview = http.get("/dashboard/api/overview", headers=AUTH).json()
    assert overview["stats"]["total_rollouts"] == 0
    assert len(overview["series"]["t"]) == 60 and overview["series"]["failed_last_hour"] == 0


async def test_history_counts_each_finished_rollout_once(tmp_path: Path) -> None:
    store = open_sql_store(f"sqlite:///{tmp_path / 'h.db'}")
    for i in range(4):
        await store.enqueue_rollout({"i": i}, config={"max_attempts": 1})
    await store.register_worker("w")
    claimed = await store.claim("w", max_n=4)
    outcomes = [
        (AttemptStatus.SUCCEEDED, 1.0),
        (AttemptStatus.SUCCEEDED, 0.0),
        (AttemptStatus.FAILED, None),
    ]
    for r, (status, reward) in zip(claimed[:3], outcomes, strict=True):  # the 4th stays running
        assert r.attempt is not None
        result = None if reward is None else RolloutResult(reward=reward)
        await store.complete(
            r.attempt.attempt_id, status, result, "boom" if reward is None else None
        )
    rows = (await store.query_rollouts(limit=100)).items
    await store.close()
    history = History()
    assert history.add(rows, time.time()) is True
    assert history.add(rows, time.time()) is False  # the same rollouts again count nothing
    series = history.series(time.time())
    assert series["finished_last_hour"] == 3 and series["failed_last_hour"] == 1
    assert sum(series["succeeded"]) == 2
    buckets = history.buckets.values()
    assert sum(b["reward_sum"] for b in buckets) / sum(b["reward_n"] for b in buckets) == 0.5
    assert history.worker_rate("w", time.time()) == round(3 / 5, 3)


async def test_a_slow_viewer_gets_a_resync_instead_of_a_backlog() -> None:
    from rollfleet.server.dashboard.live import QUEUE_SIZE, Subscriber

    sub = Subscriber()
    for i in range(QUEUE_SIZE + 5):
        sub.put(f"frame {i}".encode())
    assert sub.stale is True
    assert sub.queue.qsize() == 1  # the backlog was dropped; the stream sends a fresh snapshot next


async def test_hub_over_a_store_that_cannot_list_changes_tells_pages_to_refetch(
    server: ServerThread,
) -> None:
    import asyncio

    from rollfleet.client import connect
    from rollfleet.server.dashboard.live import LiveHub, knows_updated_after

    store = connect(server.url, token=TOKEN)  # the HTTP client: no updated_after, no change signal
    assert not knows_updated_after(store)
    hub = LiveHub(store, {})
    try:
        async with hub.subscribe() as sub:
            assert hub.snapshot()["stats"]["total_rollouts"] == 0
            await store.enqueue_rollout({"q": 1})
            update: dict[str, Any] = {}
            while "stats" not in update:  # the charts' history may arrive first, in its own update
                frame = await asyncio.wait_for(sub.queue.get(), 10)
                assert frame is not None
                update = json.loads(frame.split(b"data: ", 1)[1])
            assert update["truncated"] is True and update["stats"]["total_rollouts"] == 1
    finally:
        await store.close()
