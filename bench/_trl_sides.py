"""One side's training run for bench/train_vs_trl.py, in a process of its own: ``rollfleet train``
at a max staleness K, or TRL's ``GRPOTrainer`` generating through transformers, with the settings
every side shares. ``python -m bench._trl_sides SIDE OUT`` writes OUT/run.json (the run's figures)
and OUT/states.pt (the LoRA adapter after each step)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from bench._common import ROOT

STEPS, TASKS, GROUP, MAX_TOKENS = 6, 4, 8, 48
LR, LORA_RANK, TEMPERATURE, SEED = 5e-4, 16, 1.0, 0
# One thread for each generator and each trainer (None: the defaults, 2 here): with another
# process busy on one of the 2 cores, 2 torch threads made TRL's steps 5-10x slower (350 s
# instead of 44 s) and 2 llama.cpp threads rollfleet's generation (84-180 s instead of 15 s).
TORCH_THREADS: int | None = 1  # TRL's generation and training, rollfleet's trainer, the eval
ENGINE_THREADS: int | None = 1  # rollfleet's llama.cpp engine
TRL_MICRO = 4  # TRL's per_device_train_batch_size (rollfleet's micro-batch); accumulation: 8
EXAMPLES = ROOT / "src" / "rollfleet" / "examples"
DATA, EVAL_DATA = EXAMPLES / "arith.jsonl", EXAMPLES / "arith_eval.jsonl"

State = dict[str, Any]  # LoRA tensors by name


def lora_only(named: Iterator[tuple[str, Any]]) -> State:
    """The LoRA matrices of a peft model, cloned, by their name inside the peft model."""
    return {
        n[n.index("base_model.model.") :]: p.detach().clone()
        for n, p in named
        if "lora_" in n and p.requires_grad
    }


def tasks(path: Path) -> list[dict[str, Any]]:
    """The tasks of a .jsonl file as math mode reads them."""
    from rollfleet.envs import get_mode
    from rollfleet.envs.tasks import load_tasks

    return [t.task for t in load_tasks(path, get_mode("math"))]


def messages(task: dict[str, Any]) -> list[dict[str, str]]:
    """Math mode's prompt as chat messages, as its agent sends them."""
    from rollfleet.envs import get_mode

    mode = get_mode("math")
    return [
        {"role": "system", "content": mode.system_prompt(task)},
        {"role": "user", "content": mode.user_prompt(task)},
    ]


def lora_config() -> Any:
    """The adapter every side trains (rollfleet's own: r=16, alpha 32, q_proj and v_proj)."""
    from peft import LoraConfig

    from rollfleet.train.policy import LORA_TARGETS

    return LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
    )


@contextmanager
def quiet() -> Iterator[None]:
    """Silence peft's deprecation warning under transformers 5 (as rollfleet does)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is dep")
        yield


def finish(steps: list[dict[str, Any]], wall: float, states: dict[int, State]) -> dict[str, Any]:
    """A run's figures from its steps: loop time, start-up, samples/s, when each step ended."""
    loop = sum(s["step_s"] for s in steps)
    ends, t = [], 0.0
    for s in steps:
        t += s["step_s"]
        ends.append(t)
    samples = sum(s["samples"] for s in steps)
    return {
        "wall_s": wall,
        "loop_s": loop,
        "startup_s": wall - loop,
        "samples": samples,
        "samples_per_s": samples / loop,
        "step_ends_s": ends,
        "steps": steps,
        "states": states,
    }


# ---------------------------------------------------------------------------- rollfleet train


def rollfleet_run(k: int, out: Path, began: float) -> dict[str, Any]:
    """``rollfleet train`` STEPS steps at max_staleness ``k`` (as bench/train.py runs it); its
    steps, times and the adapter after each step (kept as each checkpoint is saved)."""
    from rollfleet.run.train import train
    from rollfleet.run.train_options import TrainOptions
    from rollfleet.train import checkpoint

    opts = TrainOptions(
        mode="math",
        data=DATA,
        output_dir=out,
        steps=STEPS,
        tasks_per_step=TASKS,
        group_size=GROUP,
        max_staleness=k,
        lr=LR,
        lora_rank=LORA_RANK,
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        seed=SEED,
        extra={} if ENGINE_THREADS is None else {"engine_threads": ENGINE_THREADS},
    )
    states: dict[int, State] = {}
    save = checkpoint.save

    def keep(root: Path, step: int, model: Any, *args: Any, **kw: Any) -> Path:
        states[step + 1] = lora_only(model.named_parameters())
        return save(root, step, model, *args, **kw)

    checkpoint.save = keep  # type: ignore[assignment]
    try:
        records = asyncio.run(train(opts, Console(quiet=True)))
    finally:
        checkpoint.save = save  # type: ignore[assignment]
    wall = time.perf_counter() - began
    steps = [
        {
            "step_s": r["seconds/step"],
            "generate_s": r["seconds/wait"],  # waiting for the batch the fleet generates
            "train_s": r["seconds/train"],
            "sync_s": r["seconds/checkpoint"] + r["seconds/sync"],
            "samples": r["experiences"],
            "trained": r["trained"],
            "reward": r["reward/mean"],
        }
        for r in records
        if r["kind"] == "step"
    ]
    return finish(steps, wall, states)


# ------------------------------------------------------------------------------ TRL's trainer


def trl_run(out: Path, began: float) -> dict[str, Any]:
    """TRL's GRPOTrainer STEPS steps on the bundled model, generating with transformers."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollfleet.envs.math import math_reward
    from rollfleet.run.trl import trl_policy

    def arith_reward(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
        """rollfleet's math reward on each completion's text."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_reward(t, a).reward for t, a in zip(texts, answer, strict=True)]

    generating: list[float] = []

    class Timed(GRPOTrainer):  # type: ignore[misc]
        """GRPOTrainer with its generation (and scoring) timed."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            began = time.perf_counter()
            found = super()._generate_and_score_completions(inputs)
            generating.append(time.perf_counter() - began)
            return found

    steps: list[dict[str, Any]] = []
    states: dict[int, State] = {}
    rewards: list[float] = []

    class Steps(TrainerCallback):  # type: ignore[misc]
        """Each optimizer step's time, generation time and the adapter after it."""

        began = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            generating.clear()
            self.began = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            took = time.perf_counter() - self.began
            states[state.global_step] = lora_only(kw["model"].named_parameters())
            gen = sum(generating)
            steps.append(
                {
                    "step_s": took,
                    "generate_s": gen,
                    "train_s": took - gen,
                    "sync_s": 0.0,
                    "samples": TASKS * GROUP,
                    "trained": True,
                }
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    torch.manual_seed(SEED)
    model, tokenizer = trl_policy()
    train = Dataset.from_list(
        [{"prompt": messages(t), "answer": t["answer"]} for t in tasks(DATA)[: STEPS * TASKS]]
    )
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=TRL_MICRO,
        gradient_accumulation_steps=TASKS * GROUP // TRL_MICRO,
        generation_batch_size=TASKS * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=SEED,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    with quiet():
        trainer = Timed(
            model=model,
            reward_funcs=[arith_reward],
            args=args,
            train_dataset=train,
            processing_class=tokenizer,
            peft_config=lora_config(),
            callbacks=[Steps()],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    wall = time.perf_counter() - began
    for s, r in zip(steps, rewards, strict=False):
        s["reward"] = r
    return finish(steps, wall, states)


def side_main(side: str, out: Path) -> None:
    """One side's run in this process: ``out``/run.json (its figures) and ``out``/states.pt
    (the adapter after each step)."""
    began = time.perf_counter()
    import torch

    if TORCH_THREADS is not None:
        torch.set_num_threads(TORCH_THREADS)
    work = out / "work"
    work.mkdir()
    found = trl_run(work, began) if side == "trl" else rollfleet_run(int(side[1:]), work, began)
    torch.save(found.pop("states"), out / "states.pt")
    (out / "run.json").write_text(json.dumps(found))


if __name__ == "__main__":
    side_main(sys.argv[1], Path(sys.argv[2]))
