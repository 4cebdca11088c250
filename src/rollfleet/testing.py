"""Test doubles shipped with the package (used by rollfleet's own tests and by users' tests)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from rollfleet.model import Step, StepIn


class FakeClock:
    """A wall clock that only moves when told to; pass ``clock=FakeClock()`` to a store."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        """The current fake time (UNIX seconds)."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward and return the new time."""
        with self._lock:
            self._now += seconds
            return self._now


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    """``rollfleet serve`` in a subprocess on a free loopback port (killed by the test)."""

    def __init__(self, db_url: str, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "serve",
            "--db",
            db_url,
            "--port",
            str(self.port),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._popen = subprocess.Popen
        self._log = tempfile.TemporaryFile()  # the server's output, shown if it fails to start

    def start(self, timeout: float = 60.0) -> ServeProcess:
        """Start and wait for /health."""
        self._log.seek(0)
        self._log.truncate()
        self.proc = self._popen(self.args, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                said = self._log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}: {' '.join(self.args)}\n{said}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    def kill(self) -> None:
        """SIGKILL the server and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM the server and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()


class StepRecorder:
    """A gateway recorder keeping every step in memory (``Gateway(StepRecorder())``): the store's
    ``add_steps`` stand-in for tests and benchmarks of what the gateway records."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str, StepIn]] = []  # (rollout, attempt, step), in order

    async def __call__(self, rollout_id: str, attempt_id: str, step: StepIn) -> None:
        """Record one step."""
        self.steps.append((rollout_id, attempt_id, step))

    def of(self, attempt_id: str) -> list[Step]:
        """One attempt's steps as the store hands them back (numbered from 1)."""
        mine = [(r, s) for r, a, s in self.steps if a == attempt_id]
        return [
            Step(
                rollout_id=r,
                attempt_id=attempt_id,
                sequence=i,
                kind=s.kind,
                payload=s.payload,
                timestamp=s.timestamp or 0.0,
            )
            for i, (r, s) in enumerate(mine, 1)
        ]
