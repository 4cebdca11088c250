"""The HTTP service itself: error shapes, auth, docs, and no 500 for a caller's mistake."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollfleet.client import HttpStore
from rollfleet.errors import StoreUnavailable, Unauthorized
from rollfleet.model import AttemptStatus, Completion
from rollfleet.server.embedded import ServerThread
from rollfleet.web.serving import check_bind


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(f"sqlite:///{tmp_path}/s.db") as srv:
        yield srv


def test_errors_are_json_with_the_right_status(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url) as http:
        missing = http.get("/rollouts/nope")
        assert missing.status_code == 404 and missing.json()["error"] == "NotFound"
        bad = http.post("/rollouts", json={"mode": "math"})  # no input
        assert bad.status_code == 422 and "input" in bad.json()["message"]
        garbage = http.post(
            "/rollouts/batch", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert garbage.status_code == 422
        wrong_type = http.post("/claims", json={"worker_id": "w", "max_n": "many"})
        assert wrong_type.status_code == 422 and "max_n" in wrong_type.json()["message"]
        not_json = http.post(
            "/claims", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert not_json.status_code == 422 and not_json.json()["error"] == "InvalidInput"
        bad_item = http.post(
            "/attempts/complete", json={"items": [{"attempt_id": "a", "status": "exploded"}]}
        )
        assert bad_item.status_code == 422 and "items.0.status" in bad_item.json()["message"]
        bad_status = http.post("/attempts/x/complete", json={"status": "exploded"})
        assert bad_status.status_code == 422
        bad_cursor = http.get("/rollouts", params={"cursor": "zzz"})
        assert bad_cursor.status_code == 422
        http.post("/rollouts", json={"input": 1, "rollout_id": "r1"})
        http.post("/rollouts/r1/cancel")
        conflict = http.post("/rollouts/requeue", json={"statuses": ["cancelled"]})
        assert conflict.status_code == 422
        assert http.get("/docs").status_code == 200 and "/claims" in http.get("/openapi.json").text


async def test_token_is_required_when_set(tmp_path: Path) -> None:
    with ServerThread(f"sqlite:///{tmp_path}/s.db", token="s3cret") as srv:
        anonymous = HttpStore(srv.url)
        with pytest.raises(Unauthorized):
            await anonymous.statistics()
        with pytest.raises(
            Unauthorized
        ):  # the runner's own calls take a leaner route: still checked
            await anonymous.claim("w")
        with pytest.raises(Unauthorized):
            await anonymous.complete_many(
                [Completion(attempt_id="at-x", status=AttemptStatus.SUCCEEDED)]
            )
        await anonymous.close()
        authed = HttpStore(srv.url, token="s3cret")
        assert (await authed.statistics()).total_rollouts == 0
        await authed.close()


def test_public_bind_needs_a_token() -> None:
    with pytest.raises(StoreUnavailable, match="token"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "t")
    check_bind("127.0.0.1", None)


async def test_unreachable_server_is_a_clear_error() -> None:
    from support import free_port

    store = HttpStore(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        await store.statistics()
    await store.close()


async def test_a_claim_whose_client_hung_up_leases_nothing(server: ServerThread) -> None:
    import asyncio

    gone, alive = HttpStore(server.url), HttpStore(server.url)
    abandoned = asyncio.create_task(gone.claim("gone", wait_s=30))
    await asyncio.sleep(0.2)  # let the long-poll reach the server and start waiting
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await gone.close()
    await alive.enqueue_rollout("task", rollout_id="r1")
    got = await alive.claim("alive", wait_s=5)
    assert [r.rollout_id for r in got] == ["r1"] and got[0].attempt.worker_id == "alive"
    await alive.close()


async def test_hot_calls_are_served_in_front_of_fastapis_stack(tmp_path: Path) -> None:
    """The guard, then the lean hot routes, then FastAPI with the parts' middleware: a hot call
    never reaches that middleware, any other call does, and the guard refuses both."""
    from rollfleet.server.app import create_app
    from rollfleet.store import open_sql_store

    reached: list[str] = []

    class Recorder:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            reached.append(scope["path"])
            await self.app(scope, receive, send)

    store = open_sql_store(f"sqlite:///{tmp_path}/s.db")
    app = create_app(store, reaper_interval_s=None, middleware=[(Recorder, {})])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        assert (await http.post("/claims", json={"worker_id": "w"})).json() == []
        assert (await http.get("/health")).json() == {"status": "ok"}
        cross = await http.post(
            "/claims", json={"worker_id": "w"}, headers={"sec-fetch-site": "cross-site"}
        )
        assert cross.status_code == 403
    assert reached == ["/health"]
    await store.close()
