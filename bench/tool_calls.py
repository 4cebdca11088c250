"""What reading tool calls adds to a gateway call, on the same texts with tools and without.

Three paths of one chat call, each timed on the same answers with the request offering 4 tools
(B) and offering none (A), alternating A B A B over ROUNDS rounds; medians of µs per call with
their range:
- ``request``: the body parsed and checked into a GenerationRequest (``parse_request``: with
  tools, their definitions are validated and capped, and the messages' tool calls checked);
- ``answer``: a finished Generation read for tool calls (``read_tool_calls``, B only), shaped as
  the chat completion (``Shaper.full``), serialised, and made into the Step's payload;
- ``stream``: the same text as deltas of 4 characters through ``Shaper.chunk`` (B holds back
  what may be a call), then the closing chunks (``Shaper.last``), each serialised as SSE.
The texts: a Hermes call, content then two calls, a 300-character plain answer, a malformed call.
Target (issue 30): at most 0.2 ms added per call. Run: ``python -m bench tool_calls``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from bench._common import median_range, table, write_results
from rollfleet.engines.base import Delta, FinishReason, Generation, GenerationRequest
from rollfleet.engines.gateway.gateway import step_payload
from rollfleet.engines.gateway.wire import Shaper, parse_request, sse
from rollfleet.engines.tool_calls import read_tool_calls

ROUNDS, N = 7, 2_000
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the agent's task",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search", "read_file", "run_tests", "submit")
]
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "flaky test", "limit": 5}}\n</tool_call>'
TEXTS = {
    "one call": CALL,
    "content, two calls": f"Let me look first.\n{CALL}\n{CALL.replace('search', 'read_file')}",
    "plain answer": "The tests fail because the fixture reuses a closed loop. " * 5,
    "malformed call": '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
}
MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "The CI is red; find out why."},
]


def bodies() -> dict[str, bytes]:
    """The request body without tools (A) and with them (B)."""
    return {
        "A": orjson.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 64}),
        "B": orjson.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 64, "tools": TOOLS}),
    }


def result(request: GenerationRequest, text: str) -> Generation:
    ids = list(range(len(text) // 4))
    return Generation(
        request.request_id, text, [1] * 40, ids, [-0.5] * len(ids), FinishReason.STOP, "e", "m", 0
    )


def answer_us(request: GenerationRequest, shaper: Shaper, text: str) -> float:
    """µs per finished call: read for calls, shaped, serialised, recorded."""
    g = result(request, text)
    started = time.perf_counter()
    for _ in range(N):
        item = read_tool_calls(request, g)
        orjson.dumps(shaper.full(item))
        step_payload(request, item, 0.1, "r-0")
    return (time.perf_counter() - started) / N * 1e6


def stream_us(request: GenerationRequest, body: Any, text: str) -> float:
    """µs per streamed call: 4-character deltas, then the closing chunks, as SSE."""
    g = read_tool_calls(request, result(request, text))
    deltas = [Delta(text[i : i + 4], (i,), (-0.5,)) for i in range(0, len(text), 4)]
    started = time.perf_counter()
    for _ in range(N):
        shaper = Shaper(request, body, False)
        for d in deltas:
            sse(shaper.chunk(d))
        for frame in shaper.last(g):
            sse(frame)
    return (time.perf_counter() - started) / N * 1e6


async def request_us(raw: bytes) -> float:
    """µs per request body parsed and checked."""
    started = time.perf_counter()
    for _ in range(N):
        await parse_request(raw, True, None)
    return (time.perf_counter() - started) / N * 1e6


async def measure() -> dict[str, dict[str, dict[str, list[float]]]]:
    """Every path and text, rounds alternating without tools (A) and with them (B)."""
    raw = bodies()
    parsed = {side: await parse_request(raw[side], True, None) for side in raw}
    runs: dict[str, dict[str, dict[str, list[float]]]] = {}

    def add(path: str, text: str, side: str, us: float) -> None:
        runs.setdefault(path, {}).setdefault(text, {"A": [], "B": []})[side].append(us)

    for _ in range(ROUNDS):
        for side in ("A", "B"):
            body, request, want = parsed[side]
            shaper = Shaper(request, body, want)
            add("request", "messages", side, await request_us(raw[side]))
            for name, text in TEXTS.items():
                add("answer", name, side, answer_us(request, shaper, text))
                add("stream", name, side, stream_us(request, body, text))
    return runs


def main() -> dict[str, Any]:
    """Run every pair and write bench/results/tool_calls.json."""
    runs = asyncio.run(measure())
    figures: dict[str, Any] = {"rounds": ROUNDS, "calls": N, "tools": len(TOOLS), "paths": {}}
    rows = []
    for path, texts in runs.items():
        for name, sides in texts.items():
            a, b = median_range(sides["A"]), median_range(sides["B"])
            added = b["median"] - a["median"]
            figures["paths"].setdefault(path, {})[name] = {"without": a, "with": b, "added": added}
            rows.append(
                [
                    path,
                    name,
                    f"{a['median']:.1f} [{a['min']:.1f}-{a['max']:.1f}]",
                    f"{b['median']:.1f} [{b['min']:.1f}-{b['max']:.1f}]",
                    f"{added:+.1f}",
                ]
            )
    figures["worst_added_us"] = max(
        pair["added"] for texts in figures["paths"].values() for pair in texts.values()
    )
    table(
        f"tool calls: µs per call, without tools / with {len(TOOLS)} tools (target: +200 µs)",
        ["path", "text", "without", "with tools", "added"],
        rows,
    )
    return write_results("tool_calls", figures, "python -m bench tool_calls")


if __name__ == "__main__":
    main()
