"""Every count, size and duration a caller sets is capped: a 422 naming the field, nothing written.

Against a real control plane (``rollfleet serve``'s parts, SQLite) over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollfleet.compose import control_plane_parts
from rollfleet.server.embedded import ServerThread


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with ServerThread(f"sqlite:///{tmp_path}/caps.db", parts=control_plane_parts()) as srv:
        yield srv.url


def refused(response: httpx.Response, field: str) -> None:
    """A 422 in the API's error shape whose message names ``field``."""
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "InvalidInput" and field in body["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"batch_id": "b", "tasks": [1], "repeat_times": 10**9}, "repeat_times"),
        (
            {"batch_id": "b", "tasks": list(range(1000)), "repeat_times": 1000},
            "tasks x repeat_times",
        ),
        ({"batch_id": "b", "tasks": [1], "config": {"heartbeat_s": 1e308}}, "heartbeat_s"),
        ({"batch_id": "b", "tasks": [1], "priority": 2**70}, "priority"),
    ],
)
def test_a_batch_over_a_cap_is_refused_and_nothing_is_queued(
    url: str, body: dict, field: str
) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        refused(http.post("/batches", json=body), field)
        assert http.get("/statistics").json()["total_rollouts"] == 0


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"heartbeat_s": 1e308}, "heartbeat_s"),
        ({"timeout_s": 1e12}, "timeout_s"),
        ({"max_attempts": 10**6}, "max_attempts"),
    ],
)
def test_a_rollout_whose_lease_could_never_lapse_is_refused(
    url: str, config: dict, field: str
) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        refused(http.post("/rollouts", json={"input": {}, "config": config}), field)
        refused(
            http.post("/rollouts/batch", json={"items": [{"input": {}, "config": config}]}), field
        )
        assert http.get("/statistics").json()["total_rollouts"] == 0


def test_a_worker_lease_is_capped(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        refused(http.post("/workers", json={"worker_id": "w", "lease_s": 1e308}), "lease_s")


@pytest.mark.parametrize("bad", ["a b", "a/b", "a\r\nb", "a%2Fb", "é", "x" * 201])
def test_caller_ids_follow_one_grammar(url: str, bad: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        refused(http.post("/rollouts", json={"input": {}, "rollout_id": bad}), "rollout_id")
        refused(http.post("/batches", json={"batch_id": bad, "tasks": [1]}), "batch_id")
        refused(http.post("/workers", json={"worker_id": bad}), "worker_id")


async def test_an_id_cannot_smuggle_a_second_request(url: str) -> None:
    from rollfleet.client import HttpStore
    from rollfleet.errors import NotFound
    from rollfleet.model import RolloutStatus

    store = HttpStore(url)
    try:
        victim = await store.enqueue_rollout({"q": 1})
        smuggle = f"x/cancel HTTP/1.1\r\nhost: h\r\n\r\nPOST /rollouts/{victim.rollout_id}/cancel"
        with pytest.raises(NotFound):
            await store.get_rollout(smuggle)
        with pytest.raises(NotFound):
            await store.cancel(smuggle)
        assert (await store.get_rollout(victim.rollout_id)).status is RolloutStatus.QUEUING
    finally:
        await store.close()
