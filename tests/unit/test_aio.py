"""TaskSet: tasks kept until they end, crashes logged by name, join and cancel that miss none."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollfleet.aio import TaskSet

log = logging.getLogger("rollfleet.test_aio")


async def test_a_task_is_kept_until_it_ends() -> None:
    tasks = TaskSet(log, "owner")
    gate = asyncio.Event()
    task = tasks.spawn(gate.wait(), "waits")
    assert task.get_name() == "waits" and len(tasks) == 1 and list(tasks) == [task]
    gate.set()
    assert await tasks.join(5) and task.result() is True
    assert len(tasks) == 0 and list(tasks) == []


async def test_a_crash_is_logged_with_the_owner_and_the_task_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet(log, "w-1")

    async def boom() -> None:
        raise ValueError("boom")

    async def fine() -> None:
        return None

    caplog.set_level(logging.ERROR, logger=log.name)
    crashed = tasks.spawn(boom(), "rollout-7-finish")
    tasks.spawn(fine(), "quiet")
    assert await tasks.join(5)
    assert isinstance(crashed.exception(), ValueError)
    records = [r for r in caplog.records if r.name == log.name]
    assert len(records) == 1
    assert records[0].getMessage() == "w-1: background task 'rollout-7-finish' crashed"
    assert records[0].exc_info is not None and records[0].exc_info[1] is crashed.exception()


async def test_join_waits_for_tasks_spawned_meanwhile() -> None:
    tasks = TaskSet(log, "owner")
    gate, parent_ended = asyncio.Event(), asyncio.Event()
    ended: list[str] = []

    async def child() -> None:
        await gate.wait()
        ended.append("child")

    async def parent() -> None:
        tasks.spawn(child(), "child")
        ended.append("parent")
        parent_ended.set()

    tasks.spawn(parent(), "parent")
    joined = asyncio.create_task(tasks.join(5))
    await parent_ended.wait()  # the parent is done and has left its child behind
    assert not joined.done() and "child" in [t.get_name() for t in tasks]
    gate.set()
    assert await joined and ended == ["parent", "child"]


async def test_join_gives_up_at_its_timeout_and_leaves_the_tasks_running() -> None:
    tasks = TaskSet(log, "owner")
    gate = asyncio.Event()
    task = tasks.spawn(gate.wait(), "waits")
    assert not await tasks.join(0.01)
    assert not task.done() and len(tasks) == 1
    gate.set()
    assert await tasks.join(5)


async def test_join_from_inside_the_set_does_not_wait_for_itself() -> None:
    tasks = TaskSet(log, "owner")
    gate = asyncio.Event()
    other = tasks.spawn(gate.wait(), "other")

    async def joiner() -> bool:
        gate.set()
        return await tasks.join(5)

    assert await tasks.spawn(joiner(), "joiner") and other.done()


async def test_cancel_ends_every_task_including_those_spawned_while_ending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet(log, "owner")
    started = asyncio.Event()
    spawned: list[asyncio.Task[None]] = []

    async def forever() -> None:
        await asyncio.Event().wait()

    async def respawns() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            spawned.append(tasks.spawn(forever(), "spawned while ending"))

    first = [tasks.spawn(forever(), f"forever-{i}") for i in range(3)]
    first.append(tasks.spawn(respawns(), "respawns"))
    await started.wait()
    caplog.set_level(logging.ERROR, logger=log.name)
    assert await tasks.cancel(5)
    assert all(t.cancelled() for t in first + spawned) and len(spawned) == 1
    assert len(tasks) == 0
    assert not [r for r in caplog.records if r.name == log.name]  # a cancel is not a crash


async def test_cancel_gives_up_at_its_timeout_on_a_task_that_will_not_end() -> None:
    tasks = TaskSet(log, "owner")
    release = asyncio.Event()
    started = asyncio.Event()

    async def stubborn() -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # refuses to be cancelled until released

    task = tasks.spawn(stubborn(), "stubborn")
    await started.wait()
    assert not await tasks.cancel(0.05)
    assert not task.done()
    release.set()
    assert await tasks.join(5) and not task.cancelled()
