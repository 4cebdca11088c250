"""Background tasks kept referenced, named and watched: the one way rollfleet starts a task it
does not await where it starts it.

The event loop holds only weak references to tasks, so a task nobody keeps may vanish
mid-flight, and a task nobody watches may crash without a word. A :class:`TaskSet` keeps each
task until it ends, logs a crash with the task's name, and can wait for or cancel all of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    """The background tasks of one owner; a task that raises is logged with its name."""

    def __init__(self, logger: logging.Logger, owner: str) -> None:
        """Log crashes to ``logger``, prefixed with ``owner`` (e.g. a worker id or pool name)."""
        self._log = logger
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start ``coro`` as a task called ``name`` and keep it until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def __len__(self) -> int:
        """How many tasks have not ended yet."""
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """The tasks that have not ended yet (a snapshot)."""
        return iter(list(self._tasks))

    async def join(self, timeout: float | None = None) -> bool:
        """Wait until every task, those spawned meanwhile included, has ended; False on timeout."""
        return await self._settle(timeout, cancel=False)

    async def cancel(self, timeout: float | None = None) -> bool:
        """Cancel every task (and any spawned as they end) and wait for them; False on timeout."""
        return await self._settle(timeout, cancel=True)

    async def _settle(self, timeout: float | None, *, cancel: bool) -> bool:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while pending := self._pending():
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            if cancel:
                for task in pending:
                    task.cancel()
            await asyncio.wait(pending, timeout=left)
        return True

    def _pending(self) -> list[asyncio.Task[Any]]:
        """Unfinished tasks, less the caller's own (waiting for itself would never end)."""
        me = asyncio.current_task()
        return [task for task in self._tasks if not task.done() and task is not me]

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error(
                "%s: background task %r crashed", self._owner, task.get_name(), exc_info=exc
            )
