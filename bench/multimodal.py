"""Image delta on the HF vision engine (``python -m bench multimodal``).

Latency (:func:`latency`): an agent's 5-turn screenshot conversation, resent whole every turn
with one new screenshot (as agents do), on a tiny random VLM built from a config (Idefics3,
SmolVLM's architecture, no weights to download), greedy, 8 new tokens a turn. Side A keeps the
image-delta cache (each screenshot encoded once), side B has none (every screenshot of the
conversation encoded again each turn). Rounds alternate A B A B A B, each round on a fresh
cache; figures are medians with their range. Writes ``bench/results/multimodal.json`` under
``latency`` (other measurements add their own keys to ``figures`` in :func:`main`).

Storage (:func:`storage`): the same kind of conversation (1280x720 PNG screenshots drawn with
Pillow, one new per turn, every LLM step carrying the whole conversation) recorded through a real
SQLite store, which keeps each image once by content; against the bytes the same steps take
inline as base64 (what the steps table held before). Bytes are deterministic: no rounds.
"""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

from bench._common import median_range, table, write_results

COMMAND = "python -m bench multimodal"
ROUNDS = 3
TURNS = 5
NEW_TOKENS = 8
CACHE_BYTES = 256 * 1024 * 1024
# a bigger vision tower than the tests' so that encoding weighs as it does in real VLMs:
# 64-pixel tiles in 8-pixel patches, 4 layers of width 128; a screenshot is 2x2 tiles + a view
VLM = {"tile": 64, "patch": 8, "vision_hidden": 128, "vision_layers": 4}
SCREEN = (128, 96)


def _screenshot(turn: int) -> bytes:
    """A distinct screenshot-like PNG per turn: a window, a title bar, a moving button."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", SCREEN, (236, 236, 236))
    draw = ImageDraw.Draw(image)
    draw.rectangle((6, 6, 121, 89), fill=(255, 255, 255), outline=(90, 90, 90))
    draw.rectangle((6, 6, 121, 16), fill=(40, 80, 160))
    draw.rectangle((12 + 18 * turn, 40, 30 + 18 * turn, 52), fill=(200, 60 + 30 * turn, 60))
    draw.text((14, 60), f"step {turn}", fill=(0, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _conversation(turns: int) -> list[dict[str, Any]]:
    from rollfleet.engines.images import image_part

    messages: list[dict[str, Any]] = [{"role": "system", "content": "You operate a desktop."}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"click({turn * 18}, 46)"})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Observation {turn}. Next action?"},
                    image_part(_screenshot(turn)),
                ],
            }
        )
    return messages


async def _one_conversation(engine: Any, cache_bytes: int) -> tuple[list[float], list[list[int]]]:
    """Per-turn seconds and tokens of one conversation on a fresh cache of ``cache_bytes``."""
    from rollfleet.engines.base import GenerationRequest, SamplingParams
    from rollfleet.engines.hf.vision import ImageCache

    engine.images, engine.encoder_calls = ImageCache(cache_bytes), 0
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seconds, tokens = [], []
    for turns in range(1, TURNS + 1):
        request = GenerationRequest(messages=_conversation(turns), params=params)
        started = time.perf_counter()
        result = await engine.generate(request)
        seconds.append(time.perf_counter() - started)
        tokens.append(result.completion_token_ids)
    return seconds, tokens


async def _latency() -> dict[str, Any]:
    from rollfleet.engines.hf.vision import HFVisionEngine
    from rollfleet.engines.tiny import tiny_vlm

    engine = HFVisionEngine(*tiny_vlm(**VLM), max_batch=1)
    await engine.start()
    sides = {"cached": CACHE_BYTES, "uncached": 0}
    runs: dict[str, list[list[float]]] = {side: [] for side in sides}
    calls: dict[str, int] = {}
    tokens: dict[str, list[list[int]]] = {}
    try:
        await _one_conversation(engine, CACHE_BYTES)  # warm-up: first calls allocate
        for _ in range(ROUNDS):
            for side, cache_bytes in sides.items():  # A B, A B, A B
                seconds, tokens[side] = await _one_conversation(engine, cache_bytes)
                runs[side].append(seconds)
                calls[side] = engine.encoder_calls
    finally:
        await engine.stop()
    per_turn = [
        {"turn": t + 1, **{side: median_range([r[t] for r in runs[side]]) for side in sides}}
        for t in range(TURNS)
    ]
    totals = {side: median_range([sum(r) for r in runs[side]]) for side in sides}
    return {
        "model": f"tiny random Idefics3 built from a config ({VLM}), screenshots {SCREEN}",
        "rounds": ROUNDS,
        "turns": TURNS,
        "new_tokens": NEW_TOKENS,
        "per_turn_s": per_turn,
        "conversation_s": totals,
        "encoder_calls": calls,
        "same_tokens": tokens["cached"] == tokens["uncached"],
        "last_turn_speedup": per_turn[-1]["uncached"]["median"] / per_turn[-1]["cached"]["median"],
        "conversation_speedup": totals["uncached"]["median"] / totals["cached"]["median"],
    }


def latency() -> dict[str, Any]:
    """Per-turn latency of the 5-turn screenshot conversation with and without image delta."""
    return asyncio.run(_latency())


def _screenshot(turn: int) -> bytes:
    """A 1280x720 PNG desktop stand-in: a window, a cursor and text that change each turn."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (1280, 720), (235, 238, 242))
    draw = ImageDraw.Draw(img)
    draw.rectangle(
        (80 + 20 * turn, 60, 900 + 20 * turn, 600), fill=(255, 255, 255), outline=(120, 120, 120)
    )
    for line in range(12):
        draw.text(
            (100 + 20 * turn, 80 + 40 * line),
            f"turn {turn} line {line}: the quick brown fox",
            fill=(20, 20, 20),
        )
    draw.ellipse((600 + 30 * turn, 400, 612 + 30 * turn, 412), fill=(200, 30, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def _stored_bytes(turns: int, trajectories: int) -> dict[str, Any]:
    """Bytes a real SQLite store keeps for screenshot conversations, against inline base64."""
    import base64
    import sqlite3
    import tempfile

    import orjson

    from rollfleet.model import StepIn
    from rollfleet.store import open_sql_store

    with tempfile.TemporaryDirectory() as tmp:
        store = open_sql_store(f"sqlite:///{tmp}/mm.db")
        inline = 0
        for t in range(trajectories):
            await store.enqueue_rollout({"task": t}, rollout_id=f"mm-{t}")
            attempt = (await store.claim("w"))[0].attempt.attempt_id
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                url = (
                    "data:image/png;base64,"
                    + base64.b64encode(_screenshot(turns * t + turn)).decode()
                )
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": f"turn {turn}"},
                            {"type": "image_url", "image_url": {"url": url}},
                        ],
                    }
                )
                payload = {"messages": list(messages), "text": "CLICK 100 200"}
                inline += len(orjson.dumps(payload))  # what the steps table held before
                await store.add_steps(attempt, [StepIn(kind="llm", payload=payload)])
        await store.close()
        with sqlite3.connect(f"{tmp}/mm.db") as conn:
            steps = conn.execute("SELECT SUM(LENGTH(payload)) FROM steps").fetchone()[0]
            blobs, count = conn.execute("SELECT SUM(size), COUNT(*) FROM blobs").fetchone()
    return {
        "turns": turns,
        "trajectories": trajectories,
        "images": count,
        "inline_base64_bytes_per_trajectory": inline / trajectories,
        "content_addressed_bytes_per_trajectory": (steps + blobs) / trajectories,
        "step_rows_bytes_per_trajectory": steps / trajectories,
        "ratio": inline / (steps + blobs),
    }


def storage() -> dict[str, Any]:
    """Bytes stored per trajectory of 5-turn screenshot conversations: by content vs inline."""
    return asyncio.run(_stored_bytes(TURNS, trajectories=4))


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1000:.0f} [{s['min'] * 1000:.0f}–{s['max'] * 1000:.0f}]"


def main() -> dict[str, Any]:
    """Measure; print a table and write bench/results/multimodal.json."""
    figures = {"latency": latency(), "storage": storage()}
    lat, st = figures["latency"], figures["storage"]
    rows = [
        [
            str(t["turn"]),
            _ms(t["cached"]),
            _ms(t["uncached"]),
            f"{t['uncached']['median'] / t['cached']['median']:.2f}×",
        ]
        for t in lat["per_turn_s"]
    ]
    rows.append(
        [
            "all 5",
            _ms(lat["conversation_s"]["cached"]),
            _ms(lat["conversation_s"]["uncached"]),
            f"{lat['conversation_speedup']:.2f}×",
        ]
    )
    table(
        f"per-turn latency, ms, median \\[range] of {ROUNDS} alternating rounds; encoder calls "
        f"{lat['encoder_calls']['cached']} vs {lat['encoder_calls']['uncached']}, same tokens: "
        f"{lat['same_tokens']}",
        ["turn", "image delta", "no cache", "ratio"],
        rows,
    )
    print(
        f"stored per trajectory: {st['content_addressed_bytes_per_trajectory'] / 1e3:,.0f} kB by content "
        f"vs {st['inline_base64_bytes_per_trajectory'] / 1e3:,.0f} kB inline base64 ({st['ratio']:.1f}x less)"
    )
    return write_results("multimodal", figures, COMMAND)


if __name__ == "__main__":
    main()
