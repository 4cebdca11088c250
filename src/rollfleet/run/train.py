"""The training loop through the fleet (issue 18): GRPO on a local model (the bundled SmolLM2 by
default, ``model``: a GGUF file or a transformers model directory), resumable.

Per step ``s``: the coordinator holds batch ``step-s`` (``tasks_per_step`` tasks, ``group_size``
samples each; batches up to ``s + max_staleness`` are submitted ahead and admitted as the bound
allows), the runners generate through the shared llama.cpp engine behind the gateway with the
same agent loop and environments as ``rollfleet run``, ``finalize_train_batch`` returns it, the
experiences (the engine's logprobs, GRPO advantages) train the policy one step
(:class:`rollfleet.train.policy.Policy`: LoRA on q/v by default, full fine-tuning by choice), the
trainer checkpoints, pushes the new weights to the gateway as version ``s + 1`` (under LoRA a
delta of the merged q/v matrices) and tells the coordinator the engines serve it. Every
``eval_every`` steps (and before the first and after the last) the eval split is answered greedily
by the version served: an eval batch, ahead of queued training work.

Durable: batches live in the store (``OUTPUT/store.db``), the checkpoint is written before the
push it precedes, so a kill -9 at any point and the same command again resume from the last
checkpointed step: the engines get its weights again, finished batches are not regenerated, the
batch whose training was cut short is trained on from the store (no sample lost or used twice).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollfleet.coordinator import CoordinatorClient
from rollfleet.coordinator.experiences import Experience, read_experiences
from rollfleet.envs import get_mode
from rollfleet.envs.base import Transcript, score_of, turn_reward
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput
from rollfleet.run.options import RunOptions
from rollfleet.run.orchestrate import preflight, runner_fleet
from rollfleet.run.outputs import claim_output_dir
from rollfleet.run.stack import LocalStack, local_stack
from rollfleet.run.tasks import build_specs
from rollfleet.run.train_options import TrainOptions
from rollfleet.train import checkpoint, report

EVAL_PRIORITY = 10  # eval rollouts are claimed before queued training work


async def train(opts: TrainOptions, console: Console) -> list[dict[str, Any]]:
    """Run (or resume) every step; returns the records written to OUTPUT/metrics.jsonl."""
    import torch

    from rollfleet.train.policy import Policy, load_policy

    opts.check()
    run = opts.run_options()
    run.check()
    mode = get_mode(opts.mode)
    tasks = load_tasks(opts.data, mode)
    evals = load_tasks(opts.eval_data, mode) if opts.eval_data else []
    preflight(run)
    await _check_reward(opts.mode, tasks[0].task)
    specs = build_specs(tasks, path=opts.data, mode=opts.mode, samples=1, settings=run.settings())
    # one greedy answer a task, or eval_samples answers at the training temperature
    sampled = run.settings() if opts.eval_samples > 1 else {**run.settings(), "temperature": 0.0}
    eval_specs = (
        build_specs(
            evals, path=opts.eval_data or opts.data, mode=opts.mode, samples=1, settings=sampled
        )
        if evals
        else []
    )
    claim_output_dir(opts.output_dir, "train")
    resumable = checkpoint.find(opts.output_dir / "checkpoints", opts.fingerprint())
    torch.manual_seed(opts.seed)
    torch.set_num_threads(opts.trainer_threads or opts.cores_by_phase()[1])
    model = load_policy(opts.model)[0]
    policy = Policy(model, lr=opts.lr, lora_rank=opts.lora_rank, loss=opts.loss())
    console.print(
        f"policy {opts.model_name()} ({policy.trainable_params:,} trainable parameters)",
        soft_wrap=True,
    )
    found = (
        None if resumable is None else checkpoint.load(resumable, policy.model, policy.optimizer)
    )
    loop = _Loop(opts, policy, specs, eval_specs, [] if found is None else found.records)
    report.rewrite(loop.metrics, loop.records)
    start = 0 if found is None else found.step + 1
    if found is not None:
        console.print(f"resuming after step {found.step} from {found.path}", soft_wrap=True)
    async with training_stack(run, opts, console) as fleet:
        console.print(
            f"control plane and dashboard (Batches: the steps): {fleet.url}", soft_wrap=True
        )
        loop.coordinator, loop.gateway = CoordinatorClient(fleet.url), fleet.gateway
        try:
            await loop.run(start, console)
        finally:
            await loop.coordinator.close()
            if loop.board is not None:
                loop.board.close()
    report.plot(
        loop.records,
        opts.output_dir / report.PLOT,
        f"rollfleet train: {opts.mode}, {opts.data.name}, K={opts.max_staleness}"
        + (f", {opts.model.name}" if opts.model is not None else ""),
    )
    return loop.records


@asynccontextmanager
async def training_stack(
    run: RunOptions, opts: TrainOptions, console: Console
) -> AsyncIterator[LocalStack]:
    """The local stack a training run generates with, up: the control plane on OUTPUT/store.db
    (its experiences in OUTPUT/experiences), the shared engine behind the gateway (transformers
    with ``--engine hf``), the runner processes."""
    db = None if run.store is not None else run.output_dir / "store.db"
    experiences = opts.output_dir / "experiences"
    async with local_stack(db, url=run.store, token=run.token, experience_dir=experiences) as stack:
        engine = hf_engine(run.num_rollouts, opts.model) if opts.engine == "hf" else None
        llm = await stack.serve_llm(run, console, engine)
        stack.start_runners(runner_fleet(stack.url, run, llm))
        yield stack


def hf_engine(slots: int, path: Path | None = None) -> Any:
    """The policy's model (``path``, default the bundled one) served by transformers
    (``--engine hf``), as the policy starts."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.train.policy import load_policy

    model, tokenizer = load_policy(path)
    return HFEngine(model.eval().requires_grad_(False), tokenizer, max_batch=min(64, slots))


async def _check_reward(mode: str, task: dict[str, Any]) -> None:
    """Score an empty answer to the first task: a reward function that raises fails now, named,
    not in every rollout of the run (a mode whose session needs its environment is not checked)."""
    try:
        session = await get_mode(mode).open(task, None)
    except Exception:  # it needs the runner's environment: the rollouts will tell
        return
    try:
        await score_of(session, "", Transcript())
    except Exception as exc:
        raise InvalidInput(
            f"mode {mode}: its reward raised {type(exc).__name__}: {exc} (scoring an empty "
            "answer to the first task); fix the reward before training on it"
        ) from exc
    try:
        await turn_reward(session, "", [])
    except Exception as exc:
        raise InvalidInput(
            f"mode {mode}: its per-turn reward raised {type(exc).__name__}: {exc} (scoring an "
            "empty first turn of the first task); fix it before training on it"
        ) from exc


class _Loop:
    """The steps of one run: submit ahead, finalize, train, checkpoint, push, evaluate."""

    def __init__(
        self,
        opts: TrainOptions,
        policy: Any,
        specs: list[Any],
        eval_specs: list[Any],
        records: list[dict[str, Any]],
    ) -> None:
        """Start from ``records`` (a checkpoint's, or none)."""
        self.opts, self.policy, self.specs, self.eval_specs = opts, policy, specs, eval_specs
        self.records = records
        self.metrics = opts.output_dir / report.METRICS
        self.board = (
            report.TensorBoard(opts.output_dir / report.TENSORBOARD) if opts.report_to else None
        )
        self.coordinator: CoordinatorClient = None  # type: ignore[assignment]
        self.gateway: Any = None

    def _record(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        report.append(self.metrics, record)
        if self.board is not None:
            self.board.write(record)

    async def run(self, start: int, console: Console) -> None:
        """Steps ``start`` to ``steps - 1``, with a live display."""
        opts = self.opts
        if start > 0:  # a fresh engine serves version 0: give it the checkpoint's weights
            await self._push(start)
        else:
            await self.coordinator.set_policy_version(0)
        await self._evaluate(start)
        existing = {b.batch_id for b in await self.coordinator.list_batches()}
        submitted = start
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[last]}"),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("training", total=opts.steps, completed=start, last="")
            for step in range(start, opts.steps):
                while submitted < opts.steps and submitted <= step + opts.max_staleness:
                    if f"step-{submitted}" not in existing:
                        await self._submit(submitted)
                    submitted += 1
                record = await self._step(step)
                last = f"reward {record['reward/mean']:.3f} · {record['seconds/step']:.1f} s/step"
                if (step + 1) % opts.eval_every == 0 or step + 1 == opts.steps:
                    found = await self._evaluate(step + 1)
                    if found is not None:
                        last += f" · eval {found['reward']:.3f} ± {found['stderr']:.3f}"
                progress.update(bar, advance=1, last=last)
                console.print(f"step {step}: {last}", soft_wrap=True)

    async def _submit(self, index: int) -> None:
        """Batch ``step-index``: the next tasks of the training data, ``group_size`` each."""
        n = self.opts.tasks_per_step
        chosen = [self.specs[(index * n + i) % len(self.specs)] for i in range(n)]
        await self.coordinator.submit_batch(
            f"step-{index}",
            chosen,
            repeat_times=self.opts.group_size,
            max_staleness=self.opts.max_staleness,
        )

    async def _push(self, version: int, changed: bool = True) -> float:
        """Send the policy to the engines as ``version`` (no tensor when the step ``changed``
        nothing), report it; the seconds it took."""
        from rollfleet.train.policy import publish

        began = time.perf_counter()
        await publish(
            self.policy.model,
            self.gateway,
            self.coordinator,
            version,
            base=self.gateway.weights_version,
            changed=changed,
        )
        return time.perf_counter() - began

    async def _step(self, step: int) -> dict[str, Any]:
        """Finalize batch ``step``, train on it, checkpoint, push version ``step + 1``."""
        began = time.perf_counter()
        result = await self.coordinator.finalize_train_batch(f"step-{step}")
        waited = time.perf_counter()
        stats = await self.coordinator.process_experiences(
            f"step-{step}", estimator=self.opts.estimator
        )
        rows = [r for r in read_experiences(stats.path) if r.logprobs is not None]
        trained = time.perf_counter()
        # In a thread of its own: this event loop serves the gateway the runners generate
        # through, so the next batch is generated while this one trains.
        figures = await asyncio.to_thread(self.policy.step, rows) if _signal(rows) else None
        saved = time.perf_counter()
        record = {
            "kind": "step",
            "step": step,
            "version": step + 1,
            "reward/mean": result.metrics.get("reward/mean", 0.0),
            "reward/std": result.metrics.get("reward/std", 0.0),
            "experiences": len(rows),
            **_figures(figures, rows),
            **_agent_figures(result.metrics, result.rollout_count),
            "merge_breaks": stats.merge_breaks,
            "rows_per_rollout": stats.metrics.get("rows_per_rollout/mean", 0.0),
            "seconds/wait": waited - began,
            "seconds/train": saved - trained,
        }
        ckpt = time.perf_counter()
        await asyncio.to_thread(
            checkpoint.save,
            self.opts.output_dir / "checkpoints",
            step,
            self.policy.model,
            self.policy.optimizer,
            self.records + [record],
            self.opts.fingerprint(),
        )
        record["seconds/checkpoint"] = time.perf_counter() - ckpt
        record["pushed"] = figures is not None  # a step that trained nothing sends no tensor
        record["seconds/sync"] = await self._push(step + 1, changed=record["pushed"])
        record["seconds/step"] = time.perf_counter() - began
        record["tokens/s"] = record["action_tokens"] / record["seconds/step"]
        self._record(record)
        return record

    async def _evaluate(self, version: int) -> dict[str, Any] | None:
        """Answer the eval split with the weights ``version`` served now (once): greedily, or
        ``eval_samples`` times a task (then with pass@k and mean@n)."""
        if not self.eval_specs or any(
            r["kind"] == "eval" and r["version"] == version for r in self.records
        ):
            return None
        began = time.perf_counter()
        batch = f"eval-{version}"
        if batch not in {b.batch_id for b in await self.coordinator.list_batches()}:
            await self.coordinator.submit_batch(
                batch,
                self.eval_specs,
                batch_type="eval",
                repeat_times=self.opts.eval_samples,
                priority=EVAL_PRIORITY,
            )
        result = await self.coordinator.finalize_eval_batch(batch)
        metrics, n = result.metrics, max(1, result.rollout_count)
        success = metrics.get("metric/correct/mean")
        record = {
            "kind": "eval",
            "version": version,
            "reward": metrics.get("reward/mean", 0.0),
            "stderr": metrics.get("reward/std", 0.0) / (n - 1 or 1) ** 0.5,
            "success": success,  # the share of answers the mode calls correct
            "success_stderr": None if success is None else (success * (1 - success) / n) ** 0.5,
            "tool_call_rate": metrics.get("metric/used_tools/mean"),
            "turns": metrics.get("metric/turns/mean"),
            **{k: v for k, v in metrics.items() if k.startswith(("pass@", "mean@"))},
            "tasks": result.finished_task_count,
            "samples": self.opts.eval_samples,
            "seconds": time.perf_counter() - began,
        }
        self._record(record)
        return record


def _signal(rows: list[Experience]) -> bool:
    """True when some row has an advantage to learn from (a batch of zeros teaches nothing)."""
    return any(r.advantage or any(r.token_advantages or ()) for r in rows)


def _agent_figures(metrics: dict[str, float], rollouts: int) -> dict[str, float]:
    """What the agents did in a batch: turns, tool calls, the share of rollouts that used a
    tool, tool errors, replies thrown away, and failed rollouts."""
    out = {
        name: metrics.get(f"metric/{name}/mean", 0.0)
        for name in ("turns", "tool_calls", "tool_errors", "discarded")
    }
    out["tool_call_rate"] = metrics.get("metric/used_tools/mean", 0.0)
    out["failed"] = sum(v for k, v in metrics.items() if k.startswith("failures/"))
    out["rollouts"] = float(rollouts)
    return out


def _figures(stats: Any, rows: list[Experience]) -> dict[str, Any]:
    """A step's training figures (zeros when nothing was trained: every advantage 0)."""
    staleness = Counter(r.staleness for r in rows)
    return {
        "trained": stats is not None,
        "loss": stats.loss if stats else 0.0,
        "kl_initial": stats.kl_initial if stats else None,
        "entropy": stats.entropy if stats else None,
        "ratio_mean": stats.ratio_mean if stats else 1.0,
        "clipped": stats.clipped if stats else 0.0,
        "grad_norm": stats.grad_norm if stats else 0.0,
        "rows_dropped": stats.rows_dropped if stats else 0,
        "padding": stats.padding if stats else 0.0,
        "action_tokens": sum(sum(r.action_mask) for r in rows),
        "staleness": {str(k): staleness[k] for k in sorted(staleness)},
        "staleness/max": max(staleness, default=0),
    }
