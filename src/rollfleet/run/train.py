"""The training loop through the fleet (issue 18, first cut): GRPO on the bundled SmolLM2.

Per step ``s``: the coordinator holds batch ``s`` (``tasks_per_step`` tasks, ``group_size``
samples each; batches up to ``s + max_staleness`` are submitted ahead and admitted as the bound
allows), the runners generate through the shared llama.cpp engine behind the gateway with the
same agent loop and environments as ``rollfleet run``, ``finalize_train_batch`` returns it, the
experiences (the engine's logprobs, GRPO advantages) train the policy one step
(:func:`rollfleet.train.policy.grpo_step`, full fine-tuning), the new weights are pushed to the
gateway as version ``s + 1`` and the coordinator is told the engines serve it. One line per step
goes to ``OUTPUT/metrics.jsonl``.

``rollfleet train`` (``cli/train.py``) runs it. Not yet here (issue 18): resume after kill -9
(the trainer's checkpoints), LoRA, eval splits, the plot, a live display.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from rollfleet.client import connect
from rollfleet.coordinator import CoordinatorClient
from rollfleet.coordinator.experiences import read_experiences
from rollfleet.envs import get_mode
from rollfleet.errors import InvalidInput
from rollfleet.run.orchestrate import (
    RunOptions,
    Startup,
    control_plane_url,
    preflight,
    runner_fleet,
    shared_llm,
)
from rollfleet.run.tasks import build_specs, load_tasks


@dataclass
class TrainOptions:
    """What a training run takes."""

    mode: str
    data: Path
    output_dir: Path
    steps: int = 10
    tasks_per_step: int = 4
    group_size: int = 4
    max_staleness: int = 0
    lr: float = 1e-5
    max_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # more RunOptions fields

    def check(self) -> None:
        """Refuse impossible numbers before anything starts."""
        for name in ("steps", "tasks_per_step", "group_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.max_staleness <= 1000:
            raise InvalidInput(f"--max-staleness must be 0 to 1000, got {self.max_staleness}")
        if not 0 < self.lr < 1:
            raise InvalidInput(f"--lr must be between 0 and 1, got {self.lr}")

    def run_options(self) -> RunOptions:
        """The fleet's options: one rollout slot per sample of a step's batch."""
        return RunOptions(
            mode=self.mode, data=self.data, output_dir=self.output_dir,
            num_rollouts=self.tasks_per_step * self.group_size, max_tokens=self.max_tokens,
            temperature=self.temperature, max_turns=1, **self.extra,
        )  # fmt: skip


async def train(opts: TrainOptions, console: Console) -> list[dict[str, Any]]:
    """Run every step; returns (and writes to OUTPUT/metrics.jsonl) one record per step."""
    import torch

    from rollfleet.train.policy import load_policy

    opts.check()
    run = opts.run_options()
    run.check()
    tasks = load_tasks(opts.data, get_mode(opts.mode))
    preflight(run)
    specs = build_specs(tasks, path=opts.data, mode=opts.mode, samples=1, settings=run.settings())
    opts.output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)
    model, _ = load_policy()
    optimizer = torch.optim.Adam(model.parameters(), lr=opts.lr)
    records: list[dict[str, Any]] = []
    async with control_plane_url(run, opts.output_dir / "experiences") as url:
        store, coordinator = connect(url), CoordinatorClient(url)
        try:
            async with shared_llm(run, store, console, Startup()) as llm:
                fleet = runner_fleet(url, run, llm)
                running = asyncio.create_task(fleet.run())
                try:
                    await coordinator.set_policy_version(0)
                    submitted = 0
                    for step in range(opts.steps):
                        while submitted < opts.steps and submitted <= step + opts.max_staleness:
                            chosen = [specs[(submitted * opts.tasks_per_step + i) % len(specs)]
                                      for i in range(opts.tasks_per_step)]  # fmt: skip
                            await coordinator.submit_batch(
                                f"step-{submitted}", chosen, repeat_times=opts.group_size,
                                max_staleness=opts.max_staleness,
                            )  # fmt: skip
                            submitted += 1
                        record = await _step(step, coordinator, model, optimizer, llm.gateway)
                        records.append(record)
                        with (opts.output_dir / "metrics.jsonl").open("a") as out:
                            out.write(json.dumps(record) + "\n")
                        console.print(
                            f"step {step}: reward {record['reward/mean']:.3f} · loss "
                            f"{record['loss']:.4f} · {record['seconds/step']:.1f} s"
                        )
                finally:
                    fleet.stop()
                    fleet.stop()  # the second ends the runners' long-polls now (as run does)
                    await running
        finally:
            await coordinator.close()
            await store.close()
    return records


async def _step(
    step: int, coordinator: CoordinatorClient, model: Any, optimizer: Any, gateway: Any
) -> dict[str, Any]:
    """Finalize batch ``step``, train on it, push version ``step + 1``; the step's record."""
    from rollfleet.engines.weights import push_weights
    from rollfleet.train.policy import grpo_step

    started = time.perf_counter()
    result = await coordinator.finalize_train_batch(f"step-{step}")
    generated = time.perf_counter()
    stats = await coordinator.process_experiences(f"step-{step}")
    rows = [r for r in read_experiences(stats.path) if r.logprobs is not None]
    trained = time.perf_counter()
    figures = grpo_step(model, optimizer, rows) if rows else None
    pushed = time.perf_counter()
    await push_weights(gateway, model.state_dict().items(), version=step + 1)
    await coordinator.set_policy_version(step + 1)
    done = time.perf_counter()
    return {
        "step": step,
        "weights_version": step + 1,
        "reward/mean": result.metrics.get("reward/mean", 0.0),
        "staleness/max": result.metrics.get("staleness/max", 0.0),
        "experiences": len(rows),
        "loss": figures.loss if figures else 0.0,
        "ratio_mean": figures.ratio_mean if figures else 1.0,
        "seconds/generate": generated - started,
        "seconds/train": pushed - trained,
        "seconds/sync": done - pushed,
        "seconds/step": done - started,
    }
