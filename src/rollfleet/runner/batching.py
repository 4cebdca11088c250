"""Natural batching: the first item goes at once; those that arrive meanwhile go together next.

No timer, so a lone item waits for nothing; under load one request carries many. Used for
completions (``complete_many``) and for the first heartbeat of each new attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")
MAX_BATCH = 256


class NaturalBatcher(Generic[In, Out]):
    """Sends items through ``send_many`` (answers aligned with items) in as few calls as it can."""

    def __init__(self, send_many: Callable[[list[In]], Awaitable[list[Out]]]) -> None:
        self._send_many = send_many
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def submit(self, item: In) -> Out:
        """Queue one item and return its answer."""
        fut: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        return await asyncio.shield(fut)

    async def _send(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:
                answers = await self._send_many([item for item, _ in batch])
            except Exception as exc:  # every submitter hears of it; none is left waiting forever
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), answer in zip(batch, answers, strict=True):
                if not fut.done():
                    fut.set_result(answer)

    async def close(self) -> None:
        """Wait for everything queued to be sent."""
        if self._sender is not None:
            with contextlib.suppress(Exception):
                await self._sender
