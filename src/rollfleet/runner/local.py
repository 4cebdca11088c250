"""``LocalFleet``: N runner processes on this machine, supervised and restarted with backoff."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rollfleet.runner")
EventFn = Callable[[dict[str, Any]], None]
MAX_BACKOFF_S = 30.0


@dataclass
class _Child:
    worker_id: str
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0


class LocalFleet:
    """Starts ``n`` runner processes against a store URL and keeps them running until stopped."""

    def __init__(
        self,
        store_url: str,
        agent: str,
        *,
        n: int = 4,
        concurrency: int = 1,
        prefix: str = "worker",
        token: str | None = None,
        grace_s: float = 30.0,
        on_event: EventFn | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.store_url = store_url
        self.extra_args = list(
            extra_args
        )  # more rollfleet.runner.child options (--llm-url, --env-spec…)
        self.agent = agent
        self.concurrency = concurrency
        self.token = token
        self.grace_s = grace_s
        self.on_event = on_event or (lambda e: None)
        self.children = [_Child(f"{prefix}-{i}") for i in range(n)]
        self._stopping = asyncio.Event()
        self.agent_error: str | None = None

    def _argv(self, child: _Child) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "rollfleet.runner.child",
            "--store",
            self.store_url,
            "--agent",
            self.agent,
            "--worker-id",
            child.worker_id,
            "--concurrency",
            str(self.concurrency),
            "--grace-s",
            str(self.grace_s),
        ]
        return argv + self.extra_args

    def _env(self) -> dict[str, str]:
        """The children's environment: the token travels here, never on a command line (which
        every process on the machine can read in /proc/*/cmdline)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.token:
            env["ROLLFLEET_TOKEN"] = self.token
        return env

    async def _spawn(self, child: _Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            *self._argv(child),
            stdout=asyncio.subprocess.PIPE,
            env=self._env(),
        )
        child.started_at = time.monotonic()

    async def _pump(self, child: _Child) -> None:
        assert child.proc is not None and child.proc.stdout is not None
        async for raw in child.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if event.get("event") == "agent_error":
                self.agent_error = event.get("error")
                self._stopping.set()
            self.on_event(event)

    async def _supervise(self, child: _Child) -> None:
        while not self._stopping.is_set():
            await self._spawn(child)
            await self._pump(child)
            assert child.proc is not None
            code = await child.proc.wait()
            if self._stopping.is_set():
                break
            healthy = time.monotonic() - child.started_at > 60
            child.restarts = 0 if healthy else child.restarts + 1
            delay = min(MAX_BACKOFF_S, 0.5 * 2 ** max(0, child.restarts - 1))
            self.on_event(
                {
                    "event": "worker_crashed",
                    "worker_id": child.worker_id,
                    "exit_code": code,
                    "restart_in_s": delay,
                }
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def run(self) -> None:
        """Run every child until ``stop()``; returns after they have all exited."""
        tasks = [asyncio.create_task(self._supervise(c)) for c in self.children]
        await self._stopping.wait()
        await self._terminate()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _terminate(self) -> None:
        live = [c.proc for c in self.children if c.proc is not None and c.proc.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in live]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.grace_s + 10)
            for proc in live:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            if pending:
                await asyncio.wait(pending)

    def stop(self) -> None:
        """Ask every runner to drain and exit."""
        self._stopping.set()

    def pids(self) -> dict[str, int]:
        """The live children's process ids by worker id (chaos tests kill these)."""
        return {
            c.worker_id: c.proc.pid
            for c in self.children
            if c.proc is not None and c.proc.returncode is None
        }
