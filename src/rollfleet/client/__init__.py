"""Clients: ``connect(url)`` gives a Store for any URL; ``connect_sync`` a blocking twin."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from rollfleet.client.endpoints import is_http
from rollfleet.client.http import HttpStore
from rollfleet.errors import InvalidInput
from rollfleet.store import Store, open_sql_store

DEFAULT_STORE_ENV = "ROLLFLEET_STORE"


def default_store_url() -> str:
    """ROLLFLEET_STORE, or the embedded SQLite file under ./.rollfleet/."""
    home = os.environ.get("ROLLFLEET_HOME", ".rollfleet")
    return os.environ.get(DEFAULT_STORE_ENV) or f"sqlite:///{home}/rollfleet.db"


def connect(url: str | Sequence[str] | None = None, *, token: str | None = None) -> Store:
    """Open a Store: ``http(s)://`` → the server (several, comma-separated or a list: replicas
    failed over between), ``sqlite:///`` or ``postgresql://`` → in-process."""
    url = url or default_store_url()
    if is_http(url):
        return HttpStore(url, token=token or os.environ.get("ROLLFLEET_TOKEN"))
    if not isinstance(url, str):
        raise InvalidInput(f"only control-plane URLs can be given as a list, not {url!r}")
    return open_sql_store(url)


class SyncStore:
    """A blocking twin of any Store: each method runs on a private event loop thread."""

    def __init__(self, factory: Callable[[], Store]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rollfleet-sync", daemon=True
        )
        self._thread.start()
        self._store: Store = self._run(self._make(factory))

    @staticmethod
    async def _make(factory: Callable[[], Store]) -> Store:
        return factory()

    def _run(self, coro: Any) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)
        if not callable(method):
            return method  # type: ignore[no-any-return]

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._run(method(*args, **kwargs))

        call.__doc__ = method.__doc__
        return call

    def close(self) -> None:
        """Close the store and stop the loop thread."""
        self._run(self._store.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_sync(url: str | Sequence[str] | None = None, *, token: str | None = None) -> SyncStore:
    """Open a blocking Store for scripts and notebooks."""
    return SyncStore(lambda: connect(url, token=token))


__all__ = ["HttpStore", "SyncStore", "connect", "connect_sync", "default_store_url"]
