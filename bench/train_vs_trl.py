"""``rollfleet train`` against the loop a TRL user writes without rollfleet: TRL's GRPOTrainer.

The TRL side is TRL 1.16's ``GRPOTrainer`` generating with its own model through transformers
(``model.generate``, no vLLM: none on a CPU), on the same SmolLM2-135M-Instruct in HF form
(``load_policy()``'s float32 model, the GGUF quantizer detached as ``trl_policy()`` does). The
rollfleet sides are ``rollfleet train`` at ``--max-staleness`` 0 and 1: the shared llama.cpp
engine generates, a runner process runs the agent loop, the trainer steps and pushes the adapter.

Equal settings on every side: the arithmetic split (``examples/arith.jsonl``; the same tasks in
the same order: TRL's sampler unshuffled, so step ``s`` takes tasks ``4s`` to ``4s + 3`` as
rollfleet does), math mode's system and user prompts (chat messages for TRL: the prompt token
ids are the same), the reward of ``rollfleet.envs.math.math_reward`` (TRL's reward function
calls it), TASKS prompts x GROUP samples a step (one optimizer step a batch, micro-batches of 4
rows on both sides), MAX_TOKENS tokens, temperature 1 with no top-k/top-p, LoRA r=16 alpha 32 on
q_proj/v_proj, lr 5e-4 constant, Adam(W) with no weight decay, gradient clipped at 1.0, the
clipped surrogate 0.2/0.28 with the token-mean ("dapo") loss, no KL (TRL beta=0, rollfleet
kl_coef 0), seed 0. TRL runs on the CPU in float32 with no activation checkpointing (its
defaults, bf16 and checkpointing, are slower on this CPU). One thread for each generator and
each trainer (TORCH_THREADS, ENGINE_THREADS): on this 2-core machine, shared with other
benchmarks, 2 threads beside a busy process made steps many times slower on both sides.

Each run is its own process (the model loaded there, its memory gone after). Rounds alternate
the order (TRL K0 K1, K1 K0 TRL, ...); every side trains STEPS steps (the same number of
samples). Per side: samples/s (samples trained over the training loop's time: the sum of the
step times; model load and start-up are reported apart), the median step time over every step
but the first and its split (rollfleet: waiting for the batch / training / checkpoint and push;
TRL: generating and scoring, timed around ``_generate_and_score_completions`` / the rest of the
step), how many cores other processes kept busy meanwhile, and held-out greedy reward. One
evaluator for every side: the LoRA weights after each step are kept; the bundled model in
transformers with those weights answers EVAL_TASKS held-out tasks greedily (left-padded batches,
MAX_TOKENS tokens) and ``math_reward`` scores them. Reward is given after STEPS steps (equal
samples) and at the same wall time: the round's fastest side's loop time, each side judged by
the last step it had finished by then (a side that had finished none: the untrained model).

Finished runs are kept in a temporary directory until the results are written: the same
command, after a kill from outside, goes on from the last finished run (each run records when it
finished).

Run: ``python -m bench train_vs_trl`` (needs rollfleet[train,llamacpp,trl]).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from bench._common import ROOT, median_range, table, write_results
from bench._trl_sides import (
    ENGINE_THREADS,
    EVAL_DATA,
    GROUP,
    LORA_RANK,
    LR,
    MAX_TOKENS,
    SEED,
    STEPS,
    TASKS,
    TEMPERATURE,
    TORCH_THREADS,
    TRL_MICRO,
    State,
    lora_config,
    lora_only,
    messages,
    quiet,
    tasks,
)

ROUNDS = 2
EVAL_TASKS = 50  # the first 50 of the 100 held-out tasks
EVAL_BATCH = 50
SIDES = ("trl", "k0", "k1")
NAMES = {"trl": "TRL GRPOTrainer", "k0": "rollfleet K=0", "k1": "rollfleet K=1"}
COMMAND = "python -m bench train_vs_trl"


# -------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Held-out greedy reward of a LoRA state on the bundled model in transformers."""

    def __init__(self) -> None:
        """The bundled model with LoRA slots; the held-out prompts rendered by its template."""
        from peft import get_peft_model

        from rollfleet.run.trl import trl_policy

        model, self.tokenizer = trl_policy()
        with quiet():
            self.model = get_peft_model(model, lora_config()).eval()
        self.tokenizer.padding_side = "left"
        self.tasks = tasks(EVAL_DATA)[:EVAL_TASKS]
        self.prompts = [
            self.tokenizer.apply_chat_template(
                messages(t), add_generation_prompt=True, tokenize=False
            )
            for t in self.tasks
        ]
        self.names = set(lora_only(self.model.named_parameters()))
        self.seconds: list[float] = []

    def reward(self, state: State | None) -> dict[str, float]:
        """Mean reward and its standard error; ``state`` None: the untrained model."""
        import torch

        from rollfleet.envs.math import math_reward

        began = time.perf_counter()
        if state is not None:
            if set(state) != self.names:
                raise RuntimeError(f"LoRA names differ: {sorted(set(state) ^ self.names)[:4]}")
            self.model.load_state_dict(state, strict=False)
        texts: list[str] = []
        off = self.model.disable_adapter() if state is None else nullcontext()
        with torch.no_grad(), off:
            for i in range(0, len(self.prompts), EVAL_BATCH):
                enc = self.tokenizer(
                    self.prompts[i : i + EVAL_BATCH],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                ids = self.model.generate(
                    **enc,
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
                texts += self.tokenizer.batch_decode(
                    ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
                )
        scores = [
            math_reward(t, task["answer"]).reward for t, task in zip(texts, self.tasks, strict=True)
        ]
        self.seconds.append(time.perf_counter() - began)
        mean = statistics.fmean(scores)
        err = statistics.stdev(scores) / len(scores) ** 0.5 if len(scores) > 1 else 0.0
        return {"reward": mean, "stderr": err}


# ------------------------------------------------------------------------------------- main


def cpu_seconds() -> tuple[float, float]:
    """The machine's busy CPU seconds so far (/proc/stat), and this process's with its
    finished children's (a side's process and its runner processes)."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return float("nan"), 0.0
    user, nice, system, _idle, _wait, irq, softirq, steal = map(int, first[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )
    return busy, own


def cache_dir() -> Path:
    """Where finished runs wait for the results file: the same settings and the same code find
    them again, so a bench killed from outside (this machine is shared) goes on from its last
    finished run, and one run again after a change to the code starts afresh."""
    code = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout
    changes = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "HEAD", "--", "src", "bench"], capture_output=True
    ).stdout
    settings = [
        code.strip(),
        hashlib.sha256(changes).hexdigest(),
        ROUNDS,
        STEPS,
        TASKS,
        GROUP,
        MAX_TOKENS,
        LR,
        LORA_RANK,
        TEMPERATURE,
        SEED,
        TORCH_THREADS,
        ENGINE_THREADS,
        TRL_MICRO,
    ]
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"bench-train-vs-trl-{key}"


def cached_run(name: str, side: str) -> tuple[dict[str, Any], dict[int, State]]:
    """:func:`run_side`, or the run of that ``name`` finished before (see :func:`cache_dir`)."""
    import torch

    where = cache_dir()
    figures, weights = where / f"{name}.json", where / f"{name}.pt"
    if figures.exists() and weights.exists():
        print(f"{name}: the run finished at {json.loads(figures.read_text())['finished']}")
        return json.loads(figures.read_text()), torch.load(weights, weights_only=True)
    found, states = run_side(side)
    found["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    where.mkdir(exist_ok=True)
    torch.save(states, weights)
    figures.write_text(json.dumps(found))
    return found, states


def run_side(side: str) -> tuple[dict[str, Any], dict[int, State]]:
    """One side's run in a process of its own (tried again once if that process dies); its
    figures, with ``other_cores`` (the cores other processes kept busy meanwhile on average),
    and its adapter after each step."""
    import torch

    for attempt in (1, 2):
        print(f"{NAMES[side]}: started {time.strftime('%H:%M:%S')}", flush=True)
        out = Path(tempfile.mkdtemp(prefix=f"bench-vs-trl-{side}-"))
        try:
            busy, own = cpu_seconds()
            began = time.perf_counter()
            with (out / "log.txt").open("w") as log:
                code = subprocess.run(
                    [sys.executable, "-m", "bench._trl_sides", side, str(out)],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=False,
                ).returncode
            took = time.perf_counter() - began
            busy2, own2 = cpu_seconds()
            if code == 0:
                found = json.loads((out / "run.json").read_text())
                states = torch.load(out / "states.pt", weights_only=True)
                found["process_s"] = took
                found["other_cores"] = ((busy2 - busy) - (own2 - own)) / took
                found["attempts"] = attempt
                return found, states
            tail = (out / "log.txt").read_text(errors="replace")[-2000:]
            print(f"{NAMES[side]}: its process exited {code} (attempt {attempt}):\n{tail}")
        finally:
            shutil.rmtree(out, ignore_errors=True)
    raise RuntimeError(f"{NAMES[side]}: its process failed twice")


def steps_by(run: dict[str, Any], budget: float) -> int:
    """How many steps the run had finished ``budget`` seconds into its loop."""
    return sum(end <= budget + 1e-9 for end in run["step_ends_s"])


def fmt(f: dict[str, float], digits: int = 2) -> str:
    """``median (min-max)``."""
    return f"{f['median']:.{digits}f} ({f['min']:.{digits}f}-{f['max']:.{digits}f})"


def main() -> dict[str, Any]:
    """Measure, print, write bench/results/train_vs_trl.json."""
    import torch

    if TORCH_THREADS is not None:
        torch.set_num_threads(TORCH_THREADS)
    began = time.perf_counter()
    evaluator = Evaluator()
    untrained = evaluator.reward(None)
    print(f"untrained: held-out reward {untrained['reward']:.3f} ± {untrained['stderr']:.3f}")
    orders = [list(SIDES) if r % 2 == 0 else list(SIDES)[::-1] for r in range(ROUNDS)]
    rounds: list[dict[str, Any]] = []
    for r, order in enumerate(orders):
        runs: dict[str, dict[str, Any]] = {}
        states: dict[str, dict[int, State]] = {}
        for side in order:
            found, states[side] = cached_run(f"round{r + 1}-{side}", side)
            runs[side] = found
            print(
                f"round {r + 1} {NAMES[side]}: "
                + " ".join(f"{s['step_s']:.1f}" for s in found["steps"])
                + f" s/step, loop {found['loop_s']:.0f} s, start-up {found['startup_s']:.0f} s,"
                f" {found['samples_per_s']:.2f} samples/s, other processes"
                f" {found['other_cores']:.2f} cores",
                flush=True,
            )
        budget = min(run["loop_s"] for run in runs.values())
        for side, run in runs.items():
            at = steps_by(run, budget)
            run["heldout"] = evaluator.reward(states[side][STEPS])
            run["budget_steps"] = at
            run["heldout_at_budget"] = (
                run["heldout"]
                if at == STEPS
                else (untrained if at == 0 else evaluator.reward(states[side][at]))
            )
            print(
                f"round {r + 1} {NAMES[side]}: held-out {run['heldout']['reward']:.3f} after"
                f" {STEPS} steps; {run['heldout_at_budget']['reward']:.3f} at {budget:.0f} s"
                f" ({at} steps)",
                flush=True,
            )
        rounds.append({"order": order, "budget_s": budget, "runs": runs})
    sides: dict[str, Any] = {}
    for side in SIDES:
        runs_ = [rnd["runs"][side] for rnd in rounds]
        later = [s for run in runs_ for s in run["steps"][1:]]
        sides[side] = {
            "samples_per_s": median_range([run["samples_per_s"] for run in runs_]),
            "loop_s": median_range([run["loop_s"] for run in runs_]),
            "startup_s": median_range([run["startup_s"] for run in runs_]),
            "step_s": median_range([s["step_s"] for s in later]),
            "split_s": {
                key: statistics.median(s[key] for s in later)
                for key in ("generate_s", "train_s", "sync_s")
            },
            "heldout": median_range([run["heldout"]["reward"] for run in runs_]),
            "heldout_at_budget": median_range(
                [run["heldout_at_budget"]["reward"] for run in runs_]
            ),
            "budget_steps": [run["budget_steps"] for run in runs_],
            "untrained_steps": sum(not s["trained"] for run in runs_ for s in run["steps"]),
            "samples": [run["samples"] for run in runs_],
            "other_cores": [round(run["other_cores"], 2) for run in runs_],
        }
    trl = sides["trl"]["samples_per_s"]["median"]
    for side in sides.values():
        side["vs_trl"] = side["samples_per_s"]["median"] / trl
    table(
        f"GRPO {STEPS} steps x {TASKS} x {GROUP} samples, {MAX_TOKENS} tokens, LoRA r={LORA_RANK},"
        f" {ROUNDS} rounds, median (min-max)",
        [
            "side",
            "samples/s",
            "vs TRL",
            "step s",
            "gen / train / sync s",
            "loop s",
            "start-up s",
            f"held-out after {STEPS} steps",
            "held-out at same wall time",
        ],
        [
            [
                NAMES[k],
                fmt(s["samples_per_s"]),
                f"{s['vs_trl']:.2f}x",
                fmt(s["step_s"], 1),
                " / ".join(
                    f"{s['split_s'][key]:.1f}" for key in ("generate_s", "train_s", "sync_s")
                ),
                fmt(s["loop_s"], 0),
                fmt(s["startup_s"], 0),
                fmt(s["heldout"]),
                fmt(s["heldout_at_budget"]) + f" ({'/'.join(map(str, s['budget_steps']))} steps)",
            ]
            for k, s in sides.items()
        ],
    )
    settings = {
        "rounds": ROUNDS,
        "orders": orders,
        "steps": STEPS,
        "tasks_per_step": TASKS,
        "group": GROUP,
        "samples_per_step": TASKS * GROUP,
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "top_p": 1.0,
        "top_k": "none",
        "lr": LR,
        "lr_schedule": "constant",
        "lora": {"r": LORA_RANK, "alpha": 2 * LORA_RANK, "targets": ["q_proj", "v_proj"]},
        "clip": [0.2, 0.28],
        "kl": 0.0,
        "seed": SEED,
        "data": "examples/arith.jsonl",
        "eval": {
            "data": "examples/arith_eval.jsonl",
            "tasks": EVAL_TASKS,
            "greedy": True,
            "max_tokens": MAX_TOKENS,
            "evaluator": "transformers float32 + LoRA, one for all",
            "seconds_each": statistics.median(evaluator.seconds),
        },
        "trl": {
            "version": _version("trl"),
            "per_device_train_batch_size": TRL_MICRO,
            "gradient_accumulation_steps": TASKS * GROUP // TRL_MICRO,
            "generation_batch_size": TASKS * GROUP,
            "num_generations": GROUP,
            "loss_type": "dapo",
            "beta": 0.0,
            "bf16": False,
            "activation_checkpointing": False,
            "generation": "transformers model.generate (no vLLM)",
        },
        "torch_threads": TORCH_THREADS or torch.get_num_threads(),
        "engine_threads": ENGINE_THREADS or "rollfleet's default",
        "processes": "each run in a process of its own; the evaluator in the parent",
    }
    figures = {
        "settings": settings,
        "untrained_heldout": untrained,
        "sides": sides,
        "rounds": rounds,
        "wall_s": time.perf_counter() - began,
    }
    written = write_results("train_vs_trl", figures, COMMAND)
    shutil.rmtree(cache_dir(), ignore_errors=True)
    return written


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
