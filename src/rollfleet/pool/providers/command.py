"""``command``: user shell commands start, reset, check and stop instances (existing fleets).

Each command runs with ``sh -c`` and sees ``ROLLFLEET_INSTANCE_ID`` (the pool slot, e.g.
``vms-0``) and, after start, ``ROLLFLEET_ENDPOINT`` (the last line ``start`` printed).
Values reach commands as environment variables, never pasted into the command text, so
an id cannot inject shell syntax. A non-zero exit is a failure (reset/check failures get
the instance replaced); its stderr tail is in the error.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.errors import PoolError


class CommandSpec(BaseModel):
    """The shell commands of a ``command`` pool; only ``start`` is required."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: str = Field(min_length=1, description="prints the endpoint on its last stdout line")
    reset: str | None = None
    check: str | None = None
    stop: str | None = None
    timeout_s: float = Field(default=600.0, gt=0, description="per command")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")


@dataclass(frozen=True)
class CommandInstance:
    """One instance: its slot id and the endpoint its start command printed."""

    instance_id: str
    endpoint: str | None


class CommandProvider:
    """Runs :class:`CommandSpec`'s commands for each lifecycle step."""

    name = "command"

    def __init__(self, spec: CommandSpec) -> None:
        """Use ``spec``'s commands."""
        self.spec = spec

    async def _sh(self, step: str, command: str, instance_id: str, endpoint: str | None) -> str:
        """Run one command; return its stdout; raise PoolError naming the step on failure."""
        env = {
            **os.environ,
            **self.spec.env,
            "ROLLFLEET_INSTANCE_ID": instance_id,
            "ROLLFLEET_ENDPOINT": endpoint or "",
        }
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            env=env,
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.spec.timeout_s)
        except TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise PoolError(
                f"{step} command for {instance_id} ran over {self.spec.timeout_s}s"
            ) from exc
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-500:]
            raise PoolError(f"{step} command for {instance_id} exited {proc.returncode}: {tail}")
        return out.decode(errors="replace")

    async def start(self, instance_id: str) -> CommandInstance:
        """Run ``start``; its last stdout line is the endpoint."""
        lines = (await self._sh("start", self.spec.start, instance_id, None)).strip().splitlines()
        return CommandInstance(instance_id, lines[-1].strip() if lines else None)

    async def reset(self, handle: CommandInstance) -> None:
        """Run ``reset`` (if given)."""
        if self.spec.reset:
            await self._sh("reset", self.spec.reset, handle.instance_id, handle.endpoint)

    async def check(self, handle: CommandInstance) -> None:
        """Run ``check`` (if given)."""
        if self.spec.check:
            await self._sh("check", self.spec.check, handle.instance_id, handle.endpoint)

    async def stop(self, handle: CommandInstance) -> None:
        """Run ``stop`` (if given)."""
        if self.spec.stop:
            await self._sh("stop", self.spec.stop, handle.instance_id, handle.endpoint)

    def endpoint(self, handle: CommandInstance) -> str | None:
        """What ``start`` printed last."""
        return handle.endpoint
