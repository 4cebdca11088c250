"""One GRPO optimizer step on the bundled SmolLM2-135M on this CPU: full fine-tuning vs LoRA.

Issue 18 asks for LoRA or full fine-tuning, whichever measures better here. Equal work for every
side: the same 8 rows of 128 tokens (64 prompt + 64 action tokens, fixed random ids, advantages
+1/-1, behaviour logprobs from the starting model: on-policy), one ``grpo_step`` each (Adam,
lr 1e-5, micro-batches of 4, gradient clipped at 1.0), in alternating order over ROUNDS rounds;
medians with their range. Sides: full fine-tuning (134.5M trainable parameters), LoRA r=16 on
q_proj and v_proj (peft), LoRA r=16 on every linear layer of the blocks (peft). What a step
pushes to the engines differs too: all 538 MB after full fine-tuning; only the merged matrices
LoRA touches (a delta push: 53 MB for q and v, see bench/weights_delta.py).

Run: ``python -m bench train_step`` (needs rollfleet[train]: transformers, gguf, accelerate, peft).
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

from bench._common import table, write_results
from rollfleet.coordinator.experiences import Experience

ROUNDS, ROWS, PROMPT, ACTION = 3, 8, 64, 64
COMMAND = "python -m bench train_step"


def rows(model: Any) -> list[Experience]:
    """The batch every side trains on, with on-policy logprobs from ``model``."""
    import torch

    from rollfleet.train.grpo import collate, token_logprobs

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (ROWS, PROMPT + ACTION), generator=gen).tolist()
    mask = [0] * PROMPT + [1] * ACTION
    base = [
        Experience(
            f"r{i}", "b", "g", 0, t, PROMPT, [0.0] * len(t), mask, 0.0, 1.0 if i % 2 else -1.0, 0, 0
        )
        for i, t in enumerate(ids)
    ]
    with torch.no_grad():
        lp = token_logprobs(model, collate(base))
    return [
        Experience(
            e.rollout_id,
            "b",
            "g",
            0,
            e.tokens,
            PROMPT,
            lp[i].tolist(),
            mask,
            0.0,
            e.advantage,
            0,
            0,
        )
        for i, e in enumerate(base)
    ]


def sides(model: Any) -> dict[str, Any]:
    """The models to step: full fine-tuning and two LoRA settings on copies of ``model``."""
    from peft import LoraConfig, get_peft_model

    blocks = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = {"full": model}
    for name, targets in (("lora_qv", ["q_proj", "v_proj"]), ("lora_all", blocks)):
        config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
        out[name] = get_peft_model(copy.deepcopy(model), config)
    return out


def main() -> dict[str, Any]:
    """Measure, print, write bench/results/train_step.json."""
    import torch

    from rollfleet.train.policy import grpo_step, load_policy

    torch.manual_seed(0)
    model, _ = load_policy()
    batch = rows(model)
    models = sides(model)
    optimizers = {
        k: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-5)
        for k, m in models.items()
    }
    seconds: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for r in range(ROUNDS):
        for name in order if r % 2 == 0 else order[::-1]:
            stats = grpo_step(models[name], optimizers[name], batch)
            seconds[name].append(stats.seconds)
            print(f"round {r + 1} {name}: {stats.seconds:.2f} s")
    figures = {
        name: {
            "trainable_params": sum(p.numel() for p in m.parameters() if p.requires_grad),
            "step_s": {
                "median": statistics.median(seconds[name]),
                "min": min(seconds[name]),
                "max": max(seconds[name]),
                "runs": seconds[name],
            },
        }
        for name, m in models.items()
    }
    full = figures["full"]["step_s"]["median"]
    table(
        f"one GRPO step, {ROWS} x {PROMPT + ACTION} tokens, SmolLM2-135M, 2 cores",
        ["side", "trainable params", "step s: median (min-max)", "vs full"],
        [
            [
                k,
                f"{f['trainable_params']:,}",
                f"{f['step_s']['median']:.2f} ({f['step_s']['min']:.2f}-{f['step_s']['max']:.2f})",
                f"{full / f['step_s']['median']:.2f}x",
            ]
            for k, f in figures.items()
        ],
    )
    settings = {"rounds": ROUNDS, "rows": ROWS, "prompt_tokens": PROMPT, "action_tokens": ACTION}
    return write_results("train_step", {"settings": settings, "sides": figures}, COMMAND)


if __name__ == "__main__":
    main()
