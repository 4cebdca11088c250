"""Images in trajectories are stored once, by content, on every backend (issue 20)."""

from __future__ import annotations

import base64
import hashlib
import os

import orjson
import pytest

from rollfleet.model import StepIn
from rollfleet.store.blobs import image_refs, inline_images

pytestmark = pytest.mark.timeout(120)


def screenshot(turn: int) -> bytes:
    """A stand-in PNG of ~20 KB: the signature, then bytes no two turns share."""
    return b"\x89PNG\r\n\x1a\n" + hashlib.sha256(bytes([turn])).digest() + os.urandom(20_000)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def conversation(shots: list[bytes]) -> list[dict]:  # type: ignore[type-arg]
    """What an agent resends each turn: every screenshot so far, one user message each."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"turn {i}"},
                {"type": "image_url", "image_url": {"url": data_url(png)}},
            ],
        }
        for i, png in enumerate(shots)
    ]


async def test_a_five_turn_screenshot_conversation_stores_each_image_once(case) -> None:  # type: ignore[no-untyped-def]
    s = case.store
    await s.enqueue_rollout("desktop", rollout_id="r")
    attempt = (await s.claim("w1"))[0].attempt.attempt_id
    shots, sent = [], []
    for turn in range(5):
        shots.append(screenshot(turn))
        payload = {"messages": conversation(shots), "text": "click"}
        sent.append(payload)
        await s.add_steps(attempt, [StepIn(kind="llm", payload=payload)])
    stored = (await s.query_steps("r")).items
    assert len(stored) == 5
    for step, original in zip(stored, sent, strict=True):
        text = orjson.dumps(step.payload)
        assert b"base64" not in text and len(text) < 3_000  # references, not 20 KB images
        assert image_refs(step.payload) == [
            hashlib.sha256(p).hexdigest() for p in shots[: len(original["messages"])]
        ]
    blobs = {h: await s.get_blob(h) for h in image_refs(stored[-1].payload)}
    assert [blobs[h].data for h in image_refs(stored[-1].payload)] == shots
    assert all(b.media_type == "image/png" for b in blobs.values())
    assert inline_images(stored[2].payload, blobs.__getitem__) == sent[2]  # what the model was sent


async def test_an_unknown_blob_is_not_found_and_text_that_only_looks_like_an_image_stays_text(
    case,
) -> None:  # type: ignore[no-untyped-def]
    from rollfleet.errors import NotFound

    s = case.store
    with pytest.raises(NotFound):
        await s.get_blob("0" * 64)
    await s.enqueue_rollout("x", rollout_id="t")
    attempt = (await s.claim("w1"))[0].attempt.attempt_id
    fake = "data:image/png;base64,not base64 at all!"  # e.g. a model's reply: recorded as it is
    await s.add_steps(attempt, [StepIn(kind="llm", payload={"text": fake})])
    assert (await s.query_steps("t")).items[0].payload == {"text": fake}
    assert image_refs((await s.query_steps("t")).items[0].payload) == []  # no blob was made of it
