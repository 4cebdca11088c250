"""Continuous batching on the HF engine vs a plain transformers loop: ``python -m bench hf_batching``.

The workload is what a fleet sends the policy during an RL step: requests arriving one after
another (every ``GAP_S``) with different lengths (``LENGTHS`` tokens, cycled), greedy, EOS
ignored so both sides produce exactly the requested tokens. The model has SmolLM2-135M's shape
(random weights: the compute is what matters), as ``rollfleet train --engine hf`` serves it.

- rollfleet: :class:`~rollfleet.engines.hf.engine.HFEngine` (``max_batch=8``): a request joins the
  running batch at the next decode step and leaves it when done.
- baseline, what a user writes without rollfleet: a thread that takes whatever has arrived (up
  to 8), left-pads it and calls ``model.generate`` for the longest of them; requests that arrive
  meanwhile wait for that call to end (static batching, as the HF engine itself did before).

Rounds alternate A B A B A B; each side's figures are medians with their range: the time from
the first arrival to the last completion, the mean latency (arrival to completion) and tokens/s.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from typing import Any

from bench._common import median_range, table, write_results
from bench.weights import smollm2_135m

COMMAND = "python -m bench hf_batching"
ROUNDS, REQUESTS, GAP_S, MAX_BATCH = 3, 24, 0.15, 8
LENGTHS = (16, 96, 32, 64, 128, 24)


def workload() -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, max tokens) of each request."""
    lengths = itertools.cycle(LENGTHS)
    return [
        (i * GAP_S, [1 + (i * 7 + j) % 500 for j in range(20 + i % 5)], next(lengths))
        for i in range(REQUESTS)
    ]


async def rollfleet_side(engine: Any) -> tuple[list[float], list[list[int]]]:
    """Each request sent at its arrival time; its latency and tokens."""
    from rollfleet.engines.base import GenerationRequest, SamplingParams

    start = time.perf_counter()

    async def one(arrival: float, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        sent = time.perf_counter()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        out = await engine.generate(GenerationRequest(prompt=prompt, params=params))
        return time.perf_counter() - sent, list(out.completion_token_ids)

    done = await asyncio.gather(*(one(*r) for r in workload()))
    return [d[0] for d in done], [d[1] for d in done]


def baseline_side(model: Any) -> tuple[list[float], list[list[int]]]:
    """Static batching with ``model.generate``: whatever has arrived runs to its longest."""
    import torch

    requests = workload()
    start = time.perf_counter()
    latencies: list[float] = [0.0] * len(requests)
    tokens: list[list[int]] = [[] for _ in requests]
    nxt = 0
    while nxt < len(requests):
        now = time.perf_counter() - start
        if requests[nxt][0] > now:
            time.sleep(requests[nxt][0] - now)  # nothing has arrived: wait for the next one
            now = time.perf_counter() - start
        batch = [i for i in range(nxt, len(requests)) if requests[i][0] <= now][:MAX_BATCH]
        nxt = batch[-1] + 1
        width = max(len(requests[i][1]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            prompt = requests[i][1]
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(requests[i][2] for i in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,  # EOS ignored, as on the other side
                do_sample=False,
                pad_token_id=0,
            )
        ended = time.perf_counter() - start
        for row, i in enumerate(batch):
            latencies[i] = ended - requests[i][0]
            tokens[i] = out[row, width : width + requests[i][2]].tolist()
    return latencies, tokens


def figures(latencies: list[float]) -> dict[str, float]:
    """Makespan, mean latency and tokens/s of one side's round."""
    requests = workload()
    makespan = max(r[0] + lat for r, lat in zip(requests, latencies, strict=True))
    total = sum(r[2] for r in requests)
    return {
        "makespan_s": makespan,
        "mean_latency_s": statistics.fmean(latencies),
        "tokens_per_s": total / makespan,
    }


async def run() -> dict[str, Any]:
    """Alternating rounds of both sides on one model."""
    from rollfleet.engines.hf.engine import HFEngine

    model, tokenizer = smollm2_135m()
    engine = HFEngine(model, tokenizer, max_batch=MAX_BATCH)
    await engine.start()
    sides: dict[str, list[dict[str, float]]] = {"rollfleet": [], "baseline": []}
    same: list[int] = []  # requests with the same greedy tokens on both sides, per round
    try:
        await rollfleet_side(engine)  # warm-up: first calls allocate
        for _ in range(ROUNDS):
            lat, ours = await rollfleet_side(engine)
            sides["rollfleet"].append(figures(lat))
            lat, theirs = await asyncio.to_thread(baseline_side, model)
            sides["baseline"].append(figures(lat))
            same.append(sum(a == b for a, b in zip(ours, theirs, strict=True)))
    finally:
        await engine.stop()
    out: dict[str, Any] = {
        "workload": {
            "requests": REQUESTS,
            "gap_s": GAP_S,
            "lengths": list(LENGTHS),
            "max_batch": MAX_BATCH,
            "model": "SmolLM2-135M shape, random weights, fp32, CPU",
        },
        "rounds": ROUNDS,
        "same_tokens": f"{min(same)} of {REQUESTS}",
    }
    for side, rounds in sides.items():
        out[side] = {key: median_range([r[key] for r in rounds]) for key in rounds[0]}
    out["makespan_speedup"] = (
        out["baseline"]["makespan_s"]["median"] / out["rollfleet"]["makespan_s"]["median"]
    )
    out["latency_speedup"] = (
        out["baseline"]["mean_latency_s"]["median"] / out["rollfleet"]["mean_latency_s"]["median"]
    )
    return out


def main() -> dict[str, Any]:
    """Run the benchmark, print a table and write bench/results/hf_batching.json."""
    out = asyncio.run(run())
    rows = [
        [
            key,
            f"{out['rollfleet'][key]['median']:.2f}",
            f"{out['baseline'][key]['median']:.2f}",
        ]
        for key in ("makespan_s", "mean_latency_s", "tokens_per_s")
    ]
    table(
        "HF engine: continuous batching vs model.generate",
        ["figure", "rollfleet", "baseline"],
        rows,
    )
    return write_results("hf_batching", out, COMMAND)


if __name__ == "__main__":
    main()
