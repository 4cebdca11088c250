"""Weights from a trainer into the running llama.cpp engine: export time and the generation pause.

The bundled SmolLM2-135M is loaded once as a transformers model (dequantized, float32: what a
trainer holds) and its state_dict is pushed with ``LlamaCppEngine.update_weights``, ROUNDS times
per output type, first on an idle engine (export, drain and swap as the engine times them), then
under load: CLIENTS loops stream 32-token requests back to back, every token is timestamped,
and the longest stretch without any token while the update runs is the pause a rollout sees
(against the longest one in the same time before the update). Run: ``python -m bench llamacpp_weights``.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import table, write_results
from rollfleet.engines.base import Delta, GenerationRequest, SamplingParams
from rollfleet.engines.llamacpp.engine import LlamaCppEngine
from rollfleet.engines.llamacpp.model import bundled_gguf

ROUNDS, CLIENTS = 3, 4


def trainer_state() -> dict[str, Any]:
    """The bundled model as transformers loads it."""
    from transformers import AutoModelForCausalLM

    path = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return dict(model.state_dict())


async def idle(engine: LlamaCppEngine, state: dict[str, Any]) -> dict[str, list[float]]:
    """export / drain / swap seconds of ROUNDS updates with nothing running."""
    runs: dict[str, list[float]] = {"export": [], "drain": [], "swap": []}
    for _ in range(ROUNDS):
        await engine.update_weights(state.items())
        assert engine.last_update is not None
        for key in runs:
            runs[key].append(getattr(engine.last_update, key))
    return runs


async def loaded(engine: LlamaCppEngine, state: dict[str, Any]) -> dict[str, float]:
    """One update while CLIENTS loops generate; the longest gaps between any two tokens."""
    stamps: list[float] = []
    stop = asyncio.Event()

    async def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            params = SamplingParams(max_tokens=32, temperature=0.8, seed=n, ignore_eos=True)
            request = GenerationRequest(prompt=f"Story {i}.{n}: once upon a time", params=params)
            async for item in engine.stream(request):
                if isinstance(item, Delta):
                    stamps.append(time.perf_counter())
            n += 1

    tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    await asyncio.sleep(4)  # warm: every client has run a few requests
    quiet_from = time.perf_counter()
    await asyncio.sleep(6)
    began = time.perf_counter()
    await engine.update_weights(state.items())
    ended = time.perf_counter()
    await asyncio.sleep(2)
    stop.set()
    await asyncio.gather(*tasks)
    assert engine.last_update is not None

    def longest_gap(start: float, end: float) -> float:
        inside = [t for t in stamps if start <= t <= end]
        return max((b - a for a, b in zip(inside, inside[1:], strict=False)), default=0.0)

    def rate(start: float, end: float) -> float:
        return sum(start <= t <= end for t in stamps) / (end - start)

    export_end = began + engine.last_update.export
    return {
        "update_s": ended - began,
        "export_s": engine.last_update.export,
        "drain_s": engine.last_update.drain,
        "swap_s": engine.last_update.swap,
        "longest_gap_during_update_s": longest_gap(began, ended + 1.0),
        "longest_gap_before_s": longest_gap(quiet_from, began),
        "tokens_per_s_before": rate(quiet_from, began),
        "tokens_per_s_during_export": rate(began, export_end),
    }


async def measure(state: dict[str, Any], cache: Path) -> dict[str, Any]:
    """Idle and loaded figures for f16 and q8_0."""
    figures: dict[str, Any] = {}
    for out_type in ("f16", "q8_0"):
        engine = LlamaCppEngine(slots=8, export_type=out_type, cache_dir=cache)
        await engine.start()
        try:
            figures[out_type] = {
                "idle": await idle(engine, state),
                "loaded": await loaded(engine, state),
            }
        finally:
            await engine.stop()
    return figures


def main() -> dict[str, Any]:
    """Measure, print a table, write bench/results/llamacpp_weights.json."""
    state = trainer_state()
    with tempfile.TemporaryDirectory() as cache:
        figures = asyncio.run(measure(state, Path(cache)))
    rows = []
    for out_type, f in figures.items():
        idle_runs, load = f["idle"], f["loaded"]
        rows.append(
            [
                out_type,
                f"{statistics.median(idle_runs['export']):.2f} [{min(idle_runs['export']):.2f}-{max(idle_runs['export']):.2f}]",
                f"{statistics.median(idle_runs['swap']):.2f} [{min(idle_runs['swap']):.2f}-{max(idle_runs['swap']):.2f}]",
                f"{load['export_s']:.2f} / {load['drain_s']:.2f} / {load['swap_s']:.2f}",
                f"{load['longest_gap_during_update_s']:.2f} (before: {load['longest_gap_before_s']:.2f})",
                f"{load['tokens_per_s_during_export']:.0f} (before: {load['tokens_per_s_before']:.0f})",
            ]
        )
    table(
        f"SmolLM2-135M state_dict into LlamaCppEngine ({ROUNDS} idle updates; 1 under {CLIENTS} clients)",
        [
            "type",
            "idle export s",
            "idle swap s",
            "loaded export/drain/swap s",
            "longest token gap s",
            "tokens/s while exporting",
        ],
        rows,
    )
    return write_results("llamacpp_weights", figures, "python -m bench llamacpp_weights")
