"""rollfleet's fleet as the generation backend of TRL's ``GRPOTrainer`` (docs/trl.md).

TRL 1.16 calls ``rollout_func(prompts, trainer)`` once per generation batch
(``GRPOTrainer._generate``); the prompts come from its ``RepeatSampler``, each repeated
``num_generations`` times in a row. :class:`FleetRollout` is such a function: it pushes the
trainer's weights to the gateway when TRL has stepped since the last push, submits the distinct
prompts' tasks as one coordinator batch (``repeat_times=num_generations``, the ``wait`` policy),
finalizes it, processes its experiences and hands TRL the engine's token ids and logprobs, with
the environment's reward as the extra field ``env_reward`` (which :func:`fleet_reward` returns).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rollfleet.coordinator import CoordinatorClient
from rollfleet.coordinator.experiences import Experience, read_experiences
from rollfleet.coordinator.state import rollout_id_for
from rollfleet.envs import get_mode
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput, RollfleetError
from rollfleet.model import RolloutSpec
from rollfleet.run.options import RunOptions
from rollfleet.run.tasks import build_specs
from rollfleet.train.policy import publish

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop on a daemon thread, for TRL's synchronous trainer to call into."""

    def __init__(self) -> None:
        """Start the loop."""
        self.loop = asyncio.new_event_loop()
        self.watched: list[Future[Any]] = []  # their end (the fleet's) fails every call
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="rollfleet-trl", daemon=True
        )
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it; raise if a watched future ends first."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        wait([fut, *self.watched], return_when=FIRST_COMPLETED)
        if not fut.done():
            fut.cancel()
            ended = next(w for w in self.watched if w.done())
            raise RollfleetError("the fleet stopped while TRL waited on it") from ended.exception()
        return fut.result()

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def fleet_tasks(
    data: Path, mode: str, *, max_tokens: int = 64, temperature: float = 1.0, max_turns: int = 1
) -> dict[str, RolloutSpec]:
    """The tasks of ``data`` (checked by ``mode``) keyed by their user prompt, TRL's ``prompt``."""
    found = get_mode(mode)
    run = RunOptions(
        mode=mode, data=data, max_tokens=max_tokens, temperature=temperature, max_turns=max_turns
    )
    lines = load_tasks(data, found)
    specs = build_specs(lines, path=data, mode=mode, samples=1, settings=run.settings())
    tasks: dict[str, RolloutSpec] = {}
    for line, spec in zip(lines, specs, strict=True):
        prompt = found.user_prompt(line.task)
        if prompt in tasks and tasks[prompt].input != spec.input:
            raise InvalidInput(
                f"{data}:{line.lineno}: same prompt as line "
                f"{tasks[prompt].metadata['line']} but another task"
            )
        tasks.setdefault(prompt, spec)
    return tasks


def prompt_dataset(tasks: Mapping[str, RolloutSpec]) -> Any:
    """A ``datasets.Dataset`` with one ``prompt`` per task, for GRPOTrainer's ``train_dataset``."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt} for prompt in tasks])


def fleet_reward(completions: list[Any], env_reward: list[float | None], **_: Any) -> list[Any]:
    """A TRL reward function: the reward rollfleet's environment gave each completion."""
    return list(env_reward)


@dataclass
class BatchFigures:
    """What one generation batch gave, for the step's metrics record."""

    batch_id: str
    version: int  # the weights version the engines served while it was generated
    reward_mean: float
    reward_std: float
    experiences: int
    missing: int  # rollouts TRL got a placeholder for (failed, or without tokens)
    action_tokens: int
    staleness_max: int
    seconds_generate: float
    seconds_sync: float
    rewards: dict[str, float | None] = field(default_factory=dict)  # rollout id → env reward


class FleetRollout:
    """TRL's ``rollout_func`` through rollfleet: one coordinator batch per call."""

    def __init__(
        self,
        coordinator_url: str,
        gateway: Any,
        tasks: Mapping[str, RolloutSpec],
        *,
        loop: LoopThread | None = None,
        token: str | None = None,
        batch_prefix: str | None = None,
        version: int = 0,
    ) -> None:
        """Batches go to ``coordinator_url``; weights to ``gateway`` (a URL or an in-process
        Gateway) whose engines serve ``version`` now; ``tasks`` map TRL prompts to tasks."""
        self.tasks, self.gateway, self.token, self.version = dict(tasks), gateway, token, version
        self.prefix = batch_prefix or f"trl-{secrets.token_hex(4)}"
        self._own = loop is None
        self.loop = loop or LoopThread()
        self._url = coordinator_url
        self._client: CoordinatorClient | None = None
        self.batches: list[BatchFigures] = []
        self.loop.call(self._coordinator().set_policy_version(version))

    def _coordinator(self) -> CoordinatorClient:
        if self._client is None:
            self._client = CoordinatorClient(self._url, token=self.token)
        return self._client

    def push(self, trainer: Any) -> float:
        """Push the trainer's weights as version ``global_step`` unless served already; seconds."""
        version = int(trainer.state.global_step)
        if version <= self.version:
            return 0.0
        began = time.perf_counter()
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.loop.call(
            publish(
                model,
                self.gateway,
                self._coordinator(),
                version,
                base=self.version,
                token=self.token,
            )
        )
        self.version = version
        return time.perf_counter() - began

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Generate TRL's batch on the fleet: token ids, the engine's logprobs, env rewards."""
        if trainer.accelerator.num_processes > 1:
            raise InvalidInput(
                "rollout_func: FleetRollout serves one training process; each "
                "process would push weights and submit its own batch"
            )
        synced = self.push(trainer)
        group = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        specs = [self._spec(prompts, i, group) for i in range(0, len(prompts), group)]
        batch = f"{self.prefix}-{len(self.batches)}"
        began = time.perf_counter()
        result, path = self.loop.call(self._generate(batch, specs, group))
        rows = [r for r in read_experiences(path) if r.tokens and r.logprobs is not None]
        eos = getattr(trainer.processing_class, "eos_token_id", None) or 0
        out = trl_output(batch, len(specs), group, rows, eos)
        missing = sum(r is None for r in out["env_reward"])
        if missing == len(prompts):
            raise RollfleetError(f"batch {batch}: no rollout gave tokens and logprobs")
        staleness = [r.staleness for r in rows]
        self.batches.append(
            BatchFigures(
                batch_id=batch,
                version=self.version,
                reward_mean=result.metrics.get("reward/mean", 0.0),
                reward_std=result.metrics.get("reward/std", 0.0),
                experiences=len(rows),
                missing=missing,
                action_tokens=sum(sum(m) for m in out["env_mask"]),
                staleness_max=max(staleness, default=0),
                seconds_generate=time.perf_counter() - began,
                seconds_sync=synced,
                rewards=dict(zip(out["rollout_id"], out["env_reward"], strict=True)),
            )
        )
        return out

    def _spec(self, prompts: list[Any], start: int, group: int) -> RolloutSpec:
        """The task of the ``group`` identical prompts from ``start`` (TRL's sampler order)."""
        chunk = prompts[start : start + group]
        if len(chunk) != group or any(p != chunk[0] for p in chunk):
            raise InvalidInput(
                f"rollout_func: expected each prompt {group} times in a row "
                "(TRL's RepeatSampler order)"
            )
        if not isinstance(chunk[0], str) or chunk[0] not in self.tasks:
            raise InvalidInput(
                f"rollout_func: prompt {str(chunk[0])[:80]!r} is none of the "
                "fleet's tasks (use prompt_dataset(tasks))"
            )
        return self.tasks[chunk[0]]

    async def _generate(self, batch: str, specs: list[RolloutSpec], group: int) -> Any:
        """Submit, wait for every rollout, write the experiences; (result, their Parquet path)."""
        client = self._coordinator()
        await client.submit_batch(batch, specs, repeat_times=group, policy="wait")
        result = await client.finalize_train_batch(batch)
        stats = await client.process_experiences(batch)
        return result, stats.path

    def close(self) -> None:
        """Close the coordinator client (and the loop thread this rollout started)."""
        if self._client is not None:  # not watched: this also runs after the fleet failed
            asyncio.run_coroutine_threadsafe(self._client.close(), self.loop.loop).result()
        if self._own:
            self.loop.close()


def trl_output(
    batch: str, tasks: int, group: int, rows: Sequence[Experience], eos: int
) -> dict[str, list[Any]]:
    """TRL's rollout_func answer in its prompt order (task ``t``'s ``group`` samples in a row).

    A rollout without tokens (failed) gets a one-token placeholder: its reward None makes TRL's
    advantage 0, its ``env_mask`` 0 keeps it out of the loss."""
    first: dict[str, Experience] = {}
    for each in sorted(rows, key=lambda r: r.turn):
        first.setdefault(each.rollout_id, each)  # TRL takes one sequence per sample: the first
    keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "rollout_id")
    out: dict[str, list[Any]] = {key: [] for key in keys}
    for t in range(tasks):
        ids = [rollout_id_for(batch, t, k) for k in range(group)]
        sibling = next((first[i] for i in ids if i in first), None)
        for rid in ids:
            row = first.get(rid)
            answer: tuple[list[int], list[float], list[int], float | None]
            if row is None:
                prompt = sibling.tokens[: sibling.prompt_length] if sibling else [eos]
                answer = ([eos], [0.0], [0], None)
            else:
                cut = row.prompt_length
                prompt = row.tokens[:cut]
                answer = (
                    row.tokens[cut:],
                    (row.logprobs or [])[cut:],
                    row.action_mask[cut:],
                    row.reward,
                )
            for key, value in zip(keys, (prompt, *answer, rid), strict=True):
                out[key].append(value)
    return out
