"""``rollfleet run`` against the loop a user would write without it: ``python -m bench run``.

Every side is one fresh command in a subprocess doing the same work: the 52 bundled math problems,
the bundled SmolLM2 GGUF, the same prompts, ``max_tokens`` 64, temperature 0.7. The sides run in
alternating rounds (A B C D, A B C D, ...), and the figures are medians over the rounds with
their range. Wall time is the whole command's, start-up included, as a user waits for it.

* naive loop: ``bench/_naive_loop.py``, one ``Llama`` and a for loop (llama-cpp-python), on the
  bundled Q4_1 file as a user would load it;
* naive loop on the Q8_0 copy rollfleet serves by default: the like-for-like row that shows
  what the file change alone is worth for one sequence at a time;
* rollfleet run, the README's demo: 8 rollouts at once in one runner process, sharing one
  llama.cpp engine (continuous batching, prefix cache, the Q8_0 copy) behind the gateway, a
  durable store;
* the demo with ``--keep-quant``: the same on the Q4_1 file as it is;
* rollfleet run with one rollout at a time: the like-for-like row for the loop;
* the seed's design: 4 runner processes, each with its own copy of the model
  (``--engine-per-runner``).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import PY, ROOT, median_range, table, write_results

COMMAND = "python -m bench run"
DATA = ROOT / "src" / "rollfleet" / "examples" / "math.jsonl"
TASKS, MAX_TOKENS, ROUNDS = 52, 64, 3
NAIVE = "naive loop (llama-cpp-python, Q4_1 file)"
NAIVE_Q8 = "naive loop on rollfleet's Q8_0 copy"
SIDES: dict[str, list[str]] = {
    NAIVE: [],
    NAIVE_Q8: [],
    "rollfleet run, 8 at once (demo)": ["--num-rollouts", "8"],
    "rollfleet run, 8 at once, --keep-quant (Q4_1)": ["--num-rollouts", "8", "--keep-quant"],
    "rollfleet run, 1 at a time": ["--num-rollouts", "1"],
    "4 runners, an engine per runner process": ["--num-rollouts", "4", "--engine-per-runner"],
}


def _rollfleet(extra: list[str], out: Path) -> dict[str, Any]:
    argv = [
        PY,
        "-m",
        "rollfleet.cli",
        "run",
        "--mode",
        "math",
        "--data",
        str(DATA),
        "--limit",
        str(TASKS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--output-dir",
        str(out),
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    summary = json.loads((out / "summary.json").read_text())
    tokens = summary["tokens"]["completion"]
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "succeeded": summary["counts"].get("succeeded", 0),
        "first_token_s": (summary.get("startup_s") or {}).get("first_token"),
    }


def _naive(model: Path) -> dict[str, Any]:
    argv = [PY, "-m", "bench._naive_loop", str(DATA), str(TASKS), str(MAX_TOKENS), str(model)]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, check=True)
    wall = time.perf_counter() - started
    report = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = report["completion_tokens"]
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "succeeded": TASKS,
        "first_token_s": None,
    }


def main() -> dict[str, Any]:
    """Alternate every side over ROUNDS rounds; print and write bench/results/run.json."""
    from rollfleet.engines.llamacpp.model import batch_friendly, bundled_gguf

    models = {NAIVE: bundled_gguf(), NAIVE_Q8: batch_friendly(bundled_gguf())}  # converted here
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    with tempfile.TemporaryDirectory(prefix="rollfleet-bench-run-") as tmp:
        for r in range(ROUNDS):
            for i, (name, extra) in enumerate(SIDES.items()):
                out = Path(tmp) / f"r{r}-s{i}"
                result = _naive(models[name]) if name in models else _rollfleet(extra, out)
                runs[name].append(result)
                print(
                    f"round {r + 1}/{ROUNDS} {name}: {result['wall_s']:.1f} s, "
                    f"{result['tokens_per_s']:.1f} tokens/s",
                    flush=True,
                )
    naive = NAIVE
    figures: dict[str, Any] = {}
    for name, results in runs.items():
        figures[name] = {
            "rounds": results,
            "wall_s": median_range([x["wall_s"] for x in results]),
            "tokens_per_s": median_range([x["tokens_per_s"] for x in results]),
        }
    for f in figures.values():
        f["tokens_per_s_vs_naive"] = (
            f["tokens_per_s"]["median"] / figures[naive]["tokens_per_s"]["median"]
        )
        f["wall_vs_naive"] = f["wall_s"]["median"] / figures[naive]["wall_s"]["median"]
    table(
        f"math mode, {TASKS} tasks, max {MAX_TOKENS} tokens, {ROUNDS} alternating rounds: median [range]",
        ["side", "wall s", "tokens/s", "tokens/s vs naive", "wall vs naive"],
        [
            [
                name,
                f"{f['wall_s']['median']:.1f} [{f['wall_s']['min']:.1f}-{f['wall_s']['max']:.1f}]",
                f"{f['tokens_per_s']['median']:.1f} [{f['tokens_per_s']['min']:.1f}-{f['tokens_per_s']['max']:.1f}]",
                f"{f['tokens_per_s_vs_naive']:.2f}x",
                f"{f['wall_vs_naive']:.2f}x",
            ]
            for name, f in figures.items()
        ],
    )
    return write_results(
        "run",
        {"tasks": TASKS, "max_tokens": MAX_TOKENS, "rounds": ROUNDS, "sides": figures},
        COMMAND,
    )


if __name__ == "__main__":
    main()
