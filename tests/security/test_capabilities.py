"""An agent's ``ctx.llm`` key records to its own attempt and does nothing else.

The attack (issue 29): ``ctx.llm`` carried the operator's token and the rollout headers were not
checked, so an agent could write LLM steps with token ids and logprobs of its choosing into
another rollout (training rows), abort that rollout's calls, push weights and show any stored
image to the model. Each refusal below also checks that nothing changed.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import require

from rollfleet.client import HttpStore
from rollfleet.compose import EngineOptions, control_plane_parts
from rollfleet.engines.gateway.client import llm_client
from rollfleet.errors import Forbidden, Unauthorized
from rollfleet.model import Rollout, StepIn
from rollfleet.runner.process import llm_factory
from rollfleet.server.embedded import ServerThread
from rollfleet.web import capability

pytestmark = [pytest.mark.timeout(240), pytest.mark.llamacpp]
TOKEN = "operator-s3cret"
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def test_a_capability_names_one_attempt_and_expires() -> None:
    key = capability.capability_key(TOKEN)
    made = capability.mint(TOKEN, "r1", "a1", ttl_s=60, now=1000.0)
    assert TOKEN not in made and made.startswith(capability.PREFIX)
    granted = capability.verify(key, made, now=1059.0)
    assert (granted.rollout_id, granted.attempt_id) == ("r1", "a1")
    assert granted.bind(None, None) == ("r1", "a1")
    assert granted.bind("r1", "a1") == ("r1", "a1")
    with pytest.raises(Forbidden, match="records to rollout 'r1' attempt 'a1' only"):
        granted.bind("r2", None)
    with pytest.raises(Forbidden):
        granted.bind("r1", "a2")
    with pytest.raises(Unauthorized, match="expired"):
        capability.verify(key, made, now=1061.0)
    with pytest.raises(Unauthorized, match="wrong signature"):
        capability.verify(capability.capability_key("another token"), made, now=1000.0)


def test_a_forged_payload_is_refused() -> None:
    """Swapping the rollout in the payload (keeping the MAC) breaks the signature."""
    key = capability.capability_key(TOKEN)
    made = capability.mint(TOKEN, "r1", "a1", now=1000.0)
    _, mac = made[len(capability.PREFIX) :].split(".")
    forged = capability.mint("guess", "r2", "a2", now=1000.0).rsplit(".", 1)[0] + "." + mac
    with pytest.raises(Unauthorized, match="wrong signature"):
        capability.verify(key, forged, now=1000.0)
    for junk in ("rfcap1.", "rfcap1.x.y", "rfcap1." + "A" * 5000, "Bearer x"):
        with pytest.raises(Unauthorized):
            capability.verify(key, junk, now=1000.0)


def test_a_runner_gives_ctx_llm_a_capability_never_the_token() -> None:
    rollout = Rollout.model_validate(
        {
            "rollout_id": "ro-1",
            "input": {},
            "status": "running",
            "created_at": 0.0,
            "updated_at": 0.0,
            "attempt": {
                "attempt_id": "at-1",
                "rollout_id": "ro-1",
                "sequence": 1,
                "worker_id": "w1",
                "status": "running",
                "started_at": 0.0,
                "lease_expires_at": 30.0,
            },
        }
    )
    minted = llm_factory("http://127.0.0.1:9", TOKEN, None, mint=True)(rollout)
    granted = capability.verify(capability.capability_key(TOKEN), minted.api_key)
    assert (granted.rollout_id, granted.attempt_id) == ("ro-1", "at-1")
    plain = llm_factory("http://127.0.0.1:9", "sk-user", None)(rollout)  # a foreign server's key
    assert plain.api_key == "sk-user"


def _llama_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    from rollfleet.engines.llamacpp.model import bundled_gguf

    return bundled_gguf().exists()


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[tuple[str, HttpStore]]:
    """A control plane with the llama.cpp engine behind its gateway, token ``TOKEN``."""
    require(_llama_available(), "llama-cpp-python and the bundled SmolLM2 model")
    server = ServerThread(
        f"sqlite:///{tmp_path}/c.db",
        token=TOKEN,
        parts=control_plane_parts(engine=EngineOptions("llamacpp", token=TOKEN)),
    ).start(timeout=120)
    store = HttpStore(server.url, token=TOKEN)
    try:
        yield server.url, store
    finally:
        await store.close()
        server.stop()


async def _two_running(store: HttpStore) -> tuple[Rollout, Rollout]:
    await store.enqueue_rollout({"task": "mine"}, "math")
    await store.enqueue_rollout({"task": "theirs"}, "math")
    mine, theirs = await store.claim("w1", max_n=2)
    return mine, theirs


def _key(rollout: Rollout) -> str:
    assert rollout.attempt is not None
    return capability.mint(TOKEN, rollout.rollout_id, rollout.attempt.attempt_id)


async def _steps(store: HttpStore, rollout: Rollout) -> list[Any]:
    return (await store.query_steps(rollout.rollout_id)).items


async def test_an_agent_cannot_write_another_rollouts_training_rows(
    plane: tuple[str, HttpStore],
) -> None:
    url, store = plane
    mine, theirs = await _two_running(store)
    assert mine.attempt is not None and theirs.attempt is not None
    key = _key(mine)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        auth = {"authorization": f"Bearer {key}"}
        other = {"X-Rollfleet-Rollout": theirs.rollout_id}
        by_header = await http.post("/v1/chat/completions", json=CHAT, headers={**auth, **other})
        path = f"/r/{theirs.rollout_id}/{theirs.attempt.attempt_id}/v1/chat/completions"
        by_path = await http.post(path, json=CHAT, headers=auth)
        for refused in (by_header, by_path):
            assert refused.status_code == 403, refused.text
            assert "records to rollout" in refused.json()["error"]["message"]
        assert await _steps(store, theirs) == [] and await _steps(store, mine) == []

        # the store's own routes (add_steps, abort, blobs) take the operator token only
        step = StepIn(kind="llm", payload={"completion_token_ids": [1, 2]}).model_dump()
        forged = await http.post(
            f"/attempts/{theirs.attempt.attempt_id}/steps", json={"steps": [step]}, headers=auth
        )
        assert forged.status_code == 401
        for method, route in (
            ("POST", f"/v1/rollfleet/abort/{theirs.rollout_id}"),
            ("PUT", "/v1/rollfleet/weights/2"),
            ("GET", "/v1/rollfleet/replicas"),
        ):
            answer = await http.request(method, route, headers=auth)
            assert answer.status_code == 403, (route, answer.text)
            assert "allows model calls only" in answer.text
        assert await _steps(store, theirs) == []

    # its own calls still work, through the OpenAI client, and land in its own attempt
    async with llm_client(url, mine.rollout_id, mine.attempt.attempt_id, token=key) as llm:
        reply = await llm.chat.completions.create(**CHAT, temperature=0)
    assert reply.choices[0].message.content is not None
    recorded = await _steps(store, mine)
    assert [(s.kind, s.attempt_id) for s in recorded] == [("llm", mine.attempt.attempt_id)]
    assert await _steps(store, theirs) == []


async def test_an_expired_or_foreign_key_records_nothing(plane: tuple[str, HttpStore]) -> None:
    url, store = plane
    mine, _ = await _two_running(store)
    assert mine.attempt is not None
    expired = capability.mint(TOKEN, mine.rollout_id, mine.attempt.attempt_id, ttl_s=-1)
    foreign = capability.mint("not the token", mine.rollout_id, mine.attempt.attempt_id)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for key, why in ((expired, "expired"), (foreign, "wrong signature")):
            answer = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}
            )
            assert answer.status_code == 401 and why in answer.text
    assert await _steps(store, mine) == []


async def test_a_capability_shows_only_its_rollouts_images(plane: tuple[str, HttpStore]) -> None:
    """Another rollout's stored screenshot is answered as if nobody had stored it."""
    url, store = plane
    mine, theirs = await _two_running(store)
    assert theirs.attempt is not None
    data_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    shown = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}}]}
    await store.add_steps(theirs.attempt.attempt_id, [StepIn(kind="llm", payload={"m": [shown]})])
    sha = hashlib.sha256(PNG).hexdigest()
    assert (await store.get_blob(sha)).data == PNG
    ref = {"type": "image_url", "image_url": {"url": f"rollfleet-blob:{sha}"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [ref]}]}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        as_mine = await http.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {_key(mine)}"}
        )
        as_theirs = await http.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {_key(theirs)}"}
        )
    assert as_mine.status_code == 400
    assert "holds no image" in as_mine.json()["error"]["message"]
    # the rollout that references it gets past the reference (to the text-only engine's refusal)
    assert as_theirs.status_code == 400
    assert "holds no image" not in as_theirs.json()["error"]["message"]
    assert await _steps(store, mine) == []
