"""Launch an inference server as a child process and wait until its health check passes.

No fixed sleeps: the health URL is polled with a short back-off until it answers 200, the
child exits (error with its exit code and last output), or the start-up timeout passes (the
child's whole process group is killed and the error says so, with the last output).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence

import httpx

from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")
TAIL_LINES = 40


class ServerProcess:
    """One server child process with a health URL, a start-up timeout and a clean stop."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        health_url: str,
        *,
        startup_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.health_url = health_url
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(os.environ, **(env or {}))
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        """True while the child has not exited."""
        return self.proc is not None and self.proc.returncode is None

    def output(self) -> str:
        """The child's last lines of output."""
        return "\n".join(self.tail)

    async def start(self) -> None:
        """Spawn the child and return once healthy; kill it and raise EngineError otherwise."""
        log.info("%s: launching %s", self.name, " ".join(self.argv))
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise EngineError(f"{self.name}: cannot launch {self.argv[0]!r}: {exc}") from exc
        self._reader = asyncio.create_task(self._read_output(), name=f"{self.name}-output")
        try:
            await asyncio.wait_for(self._wait_healthy(), self.startup_timeout_s)
        except TimeoutError:
            await self.stop()
            raise EngineError(
                f"{self.name}: not healthy at {self.health_url} after {self.startup_timeout_s:g} s;"
                f" killed the server process. Last output:\n{self.output()}"
            ) from None
        except BaseException:
            await self.stop()
            raise
        log.info("%s: healthy at %s (pid %s)", self.name, self.health_url, self.pid)

    async def _wait_healthy(self) -> None:
        assert self.proc is not None
        delay = 0.05
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self.proc.returncode is not None:
                    await self._drain_output()
                    raise EngineError(
                        f"{self.name}: server exited with code {self.proc.returncode} before"
                        f" becoming healthy. Last output:\n{self.output()}"
                    )
                if await self._probe(client):
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), delay)
                delay = min(delay * 1.5, 1.0)

    async def _probe(self, client: httpx.AsyncClient) -> bool:
        try:
            response = await client.get(self.health_url)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            log.debug("%s| %s", self.name, line)

    async def _drain_output(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """Terminate the child's process group (SIGTERM, then SIGKILL); return its exit code."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                self._signal(signal.SIGKILL)
                await self.proc.wait()
        self._signal(signal.SIGKILL)  # stragglers left in the group
        await self._drain_output()
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        log.info("%s: stopped (exit code %s)", self.name, self.proc.returncode)
        return self.proc.returncode

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
