"""max_staleness: random interleavings of submits, generation, training steps and weight swaps
against the real coordinator on a real SQLite store. Whatever the order, no consumed sample is
staler than k (measured from the version the engines served when its generation began, the
oldest version of its tokens) and no finished sample is ever dropped: each is consumed once."""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfleet.client import connect
from rollfleet.coordinator import BatchLifecycleState, RolloutCoordinator
from rollfleet.errors import Conflict, InvalidInput
from rollfleet.model import AttemptStatus, RolloutResult
from rollfleet.store.base import Store

OPS = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 3), st.integers(1, 2), st.booleans()),
    st.tuples(st.just("claim"), st.integers(1, 6)),
    st.tuples(st.just("finish"), st.integers(1, 6), st.integers(0, 2**16)),
    st.tuples(st.just("train")),
    st.tuples(st.just("swap")),
)


@dataclass
class World:
    """The trainer, the engines and the fleet around one coordinator."""

    store: Store
    coord: RolloutCoordinator
    k: int
    served: int = 0  # the version the engines serve
    trained: int = 0  # train finalizes so far
    started: dict[str, int] = field(default_factory=dict)  # rollout → version when it began
    attempts: dict[str, str] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    consumed: dict[str, int] = field(default_factory=dict)  # rollout → staleness at consumption
    batches: list[str] = field(default_factory=list)

    async def submit(self, tasks: int, repeats: int, partial: bool) -> None:
        batch_id = f"b{len(self.batches)}"
        self.batches.append(batch_id)
        await self.coord.submit_batch(
            batch_id,
            [{"t": i} for i in range(tasks)],
            min_wait_num=1 if partial else None,
            repeat_times=repeats,
        )

    async def claim(self, n: int) -> None:
        for r in await self.store.claim("w", max_n=n):
            assert r.attempt is not None
            self.started[r.rollout_id] = self.served
            self.attempts[r.rollout_id] = r.attempt.attempt_id

    async def finish(self, n: int, seed: int) -> None:
        running = sorted(set(self.attempts) - self.finished)
        for rid in random.Random(seed).sample(running, min(n, len(running))):
            await self.store.complete(
                self.attempts[rid], AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
            )
            self.finished.add(rid)

    async def train(self, timeout: float | None = 0.0) -> bool:
        """Finalize the oldest train batch not finalized; True when it was consumed."""
        open_ = [b for b in await self.coord.list_batches(refresh=False) if not b.state.done]
        if not open_:
            return False
        batch_id = open_[0].batch_id
        try:
            await self.coord.finalize_train_batch(batch_id, timeout=timeout, wait_after_min=0.0)
        except Conflict:  # held back, or work it must take is still running: the trainer waits
            return False
        for rid, stale in (await self.coord.get_batch_state(batch_id)).included.items():
            assert rid not in self.consumed, f"{rid} consumed twice"
            true = self.trained - self.started[rid]
            assert stale <= self.k and true <= self.k, (rid, stale, true, self.k)
            assert true <= stale  # the recorded figure is a bound on the truth
            self.consumed[rid] = stale
        self.trained += 1
        return True

    async def swap(self) -> None:
        if self.served < self.trained:
            self.served = self.trained
            await self.coord.set_policy_version(self.served)

    async def drain(self) -> None:
        """Run everything to the end: every batch admitted, generated, finalized."""
        for _ in range(10 * len(self.batches) + 10):
            await self.swap()
            await self.claim(500)
            await self.finish(500, 0)
            if await self.train(timeout=30.0):
                continue
            found = await self.coord.list_batches(refresh=False)
            if all(b.state.done for b in found):
                last = await self.coord.get_batch_state(found[-1].batch_id) if found else None
                if last is None or not last.carry_pool:
                    return
                await self.submit(1, 1, False)  # carried stragglers join the next train batch
        raise AssertionError("the batches never all finalized")


async def scenario(ops: list[tuple[Any, ...]], k: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = connect(f"sqlite:///{tmp}/rf.db")
        coord = RolloutCoordinator(
            store,
            experience_dir=Path(tmp) / "xp",
            poll_interval_s=0.01,
            reap_interval_s=None,
            max_staleness=k,
        )
        world = World(store, coord, k)
        try:
            await coord.set_policy_version(0)
            for op, *args in ops:
                await getattr(world, op)(*args)
            await world.drain()
            every = {r.rollout_id for r in (await store.query_rollouts(limit=1000)).items}
            assert set(world.consumed) == world.finished == every  # nothing dropped, all used
            assert all(b.state is BatchLifecycleState.FINALIZED for b in await coord.list_batches())
        finally:
            await store.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=3, max_size=30), k=st.integers(0, 2))
def test_no_consumed_sample_exceeds_k_and_no_finished_sample_is_dropped(ops, k) -> None:
    asyncio.run(scenario(ops, k))


@pytest.fixture
async def coord(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = connect(f"sqlite:///{tmp_path}/rf.db")
    yield RolloutCoordinator(store, experience_dir=tmp_path / "xp", poll_interval_s=0.01)
    await store.close()


async def test_the_fleet_runs_k_batches_ahead_then_waits_for_a_push(
    coord: RolloutCoordinator,
) -> None:
    """k=1: two batches may be in flight; the third is held (nothing enqueued) until the trainer
    has consumed one AND the engines serve the new version."""
    await coord.set_policy_version(0)
    first = await coord.submit_batch("b0", [1], max_staleness=1)
    second = await coord.submit_batch("b1", [1], max_staleness=1)
    third = await coord.submit_batch("b2", [1], max_staleness=1)
    assert (first.admitted_at, second.admitted_at, third.admitted_at) == (0, 0, None)
    assert third.state is BatchLifecycleState.PENDING
    assert (await coord.store.query_rollouts(batch_id="b2")).items == []
    with pytest.raises(Conflict, match="b2 is held back by max_staleness 1"):
        await coord.finalize_train_batch("b2", timeout=0)
    await coord.finalize_train_batch("b0", timeout=0)  # nothing finished: b0's group is carried
    assert (await coord.get_batch("b2")).state is BatchLifecycleState.PENDING  # engines still at 0
    assert await coord.set_policy_version(1) == ["b2"]
    assert (await coord.get_batch("b2")).admitted_at == 1
    with pytest.raises(Conflict, match="finalize batch b1 first"):
        await coord.finalize_train_batch("b2", timeout=0)  # b1 would be consumed at 2: stale 2
    with pytest.raises(
        Conflict, match=r"must be consumed by this finalize to stay within max_staleness"
    ):
        await coord.finalize_train_batch("b1", timeout=0)  # b1 and b0's carried group are due


async def test_a_bounded_batch_needs_the_served_version_first(coord: RolloutCoordinator) -> None:
    """Between a finalize and the push after it the engines still serve the old weights: a
    coordinator guessing they follow each finalize admitted a batch one version staler than k
    (bench/train_sched.py found it). A bounded batch without a reported version is refused."""
    with pytest.raises(Conflict, match=r"max_staleness needs the policy version the engines serve"):
        await coord.submit_batch("b0", [1], max_staleness=0)
    assert await coord.store.get_state("batch/b0") is None
    await coord.submit_batch("free", [1])  # unbounded batches need no report
    await coord.set_policy_version(0)
    held = await coord.submit_batch("b0", [1], max_staleness=0)  # "free" runs ahead of it
    assert held.state is BatchLifecycleState.PENDING and held.admitted_at is None


async def test_bad_bounds_and_versions_are_refused_by_name(coord: RolloutCoordinator) -> None:
    await coord.set_policy_version(0)
    with pytest.raises(InvalidInput, match="max_staleness must be between 0 and 1000, got -1"):
        await coord.submit_batch("b0", [1], max_staleness=-1)
    with pytest.raises(InvalidInput, match="max_staleness bounds train batches"):
        await coord.submit_batch("e0", [1], "eval", max_staleness=1)
    await coord.set_policy_version(3)
    with pytest.raises(Conflict, match="policy version 2 is older than 3"):
        await coord.set_policy_version(2)
    assert (await coord.store.query_rollouts(limit=10)).items == []  # refused: nothing enqueued
    assert [b.batch_id for b in await coord.list_batches()] == []
