"""``rollfleet run`` against the loop a user would write without it: ``python -m bench run``.

Every side is one fresh command in a subprocess doing the same work: the 52 bundled math problems,
the bundled SmolLM2 GGUF, the same prompts, ``max_tokens`` 64, temperature 0.7. The sides run in
alternating rounds (A B C D, A B C D, ...), and the figures are medians over the rounds with
their range. Wall time is the whole command's, start-up included, as a user waits for it.

* naive loop: ``bench/_naive_loop.py``, one ``Llama`` and a for loop (llama-cpp-python);
* rollfleet run, the README's demo: 4 runners sharing one llama.cpp engine (continuous batching,
  prefix cache) behind the gateway, a durable store;
* rollfleet run with one runner: one rollout at a time, the like-for-like row for the loop;
* the seed's design: 4 runner processes, each with its own copy of the model
  (``--engine-per-runner``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import PY, ROOT, table, write_results

COMMAND = "python -m bench run"
DATA = ROOT / "src" / "rollfleet" / "examples" / "math.jsonl"
TASKS, MAX_TOKENS, ROUNDS = 52, 64, 3
SIDES = {
    "naive loop (llama-cpp-python)": None,
    "rollfleet run, 4 runners (demo)": ["--num-rollouts", "4"],
    "rollfleet run, 1 runner": ["--num-rollouts", "1"],
    "seed design: 4 runners, engine per process": ["--num-rollouts", "4", "--engine-per-runner"],
}


def _rollfleet(extra: list[str], out: Path) -> dict[str, Any]:
    argv = [PY, "-m", "rollfleet.cli", "run", "--mode", "math", "--data", str(DATA), "--limit", str(TASKS),
            "--max-tokens", str(MAX_TOKENS), "--output-dir", str(out), *extra]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    summary = json.loads((out / "summary.json").read_text())
    tokens = summary["tokens"]["completion"]
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "succeeded": summary["counts"].get("succeeded", 0),
            "first_token_s": (summary.get("startup_s") or {}).get("first_token")}


def _naive() -> dict[str, Any]:
    argv = [PY, "-m", "bench._naive_loop", str(DATA), str(TASKS), str(MAX_TOKENS)]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, check=True)
    wall = time.perf_counter() - started
    report = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = report["completion_tokens"]
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall, "succeeded": TASKS,
            "first_token_s": None}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> dict[str, Any]:
    """Alternate every side over ROUNDS rounds; print and write bench/results/run.json."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    with tempfile.TemporaryDirectory(prefix="rollfleet-bench-run-") as tmp:
        for r in range(ROUNDS):
            for i, (name, extra) in enumerate(SIDES.items()):
                result = _naive() if extra is None else _rollfleet(extra, Path(tmp) / f"r{r}-s{i}")
                runs[name].append(result)
                print(f"round {r + 1}/{ROUNDS} {name}: {result['wall_s']:.1f} s, "
                      f"{result['tokens_per_s']:.1f} tokens/s", flush=True)
    naive = "naive loop (llama-cpp-python)"
    figures: dict[str, Any] = {}
    for name, results in runs.items():
        figures[name] = {
            "rounds": results,
            "wall_s": _spread([x["wall_s"] for x in results]),
            "tokens_per_s": _spread([x["tokens_per_s"] for x in results]),
        }
    for name, f in figures.items():
        f["tokens_per_s_vs_naive"] = f["tokens_per_s"]["median"] / figures[naive]["tokens_per_s"]["median"]
        f["wall_vs_naive"] = f["wall_s"]["median"] / figures[naive]["wall_s"]["median"]
    table(f"math mode, {TASKS} tasks, max {MAX_TOKENS} tokens, {ROUNDS} alternating rounds: median [range]",
          ["side", "wall s", "tokens/s", "tokens/s vs naive", "wall vs naive"],
          [[name, f"{f['wall_s']['median']:.1f} [{f['wall_s']['min']:.1f}-{f['wall_s']['max']:.1f}]",
            f"{f['tokens_per_s']['median']:.1f} [{f['tokens_per_s']['min']:.1f}-{f['tokens_per_s']['max']:.1f}]",
            f"{f['tokens_per_s_vs_naive']:.2f}x", f"{f['wall_vs_naive']:.2f}x"] for name, f in figures.items()])
    return write_results("run", {"tasks": TASKS, "max_tokens": MAX_TOKENS, "rounds": ROUNDS, "sides": figures},
                         COMMAND)


if __name__ == "__main__":
    main()
