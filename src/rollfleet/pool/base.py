"""The provider plugin interface, instance lifecycle and the records pools report.

A *provider* knows how to make one expensive environment (a VM, a container, a sandbox)
and bring it back to a clean state; a *pool* decides who gets which one and when.
"""

from __future__ import annotations

import enum
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class InstanceState(str, enum.Enum):
    """Lifecycle of one environment instance inside a pool."""

    STARTING = "STARTING"  # the provider is creating it
    IDLE = "IDLE"  # clean and ready to hand out
    BUSY = "BUSY"  # held by exactly one holder
    RESETTING = "RESETTING"  # released; being brought back to its snapshot in the background
    BROKEN = "BROKEN"  # quarantined: reset, check or start failed; being replaced
    STOPPED = "STOPPED"  # gone for good (the pool closed, or replacement gave up)


@runtime_checkable
class Provider(Protocol):
    """Makes, resets, checks and stops one kind of environment; the handle is its own."""

    name: str

    async def start(self, instance_id: str) -> Any:
        """Create one instance and return its handle; raise on failure."""
        ...

    async def reset(self, handle: Any) -> None:
        """Bring the instance back to its clean snapshot; raise on failure."""
        ...

    async def check(self, handle: Any) -> None:
        """Raise when the instance is unhealthy; return quietly when it is fine."""
        ...

    async def stop(self, handle: Any) -> None:
        """Release everything the instance holds; must not raise for a dead instance."""
        ...

    def endpoint(self, handle: Any) -> str | None:
        """Where a client reaches the instance (an address, a path), or None."""
        ...


@dataclass(frozen=True)
class Instance:
    """What a holder gets: the instance's id, its endpoint and (in-process only) its handle."""

    instance_id: str
    pool: str
    endpoint: str | None
    handle: Any = field(default=None, compare=False, repr=False)
    generation: int = 0
    attempt_id: str | None = None
    lease_id: str | None = None
    ticket: int = 0  # the order the acquire arrived in
    serial: int = 0  # the order it was served in
    expires_at: float | None = None  # wall-clock lease expiry (remote leases)


class Report(BaseModel):
    """Base of the records a pool reports: frozen, no extra fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class InstanceInfo(Report):
    """One slot of a pool as its stats show it."""

    instance_id: str
    state: InstanceState
    generation: int = Field(description="how many times this slot's instance was replaced")
    endpoint: str | None = None
    attempt_id: str | None = Field(default=None, description="the holder's rollout attempt")
    leases: int = 0
    failures: int = 0
    last_error: str | None = None


class PoolStats(Report):
    """A pool's state: per instance, waiting, wait-time percentiles, utilisation."""

    name: str
    provider: str
    size: int = Field(description="instances the pool is meant to have")
    healthy: int = Field(description="instances that are IDLE, BUSY or RESETTING")
    degraded: bool = Field(description="healthy < size: some slot could not be replaced")
    states: dict[str, int]
    instances: list[InstanceInfo]
    waiting: int
    acquired: int
    timeouts: int
    replacements: int
    wait_p50_s: float
    wait_p90_s: float
    wait_p99_s: float
    utilisation: float = Field(description="fraction of instance-time spent BUSY")


class EnvSource(Protocol):
    """What a runner needs from ``ctx.env``: a local Pool and a RemotePool both satisfy it."""

    def lease(
        self, *, attempt_id: str | None = None, timeout: float | None = None
    ) -> AbstractAsyncContextManager[Instance]:
        """Hold one instance for the body of an ``async with``; release it whatever happens."""
        ...

    async def close(self) -> None:
        """Release everything this source holds."""
        ...
