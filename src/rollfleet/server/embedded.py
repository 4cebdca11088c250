"""Run the control plane inside this process, on a background thread (CLI, demo, tests)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import uvicorn

from rollfleet.errors import StoreUnavailable
from rollfleet.server.app import create_app
from rollfleet.server.parts import PartsFactory, dashboard_only
from rollfleet.store import open_sql_store
from rollfleet.web.guard import GUARD, GuardConfig
from rollfleet.web.serving import check_bind, free_port, uvicorn_options

log = logging.getLogger("rollfleet.server")


class ServerThread:
    """A uvicorn server for a store URL, on its own thread and event loop."""

    def __init__(
        self,
        store_url: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        token: str | None = None,
        parts: PartsFactory = dashboard_only,
        log_level: str = "warning",
        clock: Callable[[], float] | None = None,
        guard: GuardConfig = GUARD,
    ) -> None:
        check_bind(host, token)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._store_url = store_url
        self._token = token
        self._parts = parts
        self._log_level = log_level
        self._clock = clock
        self._guard = guard
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving and return once the port accepts requests."""
        self._thread = threading.Thread(target=self._serve, name="rollfleet-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise StoreUnavailable(f"embedded server did not start on {self.url}: {self._error}")
        return self

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        store = open_sql_store(self._store_url, clock=self._clock)
        parts = self._parts(store)
        app = create_app(
            store,
            token=self._token,
            routers=parts.routers,
            checked_routers=parts.checked,
            on_startup=parts.on_startup,
            on_shutdown=parts.on_shutdown,
            middleware=parts.middleware,
            guard=self._guard,
        )
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level=self._log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=3,
            **uvicorn_options(self._guard),
        )
        self._server = uvicorn.Server(config)
        serving = asyncio.create_task(self._server.serve())
        while not self._server.started and not serving.done():  # noqa: ASYNC110 - uvicorn has no event
            await asyncio.sleep(0.01)
        self._ready.set()
        await serving

    def stop(self) -> None:
        """Stop serving and wait for the thread to end."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
