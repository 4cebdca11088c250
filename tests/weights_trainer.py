"""A trainer process for the weights acceptance test: ``python weights_trainer.py URL TOKEN KIND``.

It prepares new weights for a ``rollfleet serve --engine KIND`` (``hf``: the tiny random model
with another seed; ``llamacpp``: the bundled SmolLM2 loaded with transformers, perturbed), prints
``ready``, waits for a line on stdin, pushes them over HTTP as version 1, prints the gateway's
answer as JSON, then prints the greedy tokens a FRESH engine on those weights gives for each
prompt given on the next stdin line (JSON list), and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

GREEDY_TOKENS = 16


def new_weights(kind: str) -> tuple[list[tuple[str, Any]], Any]:
    """The tensors to push, and the model they came from."""
    import torch

    if kind == "hf":
        from rollfleet.engines.tiny import tiny_hf_model

        model, tokenizer = tiny_hf_model(seed=1)
        return list(model.state_dict().items()), (model, tokenizer)
    from transformers import AutoModelForCausalLM

    from rollfleet.engines.llamacpp.model import bundled_gguf

    path = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.startswith("model.layers.") and tensor.ndim == 2:
                tensor.add_(0.02 * torch.randn(tensor.shape, generator=gen))
    return list(model.state_dict().items()), model


async def fresh_greedy(
    kind: str, tensors: list[tuple[str, Any]], made: Any, prompts: list[str]
) -> list[list[int]]:
    """Greedy tokens of a fresh engine started on the new weights, one prompt at a time."""
    from rollfleet.engines.base import GenerationRequest, SamplingParams

    if kind == "hf":
        from rollfleet.engines.hf.engine import HFEngine

        engine: Any = HFEngine(*made)
    else:
        from rollfleet.engines.llamacpp.engine import LlamaCppEngine
        from rollfleet.engines.llamacpp.model import bundled_gguf
        from rollfleet.engines.weights.gguf_export import export_gguf

        folder = Path(tempfile.mkdtemp(prefix="rf-trainer-"))
        path = export_gguf(bundled_gguf(), tensors, folder, "f16").path  # what the server writes
        engine = LlamaCppEngine(path, cache_dir=folder)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
        return [
            list(
                (
                    await engine.generate(GenerationRequest(prompt=p, params=params))
                ).completion_token_ids
            )
            for p in prompts
        ]
    finally:
        await engine.stop()


async def main(url: str, token: str, kind: str) -> None:
    from rollfleet.engines.weights.push import push_weights

    tensors, made = new_weights(kind)
    print("ready", flush=True)
    sys.stdin.readline()
    answer = await push_weights(url, tensors, version=1, token=token, transport="http")
    print(json.dumps(answer), flush=True)
    prompts = json.loads(sys.stdin.readline())
    print(json.dumps(await fresh_greedy(kind, tensors, made, prompts)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
