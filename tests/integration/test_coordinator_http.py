"""The coordinator over HTTP: its router in the control-plane app, and a coordinator on an HTTP Store."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollfleet.client import connect
from rollfleet.coordinator import (
    AbortResult,
    BatchInfo,
    BatchLifecycleState,
    CoordinatorClient,
    ExperienceStats,
    FinalizeResult,
    RolloutCoordinator,
    StragglerPolicy,
)
from rollfleet.coordinator.service import coordinator_router
from rollfleet.errors import Conflict, InvalidInput, NotFound
from rollfleet.model import AttemptStatus, RolloutResult
from rollfleet.server.app import create_app
from rollfleet.server.embedded import ServerThread
from rollfleet.server.parts import ServerParts
from rollfleet.store.base import Store


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[tuple[Any, Store]]:
    store = connect(f"sqlite:///{tmp_path}/rf.db")
    coord = RolloutCoordinator(store, experience_dir=tmp_path / "xp", poll_interval_s=0.05)
    yield (
        create_app(
            store, routers=[("/batches", coordinator_router(coord))], reaper_interval_s=None
        ),
        store,
    )
    await store.close()


@pytest.fixture
async def api(app: tuple[Any, Store]) -> AsyncIterator[tuple[httpx.AsyncClient, Store]]:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app[0]), base_url="http://rf"
    ) as client:
        yield client, app[1]


async def _complete_all(store: Store, reward: float) -> None:
    for r in await store.claim("w", max_n=100):
        assert r.attempt is not None
        await store.complete(
            r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=reward)
        )


async def test_router_submit_finalize_experiences_and_list(
    api: tuple[httpx.AsyncClient, Store],
) -> None:
    client, store = api
    resp = await client.post(
        "/batches", json={"batch_id": "s1", "tasks": [{"q": 1}, {"q": 2}], "repeat_times": 2}
    )
    assert resp.status_code == 200
    body = resp.json()
    assert body["state"] == "running" and body["rollout_statuses"] == {"queuing": 4}
    assert body["completed_task_count"] == 0 and body["policy"] == "carry_over"
    await _complete_all(store, 1.0)
    live = (await client.get("/batches/s1")).json()
    assert live["rollout_statuses"] == {"succeeded": 4} and live["completed_task_count"] == 2
    final = await client.post("/batches/s1/finalize", json={"timeout": 30})
    assert final.status_code == 200 and final.json()["finished_task_count"] == 2
    assert (await client.post("/batches/s1/finalize")).json() == final.json()
    got = (await client.get("/batches/s1")).json()
    assert got["state"] == "finalized" and got["completed_task_count"] == 2
    xp = await client.post("/batches/s1/experiences", json={})
    assert xp.status_code == 200 and xp.json()["experience_count"] == 4
    assert [b["batch_id"] for b in (await client.get("/batches")).json()] == ["s1"]


async def test_router_errors_are_404_409_422(api: tuple[httpx.AsyncClient, Store]) -> None:
    client, _ = api
    missing = await client.post("/batches/nope/finalize", json={})
    assert missing.status_code == 404 and missing.json()["error"] == "NotFound"
    bad = await client.post("/batches", json={"batch_id": "s1", "tasks": [1], "min_wait_num": 2})
    assert bad.status_code == 422 and "min_wait_num" in bad.json()["message"]
    assert (
        await client.post("/batches", json={"batch_id": "a/b", "tasks": [1]})
    ).status_code == 422
    assert (await client.post("/batches", json={"batch_id": "s1", "tasks": [1]})).status_code == 200
    again = await client.post("/batches", json={"batch_id": "s1", "tasks": [1]})
    assert again.status_code == 409 and again.json()["error"] == "Conflict"
    aborted = await client.post(
        "/batches/s1/abort", json={"reason": "operator", "keep_partial_results": True}
    )
    assert aborted.status_code == 200 and aborted.json()["aborted"] is True
    refused = await client.post("/batches/s1/finalize", json={})
    assert refused.status_code == 409 and "aborted" in refused.json()["message"]


async def test_answers_keep_their_json_field_names(api: tuple[httpx.AsyncClient, Store]) -> None:
    client, store = api
    made = (await client.post("/batches", json={"batch_id": "s1", "tasks": ["a"]})).json()
    assert list(made) == [
        "batch_id",
        "batch_type",
        "expected_task_count",
        "min_wait_num",
        "state",
        "final_result",
        "policy",
        "repeat_times",
        "created_at",
        "finished_at",
        "reason",
        "finalize_index",
        "carried_out",
        "max_staleness",
        "admitted_at",
        "completed_task_count",
        "rollout_statuses",
    ]
    await _complete_all(store, 1.0)
    final = (await client.post("/batches/s1/finalize", json={})).json()
    assert list(final) == [
        "batch_id",
        "batch_type",
        "finished_task_count",
        "expected_task_count",
        "policy",
        "rollout_count",
        "rollouts_by_status",
        "carried_in_task_count",
        "carried_out_task_count",
        "metrics",
    ]
    assert final["rollouts_by_status"] == {"succeeded": 1, "failed": 0, "cancelled": 0}
    xp = (await client.post("/batches/s1/experiences", json={})).json()
    assert list(xp)[:6] == [
        "batch_id",
        "path",
        "experience_count",
        "rollout_count",
        "group_count",
        "experiences_without_tokens",
    ]
    assert "metrics" not in xp and xp["advantage/mean"] == 0.0 and xp["staleness/max"] == 0.0
    await client.post("/batches", json={"batch_id": "s2", "tasks": ["b"]})
    aborted = (await client.post("/batches/s2/abort", json={"reason": "stop"})).json()
    assert list(aborted) == [*final, "aborted", "reason"] and aborted["reason"] == "stop"
    listed = (await client.get("/batches")).json()
    assert listed[0]["final_result"] == final and listed[1]["final_result"] == aborted


@pytest.mark.parametrize(
    "first, then, message",
    [
        ("finalize", "abort", "finalized already: it cannot be aborted"),
        ("abort", "finalize", "was aborted \\(operator\\): it cannot be finalized"),
    ],
)
async def test_an_illegal_batch_transition_is_a_409(
    api: tuple[httpx.AsyncClient, Store], first: str, then: str, message: str
) -> None:
    client, store = api
    await client.post("/batches", json={"batch_id": "s1", "tasks": ["a"]})
    await _complete_all(store, 1.0)
    body = {"reason": "operator"} if first == "abort" else {}
    assert (await client.post(f"/batches/s1/{first}", json=body)).status_code == 200
    state = (await client.get("/batches/s1")).json()["state"]
    refused = await client.post(
        f"/batches/s1/{then}", json={"reason": "operator"} if then == "abort" else {}
    )
    assert refused.status_code == 409 and refused.json()["error"] == "Conflict"
    assert re.search(message, refused.json()["message"])
    assert (await client.get("/batches/s1")).json()["state"] == state  # nothing changed


async def test_coordinator_client_mirrors_the_python_api(app: tuple[Any, Store]) -> None:
    client = CoordinatorClient("http://rf", transport=httpx.ASGITransport(app=app[0]))
    try:
        made = await client.submit_batch("s1", ["a", "b"], min_wait_num=1, policy="cancel")
        assert isinstance(made, BatchInfo) and made.rollout_statuses == {"queuing": 2}
        assert made.state is BatchLifecycleState.RUNNING and made.policy is StragglerPolicy.CANCEL
        await _complete_all(app[1], 0.5)
        result = await client.finalize_train_batch("s1", timeout=30)
        assert isinstance(result, FinalizeResult)
        assert result.finished_task_count == 2 and result.metrics["reward/mean"] == 0.5
        got = await client.get_batch("s1")
        assert got.state is BatchLifecycleState.FINALIZED and got.final_result == result
        assert [b.batch_id for b in await client.list_batches()] == ["s1"]
        stats = await client.process_experiences("s1")
        assert isinstance(stats, ExperienceStats) and stats.experience_count == 2
        assert stats.metrics["advantage/mean"] == 0.0  # a group of one: advantage 0
        with pytest.raises(NotFound, match="batch nope not found"):
            await client.finalize_eval_batch("nope")
        with pytest.raises(Conflict, match="finalized already"):
            await client.abort_batch("s1", reason="late")
        await client.submit_batch("s3", ["a"])
        aborted = await client.abort_batch("s3", reason="stop")
        assert (
            isinstance(aborted, AbortResult)
            and aborted.reason == "stop"
            and aborted.rollout_count == 0
        )
        with pytest.raises(InvalidInput, match="repeat_times"):
            await client.submit_batch("s2", ["a"], repeat_times=0)
    finally:
        await client.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """A real control plane on a port, with the coordinator mounted at /batches as `rollfleet serve` does."""

    def parts(store: Store) -> ServerParts:
        coordinator = RolloutCoordinator(
            store, experience_dir=tmp_path / "xp", poll_interval_s=0.05
        )
        return ServerParts(routers=[("/batches", coordinator_router(coordinator))])

    with ServerThread(f"sqlite:///{tmp_path}/srv.db", parts=parts) as srv:
        yield srv.url


async def test_coordinator_on_an_http_store(server: str) -> None:
    coord = RolloutCoordinator(server, poll_interval_s=0.05)
    await coord.prepare()
    worker = connect(server)
    try:
        await coord.submit_batch("s1", ["a", "b", "c"], min_wait_num=2)
        claimed = {
            r.rollout_id: r.attempt.attempt_id
            for r in await worker.claim("w", max_n=3)
            if r.attempt
        }
        for rid in ("s1:0:0", "s1:1:0"):
            await worker.complete(claimed[rid], AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0))
        result = await coord.finalize_train_batch("s1")
        assert result.finished_task_count == 2 and result.carried_out_task_count == 1
        assert (await worker.get_state("batch/s1"))["state"] == "finalized"
    finally:
        await worker.close()
        await coord.shutdown()


async def test_client_against_a_served_coordinator(server: str) -> None:
    client = CoordinatorClient(server)
    worker = connect(server)
    try:
        await client.submit_batch("ev", [{"q": 1}], "eval", repeat_times=2)
        for r in await worker.claim("w", max_n=2):
            assert r.attempt is not None
            await worker.complete(
                r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
            )
        result = await client.finalize_eval_batch("ev", timeout=30)
        assert result.metrics["mean@2"] == 1.0 and result.metrics["pass@2"] == 1.0
    finally:
        await worker.close()
        await client.close()
