"""From a batch's rollouts and their steps to what callers get: its result and its experiences.

Reads go to the store in bulk: rollouts through ``wait_for_rollouts`` in chunks, steps through
one paged ``query_steps_many`` per 1,000 rollouts, handed on one rollout at a time so a batch's
steps are never all in memory at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from rollfleet.coordinator import experiences as xp
from rollfleet.coordinator import metrics as m
from rollfleet.coordinator.advantages import group_advantages
from rollfleet.coordinator.state import BatchState, FinalizeResult
from rollfleet.model import Rollout, RolloutStatus, Step
from rollfleet.store.base import MAX_STEP_ROLLOUTS, PageReader, Store, iter_pages

FETCH_CHUNK = 500
STEPS_PAGE = 1000


async def fetch_rollouts(store: Store, rollout_ids: Sequence[str]) -> list[Rollout]:
    """Read rollouts in bulk, as they are now."""
    out: list[Rollout] = []
    ids = list(rollout_ids)
    for i in range(0, len(ids), FETCH_CHUNK):
        out.extend(await store.wait_for_rollouts(ids[i : i + FETCH_CHUNK], timeout=0.0))
    return out


async def steps_by_rollout(
    store: Store, rollout_ids: Sequence[str]
) -> AsyncIterator[tuple[str, list[Step]]]:
    """Each rollout's steps in order, a rollout at a time (rollouts without steps are skipped)."""
    ids = list(rollout_ids)
    for start in range(0, len(ids), MAX_STEP_ROLLOUTS):
        current, steps = "", list[Step]()
        # pages come by rollout id, then sequence: a rollout's steps are next to each other
        async for page in iter_pages(_steps_reader(store, ids[start : start + MAX_STEP_ROLLOUTS])):
            for step in page:
                if step.rollout_id != current and steps:
                    yield current, steps
                    steps = []
                current = step.rollout_id
                steps.append(step)
        if steps:
            yield current, steps


def _steps_reader(store: Store, rollout_ids: list[str]) -> PageReader[Step]:
    return lambda cursor: store.query_steps_many(rollout_ids, cursor=cursor, limit=STEPS_PAGE)


async def batch_result(
    store: Store,
    batch: BatchState,
    rollouts: list[Rollout],
    included: dict[str, int],
    *,
    carried_in: int = 0,
    carried_out: int = 0,
    collect_tokens: bool = True,
) -> FinalizeResult:
    """Counts and metrics of the rollouts a finalize (or an abort) takes for the batch."""
    own = [r for r in rollouts if r.batch_id == batch.batch_id]
    cancelled = {r.group_id for r in own if r.status is RolloutStatus.CANCELLED}
    metrics = await rollout_metrics(store, rollouts, collect_tokens)
    metrics.update(m.summary((included[r.rollout_id] for r in rollouts), "staleness"))
    if batch.batch_type == "eval":
        by_group: dict[str, list[float]] = {}
        for r in own:
            if r.status is RolloutStatus.SUCCEEDED and r.result and r.result.reward is not None:
                by_group.setdefault(r.group_id or r.rollout_id, []).append(r.result.reward)
        metrics.update(m.eval_metrics(by_group))
    return FinalizeResult(
        batch_id=batch.batch_id,
        batch_type=batch.batch_type,
        finished_task_count=len({r.group_id for r in own} - cancelled),
        expected_task_count=batch.expected_task_count,
        policy=batch.policy,
        rollout_count=len(rollouts),
        rollouts_by_status={
            s: sum(r.status is s for r in rollouts) for s in RolloutStatus if s.terminal
        },
        carried_in_task_count=carried_in,
        carried_out_task_count=carried_out,
        metrics=metrics,
    )


async def rollout_metrics(
    store: Store, rollouts: list[Rollout], collect_tokens: bool
) -> dict[str, float]:
    """Reward, metric and latency figures of the succeeded rollouts, and token figures if asked."""
    done = [r for r in rollouts if r.status is RolloutStatus.SUCCEEDED and r.result is not None]
    out = m.reward_stats(r.result.reward for r in done if r.result is not None)
    out.update(m.metric_aggregates(r.result.metrics for r in done if r.result is not None))
    out.update(m.latency_stats((r.finished_at or r.updated_at) - r.created_at for r in done))
    out.update(m.failure_counts((r.status.value, r.error) for r in rollouts))
    if collect_tokens:
        prompts, completions = [], []
        async for _, steps in steps_by_rollout(store, [r.rollout_id for r in done]):
            seqs = xp.sequences_from_steps(steps)
            if seqs:
                prompts.append(sum(s.prompt_length for s in seqs))
                completions.append(sum(s.completion_tokens for s in seqs))
        out.update(m.token_stats(prompts, completions))
    return out


async def write_batch_experiences(
    store: Store, batch: BatchState, directory: str | Path, estimator: str = "grpo"
) -> xp.ExperienceStats:
    """The Experiences of the rollouts a finalized batch included, written as one Parquet file."""
    rollouts = [r for r in await fetch_rollouts(store, list(batch.included)) if _scored(r)]
    rewards = {
        r.rollout_id: float(r.result.reward)
        for r in rollouts
        if r.result and r.result.reward is not None
    }
    groups = {r.rollout_id: r.group_id or r.rollout_id for r in rollouts}
    advantages = group_advantages(rewards, groups, estimator)

    def rows_of(r: Rollout, steps: list[Step]) -> list[xp.Experience]:
        rid = r.rollout_id
        return xp.experiences_for_rollout(
            r, steps, rewards[rid], advantages[rid], batch.batch_id, batch.included[rid]
        )

    by_id = {r.rollout_id: r for r in rollouts}
    made = {
        rid: rows_of(by_id[rid], steps) async for rid, steps in steps_by_rollout(store, list(by_id))
    }
    rows = [e for r in rollouts for e in made.get(r.rollout_id) or rows_of(r, [])]
    path = xp.write_experiences(directory, batch.batch_id, rows)
    per_rollout = Counter(e.rollout_id for e in rows if e.tokens)
    return xp.ExperienceStats(
        batch_id=batch.batch_id,
        path=str(path),
        experience_count=len(rows),
        rollout_count=len(rollouts),
        group_count=len({r.group_id for r in rollouts}),
        experiences_without_tokens=sum(not e.tokens for e in rows),
        merge_breaks=sum(n - 1 for n in per_rollout.values()),
        metrics={
            **m.summary((e.advantage for e in rows), "advantage"),
            **m.summary((e.staleness for e in rows), "staleness"),
            **m.summary((sum(e.action_mask) for e in rows if e.tokens), "action_tokens"),
            **m.summary(per_rollout.values(), "rows_per_rollout"),
        },
    )


def _scored(r: Rollout) -> bool:
    return (
        r.status is RolloutStatus.SUCCEEDED and r.result is not None and r.result.reward is not None
    )
