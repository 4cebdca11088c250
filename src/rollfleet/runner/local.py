"""``LocalFleet``: N runner processes on this machine, supervised and restarted with backoff.

Each child writes its events as JSON lines on a pipe of its own. The reader takes any bytes: a
line over ``MAX_LINE_BYTES``, one that is not JSON or not an event, or an ``on_event`` that
raises is skipped and logged, never the end of the reader. A child's exit is noticed whether or
not its pipe is drained or still held open.

Each child gets one :class:`~rollfleet.runner.spec.RunnerSpec` (``--spec JSON``); the tokens
travel in its environment.

Stopping: ``stop()`` sends every child SIGTERM (it drains: running rollouts get ``grace_s``), and
a child still running ``grace_s + RELEASE_S`` later is killed. ``stop(drain=False)``, or a second
``stop()``, sends SIGUSR1 (children release everything at once; a second SIGTERM could merge with
a first one still pending) and kills ``RELEASE_S`` later; a further call kills now.
Children run ``supervised`` (they leave SIGINT to the supervisor: a terminal's Ctrl-C
reaches the whole process group, and the supervisor decides what they get) and with
``exit_with_parent`` (they stop if the supervisor dies). They stay in the supervisor's process
group, so signalling that group still reaches every one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollfleet.envs import EnvSpec
from rollfleet.runner.spec import LlmAccess, RunnerSpec

log = logging.getLogger("rollfleet.runner")
EventFn = Callable[[dict[str, Any]], None]
MAX_BACKOFF_S = 30.0
HEALTHY_S = 60.0  # a child that ran this long before it died was not crash-looping
MAX_LINE_BYTES = 1 << 20  # an event line longer than this is skipped (children cap theirs at 8 KiB)
RELEASE_S = 5.0  # after the grace period, a child gets this long to release what still runs
DRAIN_S = 2.0  # after a child exits, its remaining events are read for this long at most


@dataclass
class _Child:
    worker_id: str
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0  # exits in a row without progress
    started_at: float = 0.0
    finished: int = 0  # rollouts it finished since it last started
    started: int = 0  # rollouts it started since it last started
    events: asyncio.ReadTransport | None = None
    reader: EventLines | None = None


@dataclass(frozen=True)
class Restart:
    """When to restart a runner that exited, and why."""

    delay_s: float
    reason: str
    in_a_row: int  # exits in a row without progress, this one included (0 after progress)


def restart_delay(
    in_a_row: int, finished: int, ran_s: float, killed_at_work: bool = False
) -> Restart:
    """The restart policy, for local processes and Ray actors alike: a runner that finished
    rollouts since it started, or ran HEALTHY_S, or was SIGKILLed while it ran rollouts
    (``killed_at_work``) was killed from outside (an operator, preemption, the OOM killer) and
    restarts at once; only one that dies without progress is backed off (0.5 s, 1 s, ... 30 s).
    ``in_a_row`` counts such exits before this one.

    At once matters for long rollouts: a ten-turn agent rollout can outlive a runner on a
    preemptible machine, and its attempts are requeued (to resume from their last turn) when the
    runner registers again. A crash loop dies by itself (an exception, an exit code, a segfault),
    not by SIGKILL; a rollout that kills its runner every time fails after its ``max_lost``."""
    if finished:
        return Restart(0.0, f"made progress ({finished} rollouts finished): restarting at once", 0)
    if ran_s > HEALTHY_S:
        return Restart(0.0, f"ran {ran_s:.0f} s: restarting at once", 0)
    if killed_at_work:
        return Restart(0.0, "SIGKILLed while it ran rollouts: restarting at once", 0)
    n = in_a_row + 1
    delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (n - 1))
    return Restart(
        delay, f"died after {ran_s:.1f} s without progress ({n} in a row): backing off", n
    )


class EventLines(asyncio.Protocol):
    """Splits a pipe into lines; a line over ``limit`` bytes is dropped whole, never buffered."""

    def __init__(
        self,
        on_line: Callable[[bytes], None],
        on_overlong: Callable[[int], None],
        limit: int = MAX_LINE_BYTES,
    ) -> None:
        self.on_line, self.on_overlong, self.limit = on_line, on_overlong, limit
        self.closed = asyncio.Event()
        self._buffer = bytearray()
        self._skipped = -1  # bytes of an over-long line dropped so far; -1 when not inside one

    def data_received(self, data: bytes) -> None:
        """Hand every complete line to ``on_line``; keep (or drop) the unfinished rest."""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if self._skipped >= 0:
                self.on_overlong(self._skipped + end - start)
                self._skipped = -1
            else:
                self._buffer += data[start:end]
                line = bytes(self._buffer)
                self._buffer.clear()
                self.on_line(line)
            start = end + 1
        if self._skipped >= 0:
            self._skipped += len(data) - start
        else:
            self._buffer += data[start:]
            if len(self._buffer) > self.limit:
                self._skipped = len(self._buffer)
                self._buffer.clear()

    def eof_received(self) -> bool | None:
        """An unterminated last line still counts (the child died mid-write: it will not parse)."""
        if self._buffer:
            line = bytes(self._buffer)
            self._buffer.clear()
            self.on_line(line)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        """The pipe is closed: every event has been read."""
        self.closed.set()


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
        llm_token: str | None = None,
        grace_s: float = 30.0,
        on_event: EventFn | None = None,
        llm: LlmAccess | None = None,
        env: EnvSpec | None = None,
    ) -> None:
        self.spec = RunnerSpec(  # each child's, under its own worker id
            store=store_url,
            agent=agent,
            worker_id=prefix,
            concurrency=concurrency,
            grace_s=grace_s,
            llm=llm or LlmAccess(),
            env=env,
            exit_with_parent=True,
            supervised=True,
        )
        self.token = token
        self.llm_token = llm_token
        self.grace_s = grace_s
        self.on_event = on_event or (lambda e: None)
        self.children = [_Child(f"{prefix}-{i}") for i in range(n)]
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) by every stop()
        self._stops = 0
        self._kill_at = float("inf")
        self.agent_error: str | None = None

    def _argv(self, child: _Child) -> list[str]:
        spec = self.spec.model_copy(update={"worker_id": child.worker_id})
        return [sys.executable, "-m", "rollfleet.runner.child", "--spec", spec.model_dump_json()]

    def _env(self) -> dict[str, str]:
        """The children's environment: the tokens travel here, never on a command line (which
        every process on the machine can read in /proc/*/cmdline)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.token:
            env["ROLLFLEET_TOKEN"] = self.token
        if self.llm_token:
            env["ROLLFLEET_LLM_TOKEN"] = self.llm_token
        return env

    async def _spawn(self, child: _Child) -> None:
        """Start the child with its stdout on a pipe read here, not one asyncio's process owns:
        the process's exit is then known at once, even while something still holds the pipe."""
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *self._argv(child),
                stdout=write_fd,
                env=self._env(),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        child.started_at, child.finished, child.started = time.monotonic(), 0, 0
        reader = EventLines(
            lambda line: self._line(child, line),
            lambda size: log.warning(
                "%s: skipped an event line of %d bytes (over %d)",
                child.worker_id,
                size,
                MAX_LINE_BYTES,
            ),
        )
        transport, _ = await loop.connect_read_pipe(lambda: reader, os.fdopen(read_fd, "rb", 0))
        child.events, child.reader = transport, reader

    def _line(self, child: _Child, raw: bytes) -> None:
        """Handle one line from a child: a malformed one is logged, never raised."""
        try:
            event = json.loads(raw)
        except ValueError:
            log.warning("%s: skipped a line that is not JSON: %r", child.worker_id, raw[:120])
            return
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            log.warning("%s: skipped a line that is not an event: %r", child.worker_id, raw[:120])
            return
        if event["event"] == "rollout_finished":
            child.finished += 1
        elif event["event"] == "rollout_started":
            child.started += 1
        if event["event"] == "agent_error":
            self.agent_error = str(event.get("error"))
            self.stop()
        try:
            self.on_event(event)
        except Exception:
            log.exception("%s: on_event failed for %s", child.worker_id, event["event"])

    async def _close_events(self, child: _Child) -> None:
        """Read what the exited child left in its pipe, briefly, then close the pipe."""
        if child.reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.reader.closed.wait(), DRAIN_S)
        if child.events is not None:
            child.events.close()
        child.events = child.reader = None

    async def _supervise(self, child: _Child) -> None:
        while not self._stopping.is_set():
            code: int | None = None
            try:
                await self._spawn(child)
            except OSError as exc:  # cannot start a process now: retried like a crash
                log.warning("%s: could not start: %s", child.worker_id, exc)
                child.started_at, child.finished, child.started = time.monotonic(), 0, 0
            else:
                try:
                    code = await self._until_exit(child)
                finally:
                    await self._close_events(child)
            if self._stopping.is_set():
                break
            killed_at_work = code == -signal.SIGKILL and child.started > 0
            decided = restart_delay(
                child.restarts, child.finished, time.monotonic() - child.started_at, killed_at_work
            )
            child.restarts, delay, reason = decided.in_a_row, decided.delay_s, decided.reason
            self.on_event(
                {
                    "event": "worker_crashed",
                    "worker_id": child.worker_id,
                    "exit_code": code,
                    "restart_in_s": delay,
                    "reason": reason,
                }
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _until_exit(self, child: _Child) -> int:
        """Wait for the child to exit; once stopping, signal it and kill it at the deadline."""
        assert child.proc is not None
        proc = child.proc
        exited = asyncio.ensure_future(proc.wait())
        try:
            signalled = 0
            while not exited.done():
                if not self._stopping.is_set():
                    stopping = asyncio.ensure_future(self._stopping.wait())
                    await asyncio.wait([exited, stopping], return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    continue
                while signalled < min(self._stops, 2):
                    with contextlib.suppress(ProcessLookupError):  # the 2nd: release now (a 2nd
                        proc.send_signal((signal.SIGTERM, signal.SIGUSR1)[signalled])  # SIGTERM
                    signalled += 1  # sent at once would merge with the 1st)
                left = self._kill_at - time.monotonic()
                if self._stops >= 3 or left <= 0:
                    log.warning("%s: did not stop in time; killing it", child.worker_id)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    break
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait([exited, changed], timeout=left, return_when="FIRST_COMPLETED")
                changed.cancel()
            return await exited
        finally:
            exited.cancel()

    async def run(self) -> None:
        """Run every child until ``stop()``; returns after they have all exited."""
        tasks = [asyncio.create_task(self._supervise(c)) for c in self.children]
        try:
            try:
                await asyncio.wait(tasks)  # unlike gather, a cancel here leaves them running
            except asyncio.CancelledError:  # run() cancelled (asyncio.run's Ctrl-C): stop as
                self.stop()  # if stop() had been called; the supervisors bound it (grace + 5 s)
                await asyncio.wait(tasks)
                raise
            for task in tasks:
                task.result()  # a supervisor that failed
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for child in self.children:  # only if cancelled twice, or a supervisor failed
                if child.proc is not None and child.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.kill()

    def stop(self, *, drain: bool = True) -> None:
        """Stop every runner. ``drain``: running rollouts get ``grace_s`` to finish; without it
        they are released now. Each further call escalates: release now, then kill."""
        self._stops = self._stops + 1 if drain else max(self._stops + 1, 2)
        now = time.monotonic()
        if self._stops == 1:
            self._kill_at = now + self.grace_s + RELEASE_S
        else:
            self._kill_at = min(self._kill_at, now + RELEASE_S)
        self._stopping.set()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def pids(self) -> dict[str, int]:
        """The live children's process ids by worker id (chaos tests kill these)."""
        return {
            c.worker_id: c.proc.pid
            for c in self.children
            if c.proc is not None and c.proc.returncode is None
        }
