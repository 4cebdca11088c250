"""``rollfleet train --trainer trl``: TRL's ``GRPOTrainer`` trains the bundled SmolLM2 while the
embedded fleet of ``rollfleet train`` generates (docs/trl.md).

The fleet (control plane on OUTPUT/store.db, the shared engine behind the gateway, the runner
processes) runs on an asyncio loop in a background thread; TRL's synchronous trainer runs here and
calls into it through :class:`~rollfleet.run.trl_rollout.FleetRollout`. One TRL step is one
coordinator batch (``tasks_per_step`` tasks × ``group_size`` samples). TRL checkpoints nothing
here and a run does not resume: the same command trains again from the bundled weights.

A TRL script of one's own takes the same fleet from :func:`trl_fleet` (its rollout_func; its
``tasks`` make the dataset) and the bundled model from :func:`trl_policy`.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from transformers import TrainerCallback

from rollfleet.errors import InvalidInput, RollfleetError
from rollfleet.run.options import RunOptions
from rollfleet.run.orchestrate import preflight
from rollfleet.run.outputs import claim_output_dir
from rollfleet.run.train import training_stack
from rollfleet.run.train_options import TrainOptions
from rollfleet.run.trl_rollout import (
    FleetRollout,
    LoopThread,
    fleet_reward,
    fleet_tasks,
    prompt_dataset,
)
from rollfleet.train import report
from rollfleet.train.policy import LORA_TARGETS, load_policy


def train_with_trl(
    opts: TrainOptions, console: Console, *, reward_funcs: Sequence[Any] | None = None
) -> list[dict[str, Any]]:
    """Train ``opts.steps`` TRL GRPO steps through the fleet; the metrics.jsonl records.

    ``reward_funcs`` replace :func:`fleet_reward` (TRL reward functions; the fleet's reward
    reaches them as ``env_reward``, the rollout ids as ``rollout_id``)."""
    with trl_fleet(opts, console) as rollout:
        records = _train(opts, rollout, console, reward_funcs)
    report.plot(
        records,
        opts.output_dir / report.PLOT,
        f"rollfleet train --trainer trl: {opts.mode}, {opts.data.name}",
    )
    return records


@contextmanager
def trl_fleet(opts: TrainOptions, console: Console) -> Iterator[FleetRollout]:
    """The embedded fleet of ``rollfleet train`` for a TRL script: its rollout_func until exit."""
    opts.check()
    if opts.max_staleness:
        raise InvalidInput(
            "--trainer trl generates each batch with the weights it trains: "
            "--max-staleness must be 0"
        )
    if opts.eval_data is not None:
        raise InvalidInput("--trainer trl does not evaluate: leave out --eval-data")
    run = opts.run_options()
    run.check()
    preflight(run)
    tasks = fleet_tasks(
        opts.data, opts.mode, max_tokens=opts.max_tokens, temperature=opts.temperature
    )
    claim_output_dir(opts.output_dir, "train")
    thread = LoopThread()
    up: Future[tuple[str, Any]] = Future()
    stop = asyncio.Event()
    serving = asyncio.run_coroutine_threadsafe(_serve(run, opts, console, up, stop), thread.loop)
    thread.watched.append(serving)
    first: list[Future[Any]] = [up, serving]
    try:
        wait(first, return_when=FIRST_COMPLETED)
        if not up.done():
            serving.result()  # the start-up's error
        url, gateway = up.result()
        rollout = FleetRollout(url, gateway, tasks, loop=thread)
        try:
            yield rollout
        finally:
            rollout.close()
    finally:
        thread.loop.call_soon_threadsafe(stop.set)
        wait([serving])
        thread.close()
    serving.result()


def trl_policy() -> tuple[Any, Any]:
    """``(model, tokenizer)``: the bundled SmolLM2 (``load_policy``) as transformers' Trainer
    takes it: float32 weights, dequantized on load, with the GGUF quantizer detached."""
    model, tokenizer = load_policy()
    packed = {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")}
    if packed:
        raise RollfleetError(f"the policy keeps GGUF-packed layers ({', '.join(sorted(packed))})")
    if getattr(model, "hf_quantizer", None) is not None:  # Trainer refuses a GGUF-quantized model
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


async def _serve(
    run: RunOptions,
    opts: TrainOptions,
    console: Console,
    up: Future[tuple[str, Any]],
    stop: asyncio.Event,
) -> None:
    """The embedded fleet of ``rollfleet train``, from start until ``stop`` is set."""
    async with training_stack(run, opts, console) as stack:
        stopped = asyncio.create_task(stop.wait())
        up.set_result((stack.url, stack.gateway))
        runners = stack.runners
        assert runners is not None  # training_stack started them
        try:
            await asyncio.wait([runners, stopped], return_when=asyncio.FIRST_COMPLETED)
            if runners.done():
                runners.result()
                raise RollfleetError("the runner fleet stopped during training")
        finally:
            stopped.cancel()


def _train(
    opts: TrainOptions,
    rollout: FleetRollout,
    console: Console,
    reward_funcs: Sequence[Any] | None,
) -> list[dict[str, Any]]:
    """Build GRPOTrainer on the bundled model with the fleet's rollout function, train, push."""
    import torch
    from peft import LoraConfig
    from transformers import PrinterCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    torch.manual_seed(opts.seed)
    model, tokenizer = trl_policy()
    rank = opts.lora_rank
    peft = (
        None
        if rank is None
        else LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
        )
    )
    args = GRPOConfig(
        output_dir=str(opts.output_dir / "trl"),
        max_steps=opts.steps,
        learning_rate=opts.lr,
        per_device_train_batch_size=opts.tasks_per_step * opts.group_size,
        num_generations=opts.group_size,
        gradient_accumulation_steps=1,
        max_completion_length=opts.max_tokens,
        temperature=opts.temperature,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        lr_scheduler_type="constant",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        seed=opts.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    metrics = _Metrics(rollout, opts, console)
    with warnings.catch_warnings():
        # TRL marks rollout_func experimental (docs/trl.md); peft asks transformers 5 an old name
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=list(reward_funcs or [fleet_reward]),
            args=args,
            train_dataset=prompt_dataset(rollout.tasks),
            processing_class=tokenizer,
            peft_config=peft,
            rollout_func=rollout,
            callbacks=[metrics],
        )
        trainer.remove_callback(PrinterCallback)  # the step lines below say it in one line each
        trainer.train()
    rollout.push(trainer)  # the engines end serving the last step's weights, as --trainer builtin
    return metrics.records


class _Metrics(TrainerCallback):
    """OUTPUT/metrics.jsonl from TRL's logs and the fleet's batch: a ``step`` record per step."""

    def __init__(self, rollout: FleetRollout, opts: TrainOptions, console: Console) -> None:
        """Start an empty metrics.jsonl."""
        self.rollout, self.console = rollout, console
        self.path = opts.output_dir / report.METRICS
        self.records: list[dict[str, Any]] = []
        report.rewrite(self.path, [])

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        """After each step's log (not the run's summary), append its record."""
        if not logs or "loss" not in logs or not self.rollout.batches:
            return
        step, batch = state.global_step - 1, self.rollout.batches[-1]
        record = {
            "kind": "step",
            "step": step,
            "version": step + 1,
            "batch": batch.batch_id,
            "generated_by": batch.version,
            "reward/mean": logs.get("reward"),
            "reward/std": logs.get("reward_std"),
            "fleet/reward/mean": batch.reward_mean,
            "loss": logs["loss"],
            "grad_norm": logs.get("grad_norm"),
            "entropy": logs.get("entropy"),
            "clipped": logs.get("clip_ratio/region_mean"),
            "experiences": batch.experiences,
            "missing": batch.missing,
            "action_tokens": batch.action_tokens,
            "staleness/max": batch.staleness_max,
            "seconds/generate": batch.seconds_generate,
            "seconds/sync": batch.seconds_sync,
            "seconds/step": logs.get("step_time"),
        }
        self.records.append(record)
        report.append(self.path, record)
        reward, seconds = record["reward/mean"] or 0.0, record["seconds/step"] or 0.0
        self.console.print(
            f"step {step}: reward {reward:.3f} · {seconds:.1f} s/step", soft_wrap=True
        )
