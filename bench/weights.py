"""Weights from a trainer into the fleet: ``python -m bench weights``.

The model has SmolLM2-135M's shape (30 layers, 576 wide, 49,152 tokens: 134.5M parameters,
fp32 as the CPU engine holds it), built from its config with random weights: what is measured is
moving and installing tensors, which depends on their sizes only.

1. Sync throughput, in alternating rounds: pushing the state dict to a gateway in another
   process (``PUT /v1/rollfleet/weights/{v}`` naming sealed memfds, one a core, as
   ``push_weights`` does on this host: framing, XXH3-64, the memfds, decoding and checking, the
   engine taking the tensors over the mappings as they are) against a plain in-memory copy of
   the same tensors into a model of the same shape in this process (the physical limit here),
   after one untimed push (the engine makes its standby model, the trainer its spare memfds;
   the in-process figures leave out their first update too), with the push's parts: the
   trainer writing its memfds (``write_s``), the gateway mapping and checking them
   (``receive_s``) and the engine's update (``update_s``). Also the time the engine's worker
   spent on them (the gateway's ``pause_s``: generation stopped) against the whole update, and
   the same two in this process for a double-buffered engine (the default: tensors copied into
   a standby model while generation goes on, the worker only swaps the models) and an in-place
   one (``double_buffer=False``: the worker copies them).
2. Tokens/s kept under a weight swap every ``SWAP_EVERY_S`` with 8 concurrent generations on the
   HF engine, for: no swaps; interruptible swaps (the default: KV recomputed, generation goes
   on); drain-and-swap (the swap waits for the running batch); abort-and-retry (running
   requests are aborted, the swap installed, the requests started again: their tokens so far are
   thrown away). Also the swap delay: from the trainer sending new weights to the engine
   serving them (the old policy generates all that time).

``python -m bench.weights --only sync`` runs part 1 alone (a minute or two). After each push the
trainer's process makes the memfds the next one fills (off the push, in a thread, as while a
trainer trains), and the engine frees the version before in a thread; each round waits for the
first and half a second for the second before the in-memory copy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from typing import Any

from bench._common import PY, RESULTS, ROOT, free_port, median_range, table, write_results

COMMAND = "python -m bench weights"
ROUNDS = 3
WINDOW_S, SWAP_EVERY_S, CONCURRENT, MAX_TOKENS = 20.0, 5.0, 8, 128


def smollm2_135m(seed: int = 0) -> tuple[Any, Any]:
    """A random-weight model of SmolLM2-135M's shape and a byte-level tokenizer (offline)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollfleet.engines.tiny import tiny_hf_model

    _, tokenizer = tiny_hf_model()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=0,
    )
    return LlamaForCausalLM(config).eval(), tokenizer


async def _sync() -> dict[str, Any]:
    import torch

    from rollfleet.engines.weights.push import push_weights, untied

    source = untied(smollm2_135m(seed=1)[0].state_dict().items())  # the LM head is tied
    target = smollm2_135m(seed=2)[0].state_dict()
    mb = sum(t.numel() * t.element_size() for _, t in source) / 1e6
    port = free_port()
    server = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything is timed)
        [PY, "-m", "bench._weights_server", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = (await asyncio.to_thread(server.stdout.readline)).strip()  # type: ignore[union-attr]
        await asyncio.sleep(0)
        copy_s, push_s, install_s, update_s, write_s, receive_s = [], [], [], [], [], []
        await _push_when_up(push_weights, url, source, 1)  # untimed: the standby, the spare
        await asyncio.to_thread(_spare_made)
        await asyncio.sleep(0.5)
        for version in range(2, ROUNDS + 2):
            started = time.perf_counter()
            with torch.no_grad():
                for name, tensor in source:
                    target[name].copy_(tensor)
            copy_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            answer = await _push_when_up(push_weights, url, source, version)  # same host: memfd
            push_s.append(time.perf_counter() - started)
            await asyncio.to_thread(_spare_made)
            await asyncio.sleep(0.5)  # the engine frees the version before in a thread too
            update_s.append(answer["update_s"]["hf-0"])
            write_s.append(answer["write_s"])
            receive_s.append(answer["receive_s"])
            install_s.append(answer.get("pause_s", answer["update_s"])["hf-0"])  # older gateways
            print(
                f"round {version - 1}: memcpy {copy_s[-1]:.3f} s, push {push_s[-1]:.3f} s"
                f" (write {write_s[-1]:.3f}, receive {receive_s[-1]:.3f}, update"
                f" {update_s[-1]:.3f}), paused {install_s[-1] * 1000:.3f} ms",
                flush=True,
            )
    finally:
        server.kill()
        server.wait()
    return {
        "megabytes": mb,
        "memcpy_s": median_range(copy_s),
        "push_s": median_range(push_s),
        "install_s": median_range(install_s),
        "update_s": median_range(update_s),
        "write_s": median_range(write_s),
        "receive_s": median_range(receive_s),
        "memcpy_mb_s": mb / statistics.median(copy_s),
        "push_mb_s": mb / statistics.median(push_s),
        "push_vs_memcpy": statistics.median(copy_s) / statistics.median(push_s),
    }


def _spare_made() -> None:
    """Wait for the memfd the push left for the next one (made while a trainer trains), so that
    the next in-memory copy has the cores to itself."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "rollfleet-push-spare":
            thread.join()


async def _pauses(double_buffer: bool) -> dict[str, Any]:
    """In this process: full updates into an engine, the worker's pause against the whole call."""
    from rollfleet.engines.hf.engine import HFEngine

    engine = HFEngine(*smollm2_135m(seed=0), double_buffer=double_buffer)
    await engine.start()
    pause_s, total_s = [], []
    try:
        for version in range(1, ROUNDS + 2):  # the first double-buffered one makes the standby
            tensors = list(smollm2_135m(seed=version)[0].state_dict().items())
            started = time.perf_counter()
            await engine.update_weights(tensors, version)
            total_s.append(time.perf_counter() - started)
            pause_s.append(engine.last_pause_s or 0.0)
            print(
                f"{'double buffer' if double_buffer else 'in place'} update {version}:"
                f" paused {pause_s[-1] * 1000:.3f} ms of {total_s[-1]:.3f} s",
                flush=True,
            )
    finally:
        await engine.stop()
    return {
        "first_update_s": total_s[0],
        "pause_s": median_range(pause_s[1:]),
        "update_s": median_range(total_s[1:]),
    }


async def _push_when_up(push: Any, url: str, source: Any, version: int) -> dict[str, Any]:
    import httpx

    for _ in range(600):  # the server prints its URL before the socket listens
        try:
            result: dict[str, Any] = await push(url, source, version)
            return result
        except httpx.ConnectError:
            await asyncio.sleep(0.1)
    raise RuntimeError("the weights server never listened")


async def _swaps(mode: str, model: Any, tokenizer: Any, new_states: list[Any]) -> dict[str, Any]:
    from rollfleet.engines.base import GenerationRequest, SamplingParams
    from rollfleet.engines.hf.engine import HFEngine

    engine = HFEngine(model, tokenizer, max_batch=CONCURRENT, interruptible=mode != "drain")
    await engine.start()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0)
    useful = wasted = 0
    sent_at: list[float] = []
    delays: list[float] = []
    deadline = time.monotonic() + WINDOW_S

    async def client(i: int) -> None:
        nonlocal useful, wasted
        n = 0
        while time.monotonic() < deadline:
            n += 1
            result = await engine.generate(GenerationRequest(prompt=f"c{i} r{n}", params=params))
            if result.aborted and mode == "abort":
                wasted += len(result.completion_token_ids)
                continue
            useful += len(result.completion_token_ids)

    async def trainer() -> None:
        for version, state in enumerate(new_states, start=1):
            await asyncio.sleep(SWAP_EVERY_S)
            if time.monotonic() >= deadline:
                return
            sent_at.append(time.monotonic())
            if mode == "abort":
                await engine.abort(None)
            await engine.update_weights(state, version)
            delays.append(time.monotonic() - sent_at[-1])

    started = time.monotonic()
    try:
        await asyncio.gather(
            *(client(i) for i in range(CONCURRENT)), *([] if mode == "none" else [trainer()])
        )
    finally:
        await engine.stop()
    elapsed = time.monotonic() - started
    return {
        "tokens_per_s": useful / elapsed,
        "wasted_tokens": wasted,
        "swaps": len(sent_at),
        "swap_delay_s": statistics.median(delays) if delays else 0.0,
    }


async def _all_swaps() -> dict[str, Any]:
    model, tokenizer = smollm2_135m(seed=0)
    states = [list(smollm2_135m(seed=s)[0].state_dict().items()) for s in (1, 2, 3)]
    runs: dict[str, list[dict[str, Any]]] = {
        m: [] for m in ("none", "interruptible", "drain", "abort")
    }
    for r in range(2):
        for mode in runs:
            result = await _swaps(mode, model, tokenizer, states)
            runs[mode].append(result)
            print(f"round {r + 1} {mode}: {result}", flush=True)
    base = statistics.median(x["tokens_per_s"] for x in runs["none"])
    return {
        mode: {
            "rounds": rs,
            "tokens_per_s": median_range([x["tokens_per_s"] for x in rs]),
            "kept_vs_no_swaps": statistics.median(x["tokens_per_s"] for x in rs) / base,
            "wasted_tokens": statistics.median(x["wasted_tokens"] for x in rs),
            "swap_delay_s": statistics.median(x["swap_delay_s"] for x in rs),
        }
        for mode, rs in runs.items()
    }


def main(only: str | None = None) -> dict[str, Any]:
    """Run both parts (or ``only`` one); print and write bench/results/weights.json (a single
    part replaces its own figures there, with its command, and keeps the other's)."""
    figures: dict[str, Any] = {}
    if only in (None, "sync"):
        sync = figures["sync"] = asyncio.run(_sync())
        sync["in_process"] = {
            mode: asyncio.run(_pauses(mode == "double_buffer"))
            for mode in ("double_buffer", "in_place")
        }
        double, in_place = sync["in_process"]["double_buffer"], sync["in_process"]["in_place"]
        table(
            "weight sync, SmolLM2-135M shape, fp32: median [range]",
            ["figure", "value"],
            [
                ["state dict", f"{sync['megabytes']:.0f} MB"],
                ["in-memory copy (the limit here)", f"{sync['memcpy_mb_s']:.0f} MB/s"],
                ["push over HTTP to a gateway in another process", f"{sync['push_mb_s']:.0f} MB/s"],
                ["push / in-memory copy", f"{sync['push_vs_memcpy']:.2f}x"],
                ["in-memory copy", _ms(sync["memcpy_s"])],
                ["whole push", _ms(sync["push_s"])],
                ["of it, the trainer writing its memfds", _ms(sync["write_s"])],
                ["of it, the gateway mapping and checking them", _ms(sync["receive_s"])],
                ["generation stopped while installing (HF, pushed)", _ms(sync["install_s"])],
                ["whole update on the engine (HF, pushed)", _ms(sync["update_s"])],
                ["in process, double buffer: generation stopped", _ms(double["pause_s"])],
                ["in process, double buffer: whole update", _ms(double["update_s"])],
                [
                    "in process, double buffer: first update (makes the standby)",
                    f"{double['first_update_s'] * 1000:.0f} ms",
                ],
                ["in process, in place: generation stopped", _ms(in_place["pause_s"])],
                ["in process, in place: whole update", _ms(in_place["update_s"])],
            ],
        )
    if only in (None, "swaps"):
        swaps = figures["swaps"] = asyncio.run(_all_swaps())
        table(
            f"{CONCURRENT} generations, a swap every {SWAP_EVERY_S:.0f} s over {WINDOW_S:.0f} s",
            ["mode", "tokens/s", "kept vs no swaps", "tokens thrown away", "swap delay s"],
            [
                [
                    m,
                    f"{f['tokens_per_s']['median']:.1f}",
                    f"{f['kept_vs_no_swaps']:.2f}x",
                    f"{f['wasted_tokens']:.0f}",
                    f"{f['swap_delay_s']:.2f}",
                ]
                for m, f in swaps.items()
            ],
        )
    command = COMMAND
    if only is not None:  # one part: the other keeps its last figures
        figures[only]["command"] = f"python -m bench.weights --only {only}"
        last = RESULTS / "weights.json"
        kept = json.loads(last.read_text()) if last.exists() else {}
        command = kept.get("command", figures[only]["command"])
        figures = {part: kept[part] for part in ("sync", "swaps") if part in kept} | figures
    return write_results(
        "weights",
        {
            **figures,
            "window_s": WINDOW_S,
            "swap_every_s": SWAP_EVERY_S,
            "concurrent": CONCURRENT,
            "max_tokens": MAX_TOKENS,
        },
        command,
    )


def _ms(spread: dict[str, float]) -> str:
    return (
        f"{spread['median'] * 1000:.3f} ms [{spread['min'] * 1000:.3f}-{spread['max'] * 1000:.3f}]"
    )


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", choices=["sync", "swaps"], help="run one part only")
    return parser.parse_args()


if __name__ == "__main__":
    main(_args().only)
