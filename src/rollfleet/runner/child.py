"""One runner process: ``python -m rollfleet.runner.child --spec JSON`` (a
:class:`~rollfleet.runner.spec.RunnerSpec`; its tokens come from ``ROLLFLEET_TOKEN`` and
``ROLLFLEET_LLM_TOKEN``, never from a command line).

Prints one JSON line per lifecycle event on stdout (the launcher turns them into output);
SIGTERM/SIGINT drains, a second signal (or SIGUSR1) releases everything at once (``supervised``:
SIGINT is left to the supervisor, which turns it into SIGTERM).

Events travel on a private copy of the original stdout, written by a thread of their own: the
event loop never blocks on a full pipe (a supervisor that stops reading costs events, counted on
stderr, never the runner's leases), and a line is at most ``MAX_EVENT_BYTES`` (long strings in an
event are trimmed). File descriptor 1 itself is pointed at stderr, so what an agent prints can
never corrupt an event line.

The spec's ``llm`` gives every rollout ``ctx.llm``: an OpenAI client for ``url`` tagged with its
rollout and attempt (its API key the LLM token, or with ``mint`` an attempt capability made from
that rollfleet gateway token), or with ``own_engine`` a private llama.cpp engine in this process
(one engine per process, for comparisons); ``env`` gives ``ctx.env``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import sys
import threading
from typing import Any

from pydantic import ValidationError

from rollfleet.errors import AgentError
from rollfleet.runner.process import Tokens, spec_runner
from rollfleet.runner.runner import ORPHAN_RECORD_S, Runner
from rollfleet.runner.spec import RunnerSpec

MAX_EVENT_BYTES = 8 * 1024  # one event line at most (the supervisor skips longer ones anyway)
MAX_FIELD_CHARS = 512  # a string longer than this in an over-long event is cut to this
QUEUED_EVENTS = 10_000  # events waiting for the pipe; more are dropped and counted


def encode_event(event: dict[str, Any], limit: int = MAX_EVENT_BYTES) -> bytes:
    """One event as a JSON line of at most ``limit`` bytes: long strings are trimmed first, and
    if that is not enough, only the event's name and ids are kept (``"trimmed": true``)."""
    line = json.dumps(event, default=str).encode() + b"\n"
    if len(line) <= limit:
        return line
    short = {k: _trim(v) for k, v in event.items()}
    short["trimmed"] = True
    line = json.dumps(short, default=str).encode() + b"\n"
    if len(line) <= limit:
        return line
    ids = {k: _trim(event[k], 200) for k in ("event", "worker_id", "rollout_id") if k in event}
    return json.dumps({**ids, "trimmed": True}, default=str).encode() + b"\n"


def _trim(value: Any, limit: int = MAX_FIELD_CHARS) -> Any:
    if not isinstance(value, (str, int, float, bool, type(None))):
        value = str(value)
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "…"
    return value


class EventPipe:
    """Event lines written to a file descriptor by a daemon thread, never by the event loop."""

    def __init__(self, fd: int, capacity: int = QUEUED_EVENTS) -> None:
        self.fd = fd
        self.dropped = 0
        self._queue: queue.Queue[bytes] = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._write, daemon=True, name="rollfleet-events")
        self._thread.start()

    def put(self, event: dict[str, Any]) -> None:
        """Queue one event; a full queue (nobody reads the pipe) drops it and counts the drop."""
        try:
            self._queue.put_nowait(encode_event(event))
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                sys.stderr.write(f"rollfleet runner: {self.dropped} events dropped (pipe full)\n")

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queued events to be written."""
        done = threading.Event()

        def joined() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=joined, daemon=True).start()
        return done.wait(timeout)

    def _write(self) -> None:
        while True:
            line = self._queue.get()
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError:
                pass  # the reader is gone: the event is lost, the runner goes on
            finally:
                self._queue.task_done()


_pipe: EventPipe | None = None


def take_stdout_for_events() -> EventPipe:
    """Move the event channel to a private copy of stdout, and point fd 1 (prints) at stderr."""
    global _pipe
    if _pipe is None:
        sys.stdout.flush()
        fd = os.dup(1)  # not inherited by anything this runner starts (PEP 446)
        os.dup2(2, 1)
        _pipe = EventPipe(fd)
    return _pipe


def emit(event: str, **fields: Any) -> None:
    """Send one event (a JSON line of bounded size) to the launcher without blocking."""
    record = {"event": event, **fields}
    if _pipe is not None:
        _pipe.put(record)
    else:
        sys.stdout.buffer.write(encode_event(record))
        sys.stdout.flush()


async def _watch_parent(parent: int, runner: Runner) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 - no event tells a process its parent died
        await asyncio.sleep(1.0)
    runner.stop(drain=False, record_s=ORPHAN_RECORD_S)


async def _serve(spec: RunnerSpec, tokens: Tokens) -> int:
    try:
        async with spec_runner(spec, tokens, on_event=emit) as runner:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, runner.stop)
            # SIGUSR1: release now. Two SIGTERMs sent back to back reach a process as one (a
            # pending signal is not queued twice), so a supervisor that wants "release now"
            # sends this instead.
            loop.add_signal_handler(signal.SIGUSR1, lambda: runner.stop(drain=False))
            # supervised: a terminal's Ctrl-C reaches the whole process group, and the
            # supervisor turns it into SIGTERM; acting on it too would make one Ctrl-C a second
            # signal (release at once). A handler, not SIG_IGN: what this runner starts gets the
            # default disposition back at exec.
            quiet = spec.supervised
            loop.add_signal_handler(signal.SIGINT, (lambda: None) if quiet else runner.stop)
            watcher = None
            if spec.exit_with_parent:
                watcher = asyncio.create_task(_watch_parent(os.getppid(), runner))
            try:
                await runner.run()
            finally:
                if watcher is not None:
                    watcher.cancel()
    except AgentError as exc:  # the agent, or the runner's own engine, did not start
        emit("agent_error", worker_id=spec.worker_id, error=str(exc))
        return 3
    return 0


def parse_spec(argv: list[str] | None = None) -> RunnerSpec:
    """The ``--spec`` argument; a spec that does not validate exits 2 naming the field."""
    parser = argparse.ArgumentParser(
        prog="rollfleet-runner", description="one runner process (started by a fleet)"
    )
    parser.add_argument("--spec", required=True, help="a RunnerSpec as JSON")
    raw = parser.parse_args(argv).spec
    try:
        return RunnerSpec.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "spec"
        parser.error(f"--spec: {field}: {first['msg']}")


def main() -> None:
    """Parse the spec and run."""
    spec = parse_spec()
    tokens = Tokens.take()
    pipe = take_stdout_for_events()
    try:
        code = asyncio.run(_serve(spec, tokens))
    finally:
        pipe.flush(2.0)  # the last events (worker_stopped) if the launcher still reads
    raise SystemExit(code)


if __name__ == "__main__":
    main()
