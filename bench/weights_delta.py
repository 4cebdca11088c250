"""What a delta push saves after one optimizer step of a real model.

Run: ``python -m bench weights_delta``. The bundled SmolLM2-135M is loaded as a trainable
transformers model (transformers' GGUF loader: the Q4_1 file dequantized to float32, 134.5M
parameters, the LM head tied to the embedding). One AdamW step (lr 1e-5, weight decay 0.01:
torch's defaults but the rate) on a batch of 2 x 32 token ids, two ways:

* ``full``: full fine-tuning, every parameter trainable;
* ``lora_style``: only ``q_proj`` and ``v_proj`` of every layer trainable, the rest frozen (the
  matrices a LoRA adapter on q and v changes once merged; ``peft`` is not a dependency).

For each: the tensors whose bytes changed (:func:`rollfleet.engines.weights.push.changed` against a
:func:`~rollfleet.engines.weights.push.snapshot` taken before the step), the bytes a full push and a
delta push send, the time ``changed`` takes, and the time of each push to a gateway served in
this process (loopback HTTP) over an HF engine holding the same model: full and delta pushes in
alternating rounds (full, delta, full, delta, ...; each delta on the version the full push before
it installed), over both transports (``file``: a sealed memfd, the default for a loopback URL;
``http``: the body on the socket, as from another machine). Then llama.cpp: exporting the GGUF
for a full update and for the delta, against an f16 export of the model as the served file (an
engine's second and later updates), again alternating. Figures: median [min-max] over ROUNDS.
"""

from __future__ import annotations

import asyncio
import copy
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import median_range, table, write_results

COMMAND = "python -m bench weights_delta"
ROUNDS = 5
BATCH, TOKENS, LR = 2, 32, 1e-5
LORA_STYLE = ("self_attn.q_proj.weight", "self_attn.v_proj.weight")


def load_model() -> Any:
    """The bundled model as a trainer holds it (float32)."""
    from transformers import AutoModelForCausalLM

    from rollfleet.engines.llamacpp.model import bundled_gguf

    path = bundled_gguf()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


def one_step(model: Any, trainable: tuple[str, ...] | None) -> float:
    """One AdamW step on a fixed batch; only the parameters ending with ``trainable`` learn
    (all when None). Returns the seconds the step took."""
    import torch

    for name, param in model.named_parameters():
        param.requires_grad_(trainable is None or name.endswith(trainable))
    ids = torch.randint(
        0, model.config.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0)
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    started = time.perf_counter()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    return time.perf_counter() - started


def _nbytes(tensors: list[tuple[str, Any]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _elements_changed(before: dict[str, Any], after: list[tuple[str, Any]]) -> int:
    return sum(int((before[name] != t).sum()) for name, t in after)


async def _pushes(url: str, gateway: Any, full: list[Any], delta: list[Any]) -> dict[str, Any]:
    """Full and delta pushes, alternating, ROUNDS each per transport; seconds and install times."""
    from rollfleet.engines.weights.push import push_weights

    out: dict[str, Any] = {}
    for transport in ("file", "http"):
        runs: dict[str, list[float]] = {
            "full": [],
            "delta": [],
            "full_install": [],
            "delta_install": [],
        }
        for _ in range(ROUNDS):
            for kind, tensors in (("full", full), ("delta", delta)):
                version = gateway.weights_version + 1
                base = {"delta": True, "base": version - 1} if kind == "delta" else {}
                started = time.perf_counter()
                answer = await push_weights(url, tensors, version, transport=transport, **base)
                runs[kind].append(time.perf_counter() - started)
                runs[f"{kind}_install"].append(answer["update_s"]["hf-0"])
        out[transport] = {key: median_range(values) for key, values in runs.items()}
        out[transport]["delta_vs_full"] = statistics.median(runs["full"]) / statistics.median(
            runs["delta"]
        )
    return out


def _exports(state: list[Any], delta: list[Any]) -> dict[str, Any]:
    """GGUF exports for llama.cpp, full and delta, alternating, against an f16 export as base."""
    from rollfleet.engines.base import WeightsDelta
    from rollfleet.engines.llamacpp.model import bundled_gguf
    from rollfleet.engines.weights.gguf_export import export_gguf

    runs: dict[str, list[float]] = {"full": [], "delta": []}
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        served = export_gguf(bundled_gguf(), state, directory, "f16", "served").path
        for _ in range(ROUNDS):
            for kind, tensors in (("full", state), ("delta", WeightsDelta(delta, 0))):
                started = time.perf_counter()
                made = export_gguf(served, tensors, directory, "f16", kind, partial=kind == "delta")
                runs[kind].append(time.perf_counter() - started)
                made.path.unlink()
    figures: dict[str, Any] = {kind: median_range(values) for kind, values in runs.items()}
    figures["delta_vs_full"] = statistics.median(runs["full"]) / statistics.median(runs["delta"])
    return figures


async def _case(pristine: Any, trainable: tuple[str, ...] | None) -> dict[str, Any]:
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model
    from rollfleet.engines.weights.push import changed, snapshot, untied

    trainer = copy.deepcopy(pristine)
    before = snapshot(trainer.state_dict().items())
    step_s = one_step(trainer, trainable)
    state = untied(trainer.state_dict().items())
    started = time.perf_counter()
    delta = untied(changed(before, trainer.state_dict().items()))
    changed_s = time.perf_counter() - started
    figures: dict[str, Any] = {
        "step_s": step_s,
        "changed_s": changed_s,
        "tensors": {"full": len(state), "delta": len(delta)},
        "bytes": {"full": _nbytes(state), "delta": _nbytes(delta)},
        "elements_changed": _elements_changed(before, delta),
        "elements": sum(t.numel() for _, t in state),
        "delta_names": sorted({re.sub(r"^model\.layers\.[0-9]+\.", "", n) for n, _ in delta}),
    }
    figures["bytes"]["saved"] = 1 - figures["bytes"]["delta"] / figures["bytes"]["full"]
    engine = HFEngine(copy.deepcopy(pristine), tiny_hf_model()[1], max_batch=1)
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine, "hf-0")
    try:
        async with running_gateway(gateway) as url:
            figures["push_s"] = await _pushes(url, gateway, state, delta)
    finally:
        await gateway.close()
    figures["gguf_export_s"] = await asyncio.to_thread(_exports, state, delta)
    return figures


async def _measure() -> dict[str, Any]:
    pristine = load_model()
    cases = {}
    for name, trainable in (("full", None), ("lora_style", LORA_STYLE)):
        cases[name] = await _case(pristine, trainable)
        print(f"{name}: {cases[name]['bytes']}", flush=True)
    return cases


def _pair(f: dict[str, Any]) -> str:
    """``delta / full`` medians, and how many times faster the delta was."""
    return f"{f['delta']['median']:.2f} / {f['full']['median']:.2f} ({f['delta_vs_full']:.1f}x)"


def main() -> dict[str, Any]:
    """Measure both cases; print a table and write bench/results/weights_delta.json."""
    cases = asyncio.run(_measure())
    rows = [
        [
            name,
            f"{f['tensors']['delta']} / {f['tensors']['full']}",
            f"{f['bytes']['delta'] / 1e6:.1f} / {f['bytes']['full'] / 1e6:.1f}",
            f"{f['bytes']['saved']:.0%}",
            f"{f['changed_s']:.2f}",
            _pair(f["push_s"]["file"]),
            _pair(f["push_s"]["http"]),
            _pair(f["gguf_export_s"]),
        ]
        for name, f in cases.items()
    ]
    table(
        f"one AdamW step of SmolLM2-135M (fp32): delta / full, medians of {ROUNDS} alternating"
        " rounds (ranges in the JSON)",
        [
            "training",
            "tensors",
            "MB",
            "saved",
            "changed() s",
            "push s, file",
            "push s, http",
            "GGUF export s",
        ],
        rows,
    )
    return write_results(
        "weights_delta",
        {
            "rounds": ROUNDS,
            "batch": [BATCH, TOKENS],
            "lr": LR,
            "lora_style": list(LORA_STYLE),
            "cases": cases,
        },
        COMMAND,
    )


if __name__ == "__main__":
    main()
