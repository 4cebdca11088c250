"""Wake-ups cross replicas: two PostgreSQL stores (as two ``rollfleet serve`` processes hold) on
one database; a write through one wakes a long-poll claim and the dashboard's live loop on the
other at once (NOTIFY/LISTEN), well inside the 1 s fallback poll."""

from __future__ import annotations

import asyncio
import time

from rollfleet.model import AttemptStatus, Completion, RolloutSpec, RolloutStatus
from rollfleet.store import SqlStore

PROMPT_S = 0.5  # far under FALLBACK_POLL_S (1 s): only a notification wakes this fast


async def test_a_claim_waiting_on_one_replica_wakes_when_another_enqueues(
    stores: tuple[SqlStore, SqlStore],
) -> None:
    a, b = stores
    listening = asyncio.create_task(b.wait_for_change(5.0))
    await b.claim("warm-up", wait_s=0.0)  # starts b's LISTEN connection
    assert await listening  # ... which wakes b once it is up (and a claim write wakes it too)
    waiting = asyncio.create_task(b.claim("w", wait_s=20.0))
    started = time.monotonic()
    await a.enqueue_many([RolloutSpec(input={"n": 1}, rollout_id="ro-x")])
    [claimed] = await asyncio.wait_for(waiting, 10)
    assert claimed.rollout_id == "ro-x"
    assert time.monotonic() - started < PROMPT_S


async def test_the_dashboard_wait_on_one_replica_wakes_when_another_writes(
    stores: tuple[SqlStore, SqlStore],
) -> None:
    a, b = stores
    assert await b.wait_for_change(5.0)  # it starts b listening, which wakes b once it is up
    for _ in range(3):
        woken = asyncio.create_task(b.wait_for_change(20.0))
        await asyncio.sleep(0)  # the wait is armed
        started = time.monotonic()
        await a.enqueue_many([RolloutSpec(input={"n": 1})])
        assert await asyncio.wait_for(woken, 10) is True
        assert time.monotonic() - started < PROMPT_S


async def test_a_wait_on_one_replica_wakes_when_another_finishes_requeues_or_cancels(
    stores: tuple[SqlStore, SqlStore],
) -> None:
    """The notification comes from the statement that ends the rollout (no statement of its own):
    a completion, a cancel of a queued rollout, and a release that queues it again each wake the
    other replica at once."""
    a, b = stores
    await a.enqueue_many([RolloutSpec(input={"n": i}, rollout_id=f"ro-{i}") for i in range(3)])
    assert await b.wait_for_change(5.0)  # b is listening
    [first] = await a.claim("w")
    assert first.attempt is not None
    waiting = asyncio.create_task(b.wait_for_rollouts(["ro-0"], 20.0))
    await asyncio.sleep(0.1)  # b has read ro-0 unfinished and waits
    assert not waiting.done()
    started = time.monotonic()
    await a.complete_many(
        [Completion(attempt_id=first.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)]
    )
    [done] = await asyncio.wait_for(waiting, 10)
    assert done.status is RolloutStatus.SUCCEEDED and time.monotonic() - started < PROMPT_S
    waiting = asyncio.create_task(b.wait_for_rollouts(["ro-2"], 20.0))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    started = time.monotonic()
    await a.cancel("ro-2")
    [cancelled] = await asyncio.wait_for(waiting, 10)
    assert cancelled.status is RolloutStatus.CANCELLED and time.monotonic() - started < PROMPT_S
    [held] = await a.claim("w")
    claiming = asyncio.create_task(b.claim("w2", wait_s=20.0))
    await asyncio.sleep(0.1)  # b's claim found nothing and waits
    assert held.attempt is not None and not claiming.done()
    started = time.monotonic()
    await a.release(held.attempt.attempt_id)
    [again] = await asyncio.wait_for(claiming, 10)
    assert again.rollout_id == held.rollout_id and time.monotonic() - started < PROMPT_S
