"""Caller input the store cannot keep is a 4xx naming what is wrong, never a 500, and writes nothing.

Raw bodies (a JSON library would refuse to produce most of them) against a real control plane
(``rollfleet serve``'s parts, SQLite) over HTTP, on the hot routes and the FastAPI ones alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollfleet.compose import control_plane_parts
from rollfleet.server.embedded import ServerThread
from rollfleet.web.jsonbody import strict_json

JSON = {"content-type": "application/json"}
BAD_BODIES = [
    (b'{"input": {"x": 1e999}}', "infinity"),
    (b'{"input": Infinity}', "not valid JSON"),
    (b'{"input": NaN}', "not valid JSON"),
    (b'{"input": -Infinity}', "not valid JSON"),
    (
        b'{"input": {"x": 100000000000000000000000000000000}}',
        "input.x' holds an integer that does not fit 64 bits",
    ),
    (b'{"input": {"x": -9223372036854775809}}', "does not fit 64 bits"),
    (b'{"input": {"x": "\\ud800"}}', "surrogate"),
    (b'{"input": {"\\udfff": 1}}', "surrogate"),
    (b'{"input": ' + b"[" * 300 + b"]" * 300 + b"}", "JSON"),
    (b'{"input": 1, "metadata": {"k\\u0000": 1}}', "metadata.k"),
    (b'{"input": "a\\u0000b"}', "NUL"),
]


@pytest.fixture
def http(tmp_path: Path) -> Iterator[httpx.Client]:
    with ServerThread(f"sqlite:///{tmp_path}/inputs.db", parts=control_plane_parts()) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            yield client


def total(http: httpx.Client) -> int:
    return int(http.get("/statistics").json()["total_rollouts"])


@pytest.mark.parametrize(("body", "said"), BAD_BODIES)
def test_a_body_the_store_cannot_keep_is_refused_on_every_route(
    http: httpx.Client, body: bytes, said: str
) -> None:
    batch = b'{"items": [' + body + b"]}"
    for path, payload in (("/rollouts", body), ("/rollouts/batch", batch)):
        answer = http.post(path, content=payload, headers=JSON)
        assert 400 <= answer.status_code < 500, (path, answer.status_code, answer.text)
        assert (
            answer.json()["error"] == "InvalidInput"
            and said.lower() in answer.json()["message"].lower()
        ), answer.text
    assert total(http) == 0


def test_plain_but_unusual_values_are_kept_exactly(http: httpx.Client) -> None:
    value = {
        "big": 2**63 - 1,
        "unsigned": 2**64 - 1,
        "neg": -(2**63),
        "deep": [[[[1]]]],
        "text": "\\u0000 as text",
        "emoji": "\U0001f600",
        "float": 1.5e300,
    }
    made = http.post("/rollouts", json={"input": value}).json()
    assert http.get(f"/rollouts/{made['rollout_id']}").json()["input"] == value


@pytest.mark.parametrize("cursor", ["99999999999999999999999999", "-1", "x", "1e5"])
def test_a_cursor_this_store_never_returned_is_a_422(http: httpx.Client, cursor: str) -> None:
    for path in (
        "/rollouts",
        "/attempts",
    ):  # row-number cursors (a worker's cursor is an id: any string)
        answer = http.get(path, params={"cursor": cursor})
        assert answer.status_code == 422 and answer.json()["error"] == "InvalidInput", answer.text
    assert http.get("/workers", params={"cursor": cursor}).status_code == 200


@pytest.mark.parametrize(
    "body", [b"[]", b'"x"', b"1", b"null", b'{"reason": 5}', b'{"reason": NaN}']
)
def test_dashboard_actions_with_odd_bodies_are_422(http: httpx.Client, body: bytes) -> None:
    answer = http.post("/dashboard/api/batches/b1/abort", content=body, headers=JSON)
    assert answer.status_code == 422 and answer.json()["error"] == "InvalidInput", answer.text
    # a good body reaches the coordinator, which does not know the batch
    assert http.post("/dashboard/api/batches/b1/abort", json={"reason": "x"}).status_code == 404


def test_strict_json_accepts_what_it_should() -> None:
    assert strict_json(b'{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}
    assert strict_json(b'{"id": "1234567890123456789012345"}') == {
        "id": "1234567890123456789012345"
    }
