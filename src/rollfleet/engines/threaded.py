"""Engines whose model lives on one worker thread (llama.cpp, transformers).

Model libraries are not thread-safe, so one worker thread owns the model. The event loop
hands it :class:`Pending` requests and control calls (weight updates) through one queue;
the worker streams results back with ``call_soon_threadsafe``. An abort is a flag the
worker reads between two tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from rollfleet.engines.base import (
    BaseEngine,
    Delta,
    EngineInfo,
    Generation,
    GenerationRequest,
    StreamItem,
)
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")
STOP = object()
"""Put on a worker's inbox to make it stop."""
T = TypeVar("T")


class Pending:
    """A request handed to a worker thread; results flow back to its asyncio loop.

    The worker thread calls :meth:`emit` and :meth:`finish`; the event loop side iterates
    :meth:`items`. ``aborted`` is set from the loop and read by the worker between tokens.
    """

    _ids = itertools.count()

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        self.aborted = threading.Event()
        self.done = threading.Event()
        self.order = next(self._ids)

    def emit(self, delta: Delta) -> None:
        """Send a delta to the waiting coroutine (thread-safe)."""
        self._put(delta)

    def finish(self, item: Generation | BaseException) -> None:
        """Send the final result or an error (thread-safe); later calls are ignored."""
        if self.done.is_set():
            return
        self.done.set()
        self._put(item)

    def _put(self, item: StreamItem | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def items(self) -> AsyncIterator[StreamItem]:
        """Yield what the worker sends until the final Generation (raise errors)."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Generation):
                return


class Registry:
    """In-flight :class:`Pending` requests by id, shared by the thread-backed engines."""

    def __init__(self) -> None:
        self._by_id: dict[str, Pending] = {}
        self._lock = threading.Lock()

    def add(self, pending: Pending) -> None:
        """Track ``pending`` until it is removed."""
        with self._lock:
            self._by_id[pending.request.request_id] = pending

    def remove(self, pending: Pending) -> None:
        """Stop tracking ``pending``."""
        with self._lock:
            self._by_id.pop(pending.request.request_id, None)

    def abort(self, request_ids: Iterable[str] | None) -> int:
        """Flag the named requests (all when None) as aborted; return how many were found."""
        with self._lock:
            targets = (
                list(self._by_id.values())
                if request_ids is None
                else [self._by_id[r] for r in request_ids if r in self._by_id]
            )
        for pending in targets:
            pending.aborted.set()
        return len(targets)

    def fail(self, error: BaseException) -> None:
        """End every tracked request with ``error`` (a worker thread died)."""
        with self._lock:
            targets = list(self._by_id.values())
        for pending in targets:
            pending.finish(error)

    def __len__(self) -> int:
        return len(self._by_id)


async def stream_pending(
    registry: Registry, pending: Pending, submit: Callable[[Pending], None]
) -> AsyncIterator[StreamItem]:
    """Register ``pending``, hand it to ``submit``, and yield its items; abort it if abandoned."""
    registry.add(pending)
    try:
        submit(pending)
        async for item in pending.items():
            yield item
    finally:
        if not pending.done.is_set():
            pending.aborted.set()
        registry.remove(pending)


class ThreadedEngine(BaseEngine):
    """An engine served by one worker thread; subclasses implement :meth:`work`."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.registry = Registry()
        self._thread: threading.Thread | None = None

    def start_worker(self) -> None:
        """Start the worker thread running :meth:`work`."""
        self._thread = threading.Thread(
            target=self.work, name=f"rollfleet-{self.name}", daemon=True
        )
        self._thread.start()

    def work(self) -> None:
        """The worker thread's loop (subclasses implement)."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Abort everything and stop the worker thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self.registry.abort(None)
        self.inbox.put(STOP)
        await asyncio.to_thread(thread.join)
        log.info("%s: stopped", self.name)

    async def health(self) -> bool:
        """True while the worker thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def info(self) -> EngineInfo:
        """Describe the engine."""
        return EngineInfo(
            self.name,
            self.model,
            self.version,
            self.max_concurrency,
            self._thread is not None,
            vision=self.vision,
            adapters=self.adapters,
        )

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """Queue ``request`` for the worker; yield its deltas and final Generation."""
        if self._thread is None:
            raise EngineError(f"{self.name}: engine is not started")
        self.check_images(request)
        pending = Pending(request, asyncio.get_running_loop())
        return stream_pending(self.registry, pending, self.inbox.put)

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Flag requests as aborted; each ends after its current token."""
        return self.registry.abort(request_ids)

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""
        return len(self.registry)

    async def relabel(self, version: int) -> int:
        """Serve the same weights as ``version``, from the next token the worker samples."""
        return await self.on_worker(lambda: self._next_version(version))

    async def on_worker(self, call: Callable[[], T]) -> T:
        """Run ``call`` on the worker thread between generation steps; return its result
        (EngineError at once when no worker runs: nothing would ever take the call)."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineError(f"{self.name}: engine is not started")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            if not done.done():
                outcome()

        def run() -> None:
            try:
                value = call()
            except Exception as exc:  # reported to the caller; the worker keeps serving
                loop.call_soon_threadsafe(settle, lambda error=exc: done.set_exception(error))
            else:
                loop.call_soon_threadsafe(settle, lambda: done.set_result(value))

        self.inbox.put(run)
        return await done
