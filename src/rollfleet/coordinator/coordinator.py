"""``RolloutCoordinator``: submit, finalize and abort training/eval batches over any Store.

The names and semantics follow Trinity-RFT's coordinator. What differs, on purpose:

- Batches live in the store (``put_state``), so a coordinator restarted mid-batch resumes it.
- Rollout ids are deterministic (``<batch>:<task>:<repeat>``): submitting again changes nothing.
- Stragglers follow an explicit policy: ``cancel`` (Trinity's), ``carry_over`` (the default: they
  keep running and join the next train finalize, marked with their staleness) or ``wait``.
- Nothing finished is dropped: after any stop (min_wait_num, timeout, cancel races) the batch's
  rollouts are read again and every terminal one is counted.
- A rollout whose runner died at dispatch is requeued by the store's leases; finalize runs the
  reaper while it waits so such a rollout never stalls the batch.
- ``max_staleness`` k (per coordinator or per train batch) bounds how off-policy consumed samples
  get: a batch is held back (state ``pending``, nothing enqueued) until it can be consumed within
  k versions, and a finalize waits for the work it must consume; see ``staleness.py``. Trainers
  report the version the engines serve with ``set_policy_version`` after each push.

A batch's state changes only through ``state.move_batch`` (its transition table); callers get
frozen records (``BatchInfo``, ``FinalizeResult``, ``AbortResult``, ``ExperienceStats``).

This class owns the coordinator's mutable state (the batches, the finalize count, the carry pool,
the policy version served) and its locks, and sequences each operation; the steps are functions
that take that state as arguments: admission (``admission.py``), finalize's wait (``waiting.py``),
the straggler policy (``stragglers.py``), the commit (``commit.py``), the staleness rules
(``staleness.py``), aggregation (``aggregate.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollfleet.coordinator.admission import (
    admit_held,
    admit_or_hold,
    load_policy_version,
    record_policy_version,
)
from rollfleet.coordinator.advantages import check_estimator
from rollfleet.coordinator.aggregate import batch_result, fetch_rollouts, write_batch_experiences
from rollfleet.coordinator.commit import check_due, commit
from rollfleet.coordinator.experiences import ExperienceStats
from rollfleet.coordinator.staleness import (
    batch_bound,
    check_max_staleness,
    check_order,
    due,
    due_rollouts,
)
from rollfleet.coordinator.state import (
    STATE_PREFIX,
    AbortResult,
    BatchInfo,
    BatchLifecycleState,
    BatchState,
    BatchType,
    Carried,
    FinalizeResult,
    StragglerPolicy,
    check_submit,
    move_batch,
    rollout_specs,
    save_batch,
)
from rollfleet.coordinator.stragglers import AbortHook, cancel_in_batch, settle_stragglers
from rollfleet.coordinator.waiting import wait_for_batch
from rollfleet.errors import Conflict, InvalidInput, NotFound
from rollfleet.model import RolloutConfig, RolloutStatus, now
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.coordinator")
S = BatchLifecycleState


class RolloutCoordinator:
    """Own batch state in the store and expose batch-level submit/finalize/abort APIs."""

    def __init__(
        self,
        store: Store | str,
        *,
        experience_dir: str | Path | None = None,
        abort_hook: AbortHook | None = None,
        default_policy: StragglerPolicy | str = StragglerPolicy.CARRY_OVER,
        wait_after_min: float = 0.0,
        poll_interval_s: float = 0.2,
        reap_interval_s: float | None = 1.0,
        collect_tokens: bool = True,
        max_staleness: int | None = None,
    ) -> None:
        self._store_arg = store
        self.store: Store | None = None if isinstance(store, str) else store
        home = os.environ.get("ROLLFLEET_HOME", ".rollfleet")
        self.experience_dir = Path(experience_dir) if experience_dir else Path(home) / "experiences"
        self.abort_hook = abort_hook
        self.default_policy = StragglerPolicy(default_policy)
        self.wait_after_min = wait_after_min
        self.poll_interval_s = poll_interval_s
        self.reap_interval_s = reap_interval_s
        self.collect_tokens = collect_tokens
        self.max_staleness = check_max_staleness(max_staleness)  # default for train batches
        self._served: int | None = None  # None: the engines follow the trainer at each finalize
        self._admit_lock = asyncio.Lock()
        self._batches: dict[str, BatchState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._commit_lock = asyncio.Lock()
        self._finalize_count = 0
        self._pool: list[Carried] = []
        self._prepared = False

    # --- lifecycle ------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Open the store if given a URL and load every persisted batch (resuming unfinished)."""
        if self._prepared:
            return
        if self.store is None:
            from rollfleet.client import connect

            self.store = connect(str(self._store_arg))
        for value in (await self._s.scan_state(STATE_PREFIX)).values():
            if not value:  # a cleared record
                continue
            batch = BatchState.from_json(value)
            self._batches[batch.batch_id] = batch
        trained = [b for b in self._batches.values() if b.finalize_index is not None]
        latest = max(trained, key=lambda b: b.finalize_index or 0, default=None)
        if latest is not None:
            self._finalize_count = (latest.finalize_index or 0) + 1
            self._pool = list(latest.carry_pool)
        self._served = await load_policy_version(self._s)
        active = [b.batch_id for b in self._batches.values() if not b.state.done]
        self._prepared = True
        await self._admit_held()  # a coordinator restarted with room for held batches
        log.info(
            "coordinator ready: %d batches (%d active), %d straggler groups carried",
            len(self._batches),
            len(active),
            len(self._pool),
        )

    def forget(self) -> None:
        """Drop every loaded batch (another replica leads now); ``prepare`` loads them afresh."""
        self._batches, self._locks, self._pool = {}, {}, []
        self._finalize_count, self._served, self._prepared = 0, None, False

    async def shutdown(self) -> None:
        """Release what the coordinator owns (the store when it opened it from a URL)."""
        if isinstance(self._store_arg, str) and self.store is not None:
            await self.store.close()
            self.store = None
        self._prepared = False
        log.info("coordinator stopped")

    @property
    def _s(self) -> Store:
        if self.store is None:
            raise Conflict("coordinator: call prepare() first")
        return self.store

    # --- batches --------------------------------------------------------------------------------

    async def _batch(self, batch_id: str) -> BatchState:
        """The live record of one batch, or NotFound."""
        await self.prepare()
        if batch_id not in self._batches:
            value = await self._s.get_state(STATE_PREFIX + batch_id)
            if not value:
                raise NotFound(f"batch {batch_id} not found")
            self._batches[batch_id] = BatchState.from_json(value)
        return self._batches[batch_id]

    async def _refresh(self, batch: BatchState) -> BatchState:
        """Read the statuses of an unfinished batch's rollouts from the store now."""
        if not batch.state.done:
            found = await fetch_rollouts(self._s, batch.rollout_ids)
            batch.statuses.update({r.rollout_id: r.status for r in found})
        return batch

    async def get_batch(self, batch_id: str | int) -> BatchInfo:
        """One batch, its rollouts counted by status as they are now; NotFound if unknown."""
        return (await self._refresh(await self._batch(str(batch_id)))).info()

    async def get_batch_state(self, batch_id: str | int) -> BatchState:
        """A copy of one batch's whole persisted record (statuses, ``included``, carry pool)."""
        return (await self._batch(str(batch_id))).model_copy(deep=True)

    async def list_batches(self, *, refresh: bool = True) -> list[BatchInfo]:
        """Every batch known, oldest first; ``refresh=False`` skips reading statuses now."""
        await self.prepare()
        found = sorted(self._batches.values(), key=lambda b: b.created_at)
        return [(await self._refresh(b) if refresh else b).info() for b in found]

    async def submit_batch(
        self,
        batch_id: str | int,
        tasks: Sequence[Any],
        batch_type: BatchType = "train",
        min_wait_num: int | None = None,
        repeat_times: int = 1,
        *,
        policy: StragglerPolicy | str | None = None,
        mode: str | None = None,
        config: RolloutConfig | None = None,
        priority: int = 0,
        max_staleness: int | None = None,
    ) -> BatchInfo:
        """Enqueue every task × repeat_times as rollouts (a group per task), or hold them while
        ``max_staleness`` allows no more (state ``pending``); returns at once."""
        await self.prepare()
        batch_id = str(batch_id)
        chosen = check_submit(
            batch_id, tasks, batch_type, min_wait_num, repeat_times, policy, self.default_policy
        )
        bound = batch_bound(batch_type, max_staleness, self.max_staleness, self._served)
        with contextlib.suppress(NotFound):
            old = await self._batch(batch_id)
            raise Conflict(
                f"batch {batch_id} exists already ({old.state.value}); batch ids are never reused"
            )
        if batch_id in self._batches:  # submitted concurrently while we looked it up
            raise Conflict(f"batch {batch_id} exists already; batch ids are never reused")
        batch = BatchState(
            batch_id=batch_id,
            batch_type=batch_type,
            expected_task_count=len(tasks),
            min_wait_num=min_wait_num,
            policy=chosen,
            repeat_times=repeat_times,
            created_at=now(),
            max_staleness=bound,
        )
        self._batches[batch_id] = batch  # reserved: a concurrent submit of the same id is refused
        try:
            resources = await self._s.get_latest_resources()
            version = None if resources is None else resources.version
            specs = rollout_specs(batch, tasks, mode, config, priority, version)
            async with self._admit_lock:
                await admit_or_hold(
                    self._s,
                    batch,
                    specs,
                    self._batches.values(),
                    trained=self._finalize_count,
                    version=self.policy_version,
                )
        except BaseException:
            del self._batches[batch_id]
            raise
        log.info(
            "batch %s submitted: %s, %d tasks × %d, min_wait_num=%s, policy=%s%s",
            batch_id,
            batch_type,
            len(tasks),
            repeat_times,
            min_wait_num,
            chosen.value,
            ""
            if bound is None
            else f", max_staleness={bound}" + (", held back" if batch.held else ""),
        )
        return batch.info()

    # --- staleness control ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The policy version the engines serve: the trainer's report; without one (no batch is
        bounded then), the engines are taken to follow each finalize."""
        return self._finalize_count if self._served is None else self._served

    async def set_policy_version(self, version: int) -> list[str]:
        """Record that every engine now serves ``version`` (after a weights push); held batches
        that now fit ``max_staleness`` are enqueued. Returns their ids."""
        await self.prepare()
        await record_policy_version(self._s, version, self._served)
        self._served = version
        log.info("policy version %d served", version)
        return await self._admit_held()

    async def _admit_held(self) -> list[str]:
        """Enqueue held batches, oldest first, while max_staleness allows; their ids."""
        async with self._admit_lock:
            return await admit_held(
                self._s,
                self._batches.values(),
                trained=self._finalize_count,
                version=self.policy_version,
            )

    # --- finalize -------------------------------------------------------------------------------

    async def finalize_train_batch(
        self,
        batch_id: str | int,
        *,
        timeout: float | None = None,
        wait_after_min: float | None = None,
    ) -> FinalizeResult:
        """Wait (all, min_wait_num plus a grace period, or the timeout), apply policy, aggregate."""
        return await self._finalize(str(batch_id), "train", timeout, wait_after_min)

    async def finalize_eval_batch(
        self, batch_id: str | int, *, timeout: float | None = None
    ) -> FinalizeResult:
        """Wait for the eval batch (or the timeout); mean@n, std@n, best@k, worst@k, pass@k."""
        return await self._finalize(str(batch_id), "eval", timeout, None)

    async def finalize_batch(
        self,
        batch_id: str | int,
        *,
        timeout: float | None = None,
        wait_after_min: float | None = None,
    ) -> FinalizeResult:
        """Finalize a batch of either type."""
        batch = await self._batch(str(batch_id))
        return await self._finalize(batch.batch_id, batch.batch_type, timeout, wait_after_min)

    async def _finalize(
        self, batch_id: str, kind: BatchType, timeout: float | None, wait_after_min: float | None
    ) -> FinalizeResult:
        batch = await self._batch(batch_id)
        if batch.batch_type != kind:
            use = f"finalize_{batch.batch_type}_batch"
            raise InvalidInput(f"batch {batch_id} is a {batch.batch_type} batch: use {use}")
        async with self._locks.setdefault(batch_id, asyncio.Lock()):
            if batch.state is S.FINALIZED and batch.final_result is not None:
                return batch.final_result
            check_order(batch, self._batches.values(), self._finalize_count)
            if batch.state is not S.FINALIZING:  # FINALIZING: a finalize cut short, resumed here
                move_batch(batch, S.FINALIZING)  # an aborted (or finalized) batch is refused
                await save_batch(self._s, batch)
            grace = self.wait_after_min if wait_after_min is None else wait_after_min
            index = self._finalize_count
            whole = kind == "train" and due(batch.max_staleness, batch.admitted_at, index)
            must = due_rollouts(self._pool, index) if kind == "train" else []
            await wait_for_batch(
                self._s,
                batch,
                timeout,
                grace,
                whole,
                must,
                poll_interval_s=self.poll_interval_s,
                reap_interval_s=self.reap_interval_s,
            )
            stragglers = await settle_stragglers(self._s, batch, self.abort_hook)
            async with self._commit_lock:
                await check_due(self._s, batch, stragglers if whole else [], must)
                result = await self._commit(batch, stragglers)
            await self._admit_held()
            return result

    async def _commit(self, batch: BatchState, stragglers: list[str]) -> FinalizeResult:
        """Commit the finalize (``commit.commit``); a train one moves the finalize count on and
        takes the new carry pool."""
        train = batch.batch_type == "train"
        index = self._finalize_count if train else None
        pool = self._pool if train else []
        result = await commit(
            self._s, batch, stragglers, pool, index, collect_tokens=self.collect_tokens
        )
        if index is not None:
            self._finalize_count, self._pool = index + 1, batch.carry_pool
        return result

    # --- abort ----------------------------------------------------------------------------------

    async def abort_batch(
        self, batch_id: str | int, *, reason: str, keep_partial_results: bool = False
    ) -> AbortResult:
        """Cancel the batch's queued and running rollouts; keep its finished results if asked."""
        batch = await self._batch(str(batch_id))
        if isinstance(batch.final_result, AbortResult):
            return batch.final_result
        if batch.state is not S.ABORTED:  # ABORTED with no result: an abort cut short, resumed
            move_batch(batch, S.ABORTED)  # a finalize under way sees this and stops
        batch.reason = reason
        await save_batch(self._s, batch)
        await cancel_in_batch(self._s, batch, batch.rollout_ids, self.abort_hook)
        found = await fetch_rollouts(self._s, batch.rollout_ids)
        kept = [r for r in found if r.status is RolloutStatus.SUCCEEDED]
        used = kept if keep_partial_results else []
        batch.included = {r.rollout_id: 0 for r in used}
        result = await batch_result(
            self._s, batch, used, batch.included, collect_tokens=self.collect_tokens
        )
        aborted = AbortResult(**dict(result), reason=reason)
        batch.final_result, batch.finished_at, batch.held = aborted, now(), []
        await save_batch(self._s, batch)
        await self._admit_held()  # an aborted batch makes room for held ones
        log.info(
            "batch %s aborted (%s): %d finished results %s",
            batch.batch_id,
            reason,
            len(kept),
            "kept" if keep_partial_results else "not used",
        )
        return aborted

    # --- experiences ----------------------------------------------------------------------------

    async def process_experiences(
        self,
        batch_id: str | int,
        *,
        output_dir: str | Path | None = None,
        estimator: str = "grpo",
    ) -> ExperienceStats:
        """Turn the batch's finished trajectories into Experiences in Parquet, with advantages
        by ``estimator`` (grpo, drgrpo or rloo); return figures."""
        check_estimator(estimator)
        batch = await self._batch(str(batch_id))
        if batch.final_result is None:
            raise Conflict(
                f"batch {batch.batch_id} is {batch.state.value}: "
                "finalize it before processing experiences"
            )
        directory = output_dir or self.experience_dir
        stats = await write_batch_experiences(self._s, batch, directory, estimator)
        log.info(
            "batch %s: %d experiences written to %s",
            batch.batch_id,
            stats.experience_count,
            stats.path,
        )
        return stats
