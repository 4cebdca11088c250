"""Write docs/benchmarks.md, every benchmark row, from bench/results/*.json (``python -m bench._report``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._common import median_range
from bench._report_cells import spread
from bench._rows_fleet import (
    ab_rows,
    chaos_rows,
    cluster_rows,
    dashboard_rows,
    e2e_rows,
    envs_rows,
    fleet_rows,
    pool_rows,
    run_rows,
    sandbox_rows,
    store_rows,
    straggler_rows,
    wire_rows,
)
from bench._rows_model import (
    capability_rows,
    engine_rows,
    hf_batching_rows,
    llama_server_rows,
    llamacpp_weights_rows,
    multimodal_rows,
    tool_calls_rows,
    train_agent_rows,
    train_rows,
    train_sched_rows,
    train_step_rows,
    train_threads_rows,
    train_vs_trl_rows,
    weights_delta_rows,
    weights_rows,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def load(name: str) -> dict[str, Any] | None:
    """One results file, or None when that benchmark has not run."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _median(values: list[Any]) -> float | None:
    """The median of ``values``, None when any is missing."""
    if not values or any(v is None for v in values):
        return None
    return median_range(values)["median"]


def resume_rows(d: dict[str, Any]) -> list[str]:
    """Turn-level resume against restart-from-scratch under the same kills (bench/resume.py)."""
    st, sides, goals = d["settings"], d["sides"], d["goals"]
    res, rst = sides["resume"], sides["restart"]
    runs = (
        f"{st['rollouts']} ten-turn rollouts, each turn a real model call (the bundled SmolLM2-135M "
        f"on llama.cpp, {st['max_tokens']} tokens), {st['runners']} runners x {st['concurrency']}, "
        f"a runner SIGKILLed every ~{st['kill_mean_s']:.0f} s (random, the same schedule for both "
        f"sides) and the server restarted once; median [range] of {st['rounds']} alternating rounds"
    )
    share = res["regenerated_share"]["median"]
    per_round = ", ".join(f"{w:.2f}" for w in d["wall_ratio_per_round"]["rounds"])
    cpu, prefilled = (
        [_median([r.get("engine", {}).get(key) for r in side["rounds"]]) for side in (res, rst)]
        for key in ("cpu_s", "prefilled_tokens")
    )
    kills = " vs ".join(
        "–".join(str(k) for k in (min(s["kills"]), max(s["kills"]))) for s in (res, rst)
    )
    every = f"one every ~{st['kill_mean_s']:.0f} s of the run"
    why_wall = f"; per round {per_round}; kills a round {kills} ({every})"
    if None not in cpu and None not in prefilled:  # what the engine, busy throughout, did
        why_wall += (
            f"; the engine's CPU {cpu[0]:.0f} s vs {cpu[1]:.0f} s: the tokens it generated and "
            f"the prompt tokens it prefilled ({prefilled[0]:,.0f} vs {prefilled[1]:,.0f})"
        )
    return [
        f"| resume | completion tokens generated per finished rollout, resumed by turn vs restarted "
        f"from scratch: {runs}; regenerated: {share:.1%} (goal ≤ "
        f"{goals['regenerated_share_max']:.0%}) vs {rst['regenerated_share']['median']:.1%}"
        f"; failed: {sum(res['failed'])} / {sum(rst['failed'])} | "
        f"{spread(res['tokens_per_rollout'])} | {spread(rst['tokens_per_rollout'])} (restart) | "
        f"{d['tokens_resume_vs_restart']:.2f}× |",
        f"| resume | wall s, enqueue to the last rollout finished, the same runs{why_wall} | "
        f"{spread(res['seconds'], 0)} | {spread(rst['seconds'], 0)} (restart) | "
        f"{d['wall_resume_vs_restart']:.2f}× (goal ≤ {goals['wall_ratio_max']}×) |",
        f"| resume | model calls repeated (beyond the first for a rollout's turn), the same runs | "
        f"{spread(res['calls_repeated'], 0)} | {spread(rst['calls_repeated'], 0)} (restart) | "
        f"{res['calls_repeated']['median'] / max(1.0, rst['calls_repeated']['median']):.2f}× |",
    ]


def adapter_sync_rows(d: dict[str, Any]) -> list[str]:
    """A step's weights sync under LoRA: the adapter against the merged q/v (bench/adapter_sync.py)."""
    a, m = d["adapter"], d["merged"]
    return [
        f"| adapter sync | seconds per push under LoRA r={d['lora_rank']} on q/v, the bundled "
        f"SmolLM2 on llama.cpp: the adapter applied at run time ({a['mb']:.1f} MB) vs the merged "
        f"q/v delta ({m['mb']:.1f} MB, a GGUF written and loaded); median [range] of "
        f"{d['rounds']} alternating rounds (goal ≤ 0.2 s) | {spread(a['seconds'], 3)} | "
        f"{spread(m['seconds'], 2)} (merged) | {d['speedup']:.0f}× faster |",
    ]


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
    ("store_throughput", store_rows),
    ("end_to_end", e2e_rows),
    ("pool", pool_rows),
    ("engines", engine_rows),
    ("capability", capability_rows),
    ("tool_calls", tool_calls_rows),
    ("hf_batching", hf_batching_rows),
    ("stragglers", straggler_rows),
    ("dashboard", dashboard_rows),
    ("cluster", cluster_rows),
    ("run", run_rows),
    ("weights", weights_rows),
    ("llamacpp_weights", llamacpp_weights_rows),
    ("llama_server", llama_server_rows),
    ("weights_delta", weights_delta_rows),
    ("wire_parse", wire_rows),
    ("refactor_ab", ab_rows),
    ("sandbox", sandbox_rows),
    ("train_sched", train_sched_rows),
    ("train_step", train_step_rows),
    ("train", train_rows),
    ("train_threads", train_threads_rows),
    ("train_agent", train_agent_rows),
    ("train_vs_trl", train_vs_trl_rows),
    ("chaos", chaos_rows),
    ("resume", resume_rows),
    ("adapter_sync", adapter_sync_rows),
    ("fleet", fleet_rows),
    ("multimodal", multimodal_rows),
    ("envs", envs_rows),
]


def table() -> str:
    """The markdown table, from whatever results exist."""
    lines = ["| area | figure | rollfleet | peer / baseline | ratio |", "|---|---|---|---|---|"]
    for name, rows in SECTIONS:
        data = load(name)
        if data is not None:
            try:
                lines += rows(data)
            except (KeyError, TypeError, ZeroDivisionError) as exc:
                lines.append(f"| {name} | (results file has an unexpected shape: {exc!r}) | | | |")
    return "\n".join(lines)


HEADER = """\
<!-- Generated by `python -m bench._report` from bench/results/*.json: edit bench/_report.py, not this file. -->

# Benchmarks

Every row of every benchmark, those where a peer or the baseline wins included. This page is
generated: `python -m bench._report` writes it from `bench/results/*.json`, which `make bench`
writes (the peers come from `make peers`).

How to read it:

- Everything ran on one 2-core machine with no GPU, shared with other work. Absolute figures move
  with the day and the load, so compare within a row: each row's sides ran in one run, most of
  them in alternating rounds (A B, then B A), and a ratio never mixes runs.
- `median [min–max]` is over the rounds a row names.
- The `peer / baseline` column says what was measured against: a peer project (Agent Lightning,
  RLinf, TRL, llama.cpp's own server), the loop a user would write without rollfleet, or the same
  code before a change.
- A ratio is rollfleet over the other side, for whatever the row counts: above 1 is better
  where more is better (throughput), below 1 where less is better (bytes, tokens, seconds).
  Rows where rollfleet loses are listed like the others; the notes under the table say why.
"""

NOTES = """\
## Why some rows lose

- **store, in-process, one at a time**: a durable write (SQLite with its WAL synced to disk)
  against a Python dict in memory. That gap is the price of surviving `kill -9` and a power cut;
  over HTTP, and batched, the durable store wins ([store](store.md)).
- **weights, push against an in-memory copy**: the copy is the limit no push can pass. A push to
  another process is the trainer's copy and XXH3 pass into a sealed memfd, then the gateway's
  mapping of it (a page fault a page) and its own XXH3 pass; the engine serves the tensors from
  the mapping, without a copy. Writing a memfd (`pwrite`, one page at a time in the kernel) is
  slower than a plain copy, so the trainer's part alone takes more than two in-memory copies; the
  row gives the split ([weight sync](engines/weights.md)).
- **weights, tokens/s kept under swaps**: `drain` waits for running generations before each swap
  (fewer, later swaps: staler data), `abort` throws the tokens in flight away, and `interruptible`
  recomputes the KV cache of running rows and goes on ([transformers](engines/hf.md#weights)).
- **engines against llama-server**: the engine computes a log-probability for every token (a
  rollout needs them), the server none. `llama-batched-bench` on the same file bounds what any
  scheduler can reach on these two cores ([llama.cpp](engines/llamacpp.md)).
- **client, against bare httptools**: the client bounds and checks every answer it reads.
- **sandbox, the judge against a plain test run**: the judge runs under bubblewrap and computes
  every test itself, so a solution cannot forge its own result; the plain run it replaced could be
  forged ([security](security.md)).
- **chaos, throughput under kills**: a runner killed every few seconds and a server restart cost
  throughput against the same run without kills; the row's count of failed and doubly completed
  rollouts is the point ([store](store.md)).
- **before/after rows**: the same benchmark on this code and on an earlier commit; a ratio near 1
  says a change cost nothing measurable.
- **train, asynchronous against synchronous**: generating during training hides the wait for a
  batch, but on two cores the generation it hides slows the training beside it
  ([training](train.md#synchronous-or-asynchronous-on-this-machine)).
"""


def page() -> str:
    """The whole of docs/benchmarks.md."""
    return f"{HEADER}\n{table()}\n\n{NOTES}"


def main() -> None:
    """Write docs/benchmarks.md."""
    text = page()
    (ROOT / "docs" / "benchmarks.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
