"""The llama.cpp engine against llama.cpp's own server: ``python -m bench.llama_server``.

A user who wants llama.cpp with continuous batching could run ``llama-server -np 8`` instead of
rollfleet's ``LlamaCppEngine``, so that server is the engine's peer. Both are built from the same
llama.cpp (the one llama-cpp-python==<pinned> vendors; ``make llama-server`` builds the server
from that sdist with the wheel's CPU flags), load the same GGUF file (the Q8_0 copy the engine
serves the bundled Q4_1 SmolLM2 from; ``--q4`` adds rows on the Q4_1 file itself), use the same
threads, batch size and unified KV cache, and get the same work: the same prompts, greedy,
``ignore_eos``, TOKENS new tokens each, at concurrency 1, 4 and 8.

- A: the engine in-process, ``asyncio.gather`` over its async ``generate``;
- B: llama-server on 127.0.0.1 over HTTP (``/completion``, httpx), tokens as the server reports.

Runs alternate A B / B A per (round, concurrency), so load drift on a shared machine hits both
sides; each figure is the median of the rounds with min and max. The machine's own limit comes
from ``llama-batched-bench`` (built by the same target) in each round: bare ``llama_decode``
over 1, 4, 8 and 16 sequences of random tokens, no sampling, no scheduler, no HTTP. Its ratio
at 8 vs 1 is the most any scheduler on this llama.cpp can show on this machine.

Options: ``--rounds N`` (3), ``--tokens N`` (128), ``--q4``, ``--split-kv`` (llama-server
with its default for an explicit ``-np``: one KV stream per slot; the engine stays unified).
Set-up: ``make llama-server`` once (``make peers`` runs it too).
Writes bench/results/llama_server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench._common import console, free_port, stop, table, wait_healthy, write_results

COMMAND = "python -m bench.llama_server"
CONCURRENCY = (1, 4, 8)
SLOTS, CTX_PER_SEQ, N_BATCH = 8, 512, 512
GOAL = 2.5  # the earlier goal: tokens/s at concurrency 8 >= 2.5x tokens/s at 1
CACHE = Path(os.environ.get("ROLLFLEET_CACHE") or Path.home() / ".cache" / "rollfleet")
SERVER = CACHE / "bin" / "llama-server"
BATCHED_BENCH = CACHE / "bin" / "llama-batched-bench"
BUILD_HINT = (
    "bench.llama_server needs llama.cpp's server at {path}: build it once with `make llama-server` "
    "(from the repository root; the llama.cpp that llama-cpp-python vendors, several minutes on 2 "
    "cores), then run `python -m bench.llama_server` again"
)


def prompts(concurrency: int, round_: int) -> list[str]:
    """The prompts of one run; both sides get exactly these."""
    return [f"Story {round_}.{i}: once upon a time" for i in range(concurrency)]


async def engine_run(engine: Any, concurrency: int, round_: int, tokens: int) -> dict[str, Any]:
    """A: ``concurrency`` simultaneous generations on the engine, in-process."""
    from rollfleet.engines.base import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(prompt=p, params=params))
            for p in prompts(concurrency, round_)
        )
    )
    elapsed = time.perf_counter() - started
    n = sum(len(r.completion_token_ids) for r in results)
    return {"tokens": n, "seconds": elapsed, "texts": [r.text for r in results]}


async def server_run(
    http: httpx.AsyncClient, concurrency: int, round_: int, tokens: int
) -> dict[str, Any]:
    """B: ``concurrency`` simultaneous requests to llama-server; tokens it says it predicted."""

    async def one(prompt: str) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": True,
            "stream": False,
        }
        response = await http.post("/completion", json=body)
        response.raise_for_status()
        return dict(response.json())

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts(concurrency, round_)))
    elapsed = time.perf_counter() - started
    n = sum(int(r["tokens_predicted"]) for r in results)
    return {"tokens": n, "seconds": elapsed, "texts": [r["content"] for r in results]}


def bare_decode(model: Path, threads: int, tokens: int) -> dict[str, float]:
    """llama-batched-bench: decode tokens/s over 1, 4, 8, 16 sequences (``{}`` when not built)."""
    if not BATCHED_BENCH.exists():
        return {}
    argv = [
        str(BATCHED_BENCH),
        "-m",
        str(model),
        "-c",
        str(16 * (16 + tokens)),
        "-b",
        str(N_BATCH),
        "-ub",
        str(N_BATCH),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-npp",
        "16",
        "-ntg",
        str(tokens),
        "-npl",
        "1,4,8,16",
        "--output-format",
        "jsonl",
        "-kvu",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exited {done.returncode}:\n{done.stderr[-2000:]}")
    out: dict[str, float] = {}
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        line = line.strip()
        if line.startswith('{"n_kv_max"'):
            row = json.loads(line)
            out[str(row["pl"])] = float(row["speed_tg"])
    return out


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max (and the values) of one figure over the rounds."""
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
        "runs": [round(v, 1) for v in values],
    }


def server_argv(model: Path, port: int, threads: int, split_kv: bool) -> list[str]:
    """llama-server on loopback, 8 slots, continuous batching, the engine's batch sizes."""
    return [
        str(SERVER),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(SLOTS),
        "-c",
        str(SLOTS * CTX_PER_SEQ),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-b",
        str(N_BATCH),
        "-ub",
        str(N_BATCH),
        "--cont-batching",
        "-no-kvu" if split_kv else "-kvu",
    ]


def launch(argv: list[str], log_path: Path, port: int) -> subprocess.Popen[bytes]:
    """Start llama-server (its log to ``log_path``) and wait until it has loaded the model."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 180)
    except RuntimeError:
        stop(proc)
        console.print(log_path.read_text(errors="replace")[-3000:])
        raise
    return proc


async def compare(
    label: str, original: Path, batch_quant: bool, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    """All rounds on one model file: A and B alternating, bare decode once per round."""
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(
        original,
        slots=SLOTS,
        ctx_per_seq=CTX_PER_SEQ,
        threads=args.threads,
        n_batch=N_BATCH,
        batch_quant=batch_quant,
    )
    await engine.start()  # converts the Q4_1 file to the cached Q8_0 copy first when asked to
    model = Path(engine.served)
    port = free_port()
    log_path = log_dir / f"llama-server-{label}.log"
    argv = server_argv(model, port, args.threads, args.split_kv)
    proc = await asyncio.to_thread(launch, argv, log_path, port)
    runs: dict[str, dict[int, list[float]]] = {"engine": {}, "llama_server": {}}
    bare: dict[str, list[float]] = {}
    texts: dict[str, list[str]] = {}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None) as http:
            sides: dict[str, Callable[[int, int], Awaitable[dict[str, Any]]]] = {
                "engine": lambda c, r: engine_run(engine, c, r, args.tokens),
                "llama_server": lambda c, r: server_run(http, c, r, args.tokens),
            }
            for side in sides.values():  # warm-up, not counted
                await side(2, -1)
            order = list(sides)
            for r in range(args.rounds):
                for c in CONCURRENCY:
                    for name in order:
                        run = await sides[name](c, r)
                        if run["tokens"] != c * args.tokens:
                            raise RuntimeError(
                                f"{name} made {run['tokens']} tokens, not "
                                f"{c * args.tokens}: unequal work"
                            )
                        runs[name].setdefault(c, []).append(run["tokens"] / run["seconds"])
                        if c == 1 and r == 0:
                            texts[name] = run["texts"]
                        console.print(
                            f"[dim]{label} round {r + 1} c={c} {name}: "
                            f"{run['tokens'] / run['seconds']:.1f} tok/s[/dim]"
                        )
                    order.reverse()  # A B, then B A, ...
                for pl, speed in bare_decode(model, args.threads, args.tokens).items():
                    bare.setdefault(pl, []).append(speed)
    finally:
        await engine.stop()
        stop(proc)
    shown = [SERVER.name, *argv[1:]]  # without this machine's paths and port
    shown[shown.index("-m") + 1] = model.name
    shown[shown.index("--port") + 1] = "<free port>"
    out: dict[str, Any] = {
        "model_file": model.name,
        "served_from": original.name,
        "server_argv": shown,
    }
    for name, by_c in runs.items():
        figures = {str(c): spread(v) for c, v in by_c.items()}
        per_round = [b / a for a, b in zip(by_c[1], by_c[8], strict=True)]
        out[name] = {
            "tokens_per_s": figures,
            "ratio_8_vs_1": round(figures["8"]["median"] / figures["1"]["median"], 2),
            "ratio_8_vs_1_per_round": [round(x, 2) for x in per_round],
        }
    out["llama_server_vs_engine"] = {
        str(c): round(
            out["llama_server"]["tokens_per_s"][str(c)]["median"]
            / out["engine"]["tokens_per_s"][str(c)]["median"],
            2,
        )
        for c in CONCURRENCY
    }
    out["same_greedy_text_at_1"] = texts.get("engine") == texts.get("llama_server")
    if bare:
        figures = {pl: spread(v) for pl, v in bare.items()}
        out["bare_decode"] = {
            "what": "llama-batched-bench decode tokens/s (S_TG): 16-token prompts, random tokens, "
            "no sampling, no scheduler, no HTTP",
            "tokens_per_s": figures,
            "ratio_8_vs_1": round(figures["8"]["median"] / figures["1"]["median"], 2),
        }
    best = [
        (f["median"], f"{name} at {c}")
        for name in ("engine", "llama_server")
        for c, f in out[name]["tokens_per_s"].items()
    ]
    best += [
        (f["median"], f"bare decode at {pl}")
        for pl, f in out.get("bare_decode", {}).get("tokens_per_s", {}).items()
    ]
    top = max(best)
    out["ceiling"] = {"tokens_per_s": top[0], "reached_by": top[1]}
    return out


def rows(label: str, r: dict[str, Any]) -> list[list[Any]]:
    """Table rows for one model file."""
    out = []
    for name in ("engine", "llama_server"):
        for c in CONCURRENCY:
            f = r[name]["tokens_per_s"][str(c)]
            out.append(
                [
                    label,
                    name,
                    c,
                    f"{f['median']:.1f} ({f['min']:.1f}-{f['max']:.1f})",
                    f"x{r[name]['ratio_8_vs_1']}" if c == 8 else "",
                ]
            )
    for pl, f in r.get("bare_decode", {}).get("tokens_per_s", {}).items():
        out.append(
            [
                label,
                "bare decode",
                pl,
                f"{f['median']:.1f} ({f['min']:.1f}-{f['max']:.1f})",
                f"x{r['bare_decode']['ratio_8_vs_1']}" if pl == "8" else "",
            ]
        )
    return out


def server_version() -> str:
    """What ``llama-server --version`` says (it prints to stderr)."""
    done = subprocess.run([str(SERVER), "--version"], capture_output=True, text=True, timeout=60)
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.startswith("version")]
    return lines[0] if lines else "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison, print a table, write bench/results/llama_server.json."""
    p = argparse.ArgumentParser(prog=COMMAND)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--q4", action="store_true", help="also compare on the bundled Q4_1 file")
    p.add_argument(
        "--split-kv",
        action="store_true",
        help="llama-server with one KV stream per slot (-no-kvu: its default when -np "
        "is given); the engine keeps its unified cache",
    )
    args = p.parse_args([] if argv is None else argv)
    if not SERVER.exists():
        raise SystemExit(BUILD_HINT.format(path=SERVER))

    import llama_cpp

    from rollfleet.engines.llamacpp.model import bundled_gguf

    bundled = bundled_gguf()
    models = [("q8_0", True)] + ([("q4_1", False)] if args.q4 else [])
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rollfleet-llama-server-") as tmp:
        results = {
            label: asyncio.run(compare(label, bundled, quant, args, Path(tmp)))
            for label, quant in models
        }
    load_after = os.getloadavg()
    q8 = results["q8_0"]
    figures: dict[str, Any] = {
        "settings": {
            "concurrency": list(CONCURRENCY),
            "rounds": args.rounds,
            "max_tokens": args.tokens,
            "threads": args.threads,
            "slots": SLOTS,
            "ctx_per_seq": CTX_PER_SEQ,
            "n_batch": N_BATCH,
            "sampling": "greedy",
            "ignore_eos": True,
            "kv": f"engine unified, llama-server {'split' if args.split_kv else 'unified'}",
            "order": "A B / B A alternating per round and concurrency",
        },
        "goal": {
            "ratio_8_vs_1": GOAL,
            "engine": q8["engine"]["ratio_8_vs_1"],
            "llama_server": q8["llama_server"]["ratio_8_vs_1"],
            "bare_decode": q8.get("bare_decode", {}).get("ratio_8_vs_1"),
        },
        "models": results,
        "versions": {"llama_cpp_python": llama_cpp.__version__, "llama_server": server_version()},
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
        "cpus_usable": len(os.sched_getaffinity(0)),
    }
    table(
        "llama.cpp engine vs llama-server (tokens/s: median (min-max))",
        ["model", "side", "concurrency", "tokens/s", "8 vs 1"],
        [row for label, r in results.items() for row in rows(label, r)],
    )
    goal, ceiling = figures["goal"], q8["ceiling"]
    console.print(
        f"goal x{GOAL} at 8 vs 1: engine x{goal['engine']}, llama-server "
        f"x{goal['llama_server']}, bare decode x{goal['bare_decode']}; ceiling "
        f"{ceiling['tokens_per_s']} tok/s ({ceiling['reached_by']})"
    )
    return write_results("llama_server", figures, COMMAND)


if __name__ == "__main__":
    main(sys.argv[1:])
