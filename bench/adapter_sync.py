"""A training step's weights sync under LoRA: the adapter pushed as such against the merged q/v
matrices (issue 32).

The bundled SmolLM2 as the trainer loads it, LoRA r=16 on q and v (the ``rollfleet train``
default), its B matrices set to new random values before every push (a step's change). Two
llama.cpp engines as ``rollfleet train`` serves the model (the Q8_0 copy, 8 slots), each behind
a gateway in this process: one takes the adapter (:mod:`rollfleet.engines.weights.lora`: a GGUF adapter
set between two decode steps), the other the merged q/v matrices as a delta (a GGUF of the whole
model written, then loaded). Alternating rounds A B A B; seconds per push, from the trainer's
``publish`` call to the engine serving the new version, and the bytes each sends. Goal: at most
0.2 s a step for the adapter. Run: ``python -m bench adapter_sync``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench._common import median_range, table, write_results

ROUNDS = 5


class _Coordinator:
    """The coordinator ``publish`` reports to: nothing to tell here."""

    async def set_policy_version(self, version: int) -> None:
        """Accept the version."""


async def measure() -> dict[str, Any]:
    """Both sides, alternating; seconds per push and the bytes of one."""
    import torch

    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine
    from rollfleet.engines.weights.lora import peft_adapter
    from rollfleet.train.policy import Policy, load_policy, publish, push_tensors

    torch.manual_seed(0)
    model = Policy(load_policy()[0], lr=1e-3, lora_rank=16).model
    gateways: dict[str, Gateway] = {}
    for side in ("adapter", "merged"):
        engine = LlamaCppEngine(slots=8)
        await engine.start()
        gateways[side] = Gateway()
        gateways[side].add_replica(engine)
    seconds: dict[str, list[float]] = {side: [] for side in gateways}
    adapter = peft_adapter(model)
    assert adapter is not None
    sizes = {
        "adapter": sum(t.numel() * t.element_size() for _, t in adapter),
        "merged": sum(t.numel() * t.element_size() for t in push_tensors(model)[0].values()),
    }
    try:
        for version in range(1, ROUNDS + 1):
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "lora_B" in name:
                        parameter.normal_(0.0, 0.02)
            for side, gateway in gateways.items():
                began = time.perf_counter()
                if side == "adapter":
                    await publish(model, gateway, _Coordinator(), version, base=version - 1)
                else:  # what publish does for engines that take no adapter
                    from rollfleet.engines.weights.push import push_weights

                    tensors, _ = push_tensors(model)
                    await push_weights(
                        gateway, tensors.items(), version=version, delta=True, base=version - 1
                    )
                seconds[side].append(time.perf_counter() - began)
    finally:
        for gateway in gateways.values():
            await gateway.close()
    return {"seconds": seconds, "bytes": sizes}


def main() -> dict[str, Any]:
    """Run both sides and write bench/results/adapter_sync.json."""
    runs = asyncio.run(measure())
    figures: dict[str, Any] = {"rounds": ROUNDS, "lora_rank": 16, "targets": ["q_proj", "v_proj"]}
    rows = []
    for side in ("adapter", "merged"):
        spread = median_range(runs["seconds"][side])
        figures[side] = {"seconds": spread, "mb": runs["bytes"][side] / 1e6}
        rows.append(
            [
                side,
                f"{spread['median']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}]",
                f"{runs['bytes'][side] / 1e6:.1f}",
            ]
        )
    figures["speedup"] = (
        figures["merged"]["seconds"]["median"] / figures["adapter"]["seconds"]["median"]
    )
    table("weights sync per step under LoRA", ["push", "seconds", "MB sent"], rows)
    return write_results("adapter_sync", figures, "python -m bench adapter_sync")


if __name__ == "__main__":
    main()
