"""One GRPO optimizer step on the bundled SmolLM2-135M on this CPU: full fine-tuning vs LoRA.

Issue 18 asks for LoRA or full fine-tuning, whichever measures better here. Equal work for every
side: the same 8 rows of 128 tokens (64 prompt + 64 action tokens, fixed random ids, advantages
+1/-1, behaviour logprobs from the starting model: on-policy), one ``grpo_step`` each (Adam,
lr 1e-5, micro-batches of 4, gradient clipped at 1.0), in alternating order over ROUNDS rounds;
medians with their range. Sides: full fine-tuning (134.5M trainable parameters), LoRA r=16 on
q_proj and v_proj (peft), LoRA r=16 on every linear layer of the blocks (peft). What a step
pushes to the engines differs too: all 538 MB after full fine-tuning; only the merged matrices
LoRA touches (a delta push: 53 MB for q and v, see bench/weights_delta.py).

Rows of a GRPO group share their prompt; a step computes a prompt the rows of a micro-batch share
once (issue 32). Measured apart, before against after on the batch a step of ``rollfleet train``
gets: GROUPS prompts of the arithmetic split rendered by math mode (52 tokens), GROUP rows each,
answers of 10 to MAX_ANSWER fixed random tokens, LoRA r=16 on q and v, one torch thread as in
bench/train_vs_trl.py; *whole rows* is the step before that change (rows micro-batched by
length alone, every row computed whole), *shared prompt* today's, in alternating order.

Run: ``python -m bench train_step`` (needs rollfleet[train]: transformers, gguf, accelerate, peft).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from bench._common import median_range, table, write_results
from rollfleet.coordinator.experiences import Experience

ROUNDS, ROWS, PROMPT, ACTION = 3, 8, 64, 64
GROUPS, GROUP, MAX_ANSWER = 4, 8, 48
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


def group_rows(tokenizer: Any) -> list[Experience]:
    """GROUPS x GROUP rows as a step of ``rollfleet train`` gets them: each group's rows share
    math mode's prompt for one arithmetic task; answers of fixed random tokens."""
    import random

    from bench._trl_sides import DATA, messages, tasks

    rng = random.Random(0)
    out = []
    for g, task in enumerate(tasks(DATA)[:GROUPS]):
        rendered = tokenizer.apply_chat_template(messages(task), add_generation_prompt=True)
        prompt = list(rendered["input_ids"])
        for i in range(GROUP):
            answer = [rng.randrange(100, 40000) for _ in range(rng.randint(10, MAX_ANSWER))]
            mask = [0] * len(prompt) + [1] * len(answer)
            advantage = 1.0 if i % 2 else -1.0
            out.append(
                Experience(
                    f"r{g}.{i}",
                    "b",
                    f"g{g}",
                    0,
                    prompt + answer,
                    len(prompt),
                    [-3.0 * m for m in mask],
                    mask,
                    advantage,
                    advantage,
                    0,
                    0,
                )
            )
    return out


@contextmanager
def whole_rows() -> Iterator[None]:
    """The step as it was before prompts were shared: rows by length alone, each computed whole."""
    from rollfleet.train import grpo, policy

    order, least = policy.micro_batch_order, grpo.MIN_SHARED_PREFIX
    policy.micro_batch_order = lambda rows: sorted(rows, key=lambda e: len(e.tokens))
    grpo.MIN_SHARED_PREFIX = 1 << 30
    try:
        yield
    finally:
        policy.micro_batch_order, grpo.MIN_SHARED_PREFIX = order, least


def shared_prompt(model: Any, tokenizer: Any) -> dict[str, Any]:
    """Whole rows against the shared prompt, one torch thread, alternating rounds."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rollfleet.train.policy import grpo_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    lora = get_peft_model(copy.deepcopy(model), config)
    optimizer = torch.optim.Adam([p for p in lora.parameters() if p.requires_grad], lr=1e-5)
    batch = group_rows(tokenizer)
    seconds: dict[str, list[float]] = {"whole": [], "shared": []}
    padding: dict[str, float] = {}
    for r in range(ROUNDS):
        for name in ("whole", "shared") if r % 2 == 0 else ("shared", "whole"):
            with whole_rows() if name == "whole" else nullcontext():
                stats = grpo_step(lora, optimizer, batch)
            assert stats is not None
            seconds[name].append(stats.seconds)
            padding[name] = stats.padding
            print(f"round {r + 1} {name}: {stats.seconds:.2f} s")
    torch.set_num_threads(threads)
    figures = {k: {**median_range(v), "runs": v, "padding": padding[k]} for k, v in seconds.items()}
    prompt = batch[0].prompt_length
    table(
        f"one GRPO step, {GROUPS} prompts ({prompt} tokens) x {GROUP} rows, LoRA q/v, 1 thread",
        ["side", "step s: median (min-max)", "padding"],
        [
            [k, f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})", f"{f['padding']:.3f}"]
            for k, f in figures.items()
        ],
    )
    return {
        "settings": {
            "groups": GROUPS,
            "group": GROUP,
            "prompt_tokens": prompt,
            "answer_tokens": [10, MAX_ANSWER],
            "torch_threads": 1,
            "rounds": ROUNDS,
        },
        **figures,
        "speedup": figures["whole"]["median"] / figures["shared"]["median"],
    }


def main() -> dict[str, Any]:
    """Measure, print, write bench/results/train_step.json."""
    import torch

    from rollfleet.train.policy import grpo_step, load_policy

    torch.manual_seed(0)
    model, tokenizer = load_policy()
    grouped = shared_prompt(model, tokenizer)
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
    return write_results(
        "train_step", {"settings": settings, "sides": figures, "shared_prompt": grouped}, COMMAND
    )


if __name__ == "__main__":
    main()
