"""The seed's two ways to give rollouts an environment, as one call: ``env_source``.

* shared pool mode (``--use-vm-pool --num-vms M``): the runner leases from a pool served by
  the control plane (a :class:`~rollfleet.pool.remote.RemotePool`), or, in one process,
  from a local :class:`~rollfleet.pool.pool.Pool` of M instances;
* per-runner mode (the default): the runner owns its environments for its lifetime: a
  private local pool with one instance per concurrent rollout, reset between rollouts.

:class:`EphemeralEnv` is the extreme of the second: a fresh instance per rollout, stopped
after it (no reuse, no reset). All of them have the same ``lease()``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from rollfleet.errors import PoolError
from rollfleet.pool.base import EnvSource, Instance, Provider
from rollfleet.pool.pool import Pool, PoolPolicy, _bounded
from rollfleet.pool.remote import RemotePool


def env_source(
    provider: Provider | None = None,
    *,
    use_pool: bool = False,
    num_instances: int = 3,
    concurrency: int = 1,
    pool_url: str | None = None,
    pool_name: str = "env",
    token: str | None = None,
    policy: PoolPolicy | None = None,
) -> EnvSource:
    """What ``ctx.env`` should be for the given mode (see the module docstring)."""
    if use_pool and pool_url:
        return RemotePool(pool_url, pool_name, token=token)
    if provider is None:
        raise PoolError("an environment provider is needed unless leasing from a pool service")
    size = num_instances if use_pool else concurrency
    return Pool(provider, size, name=pool_name, policy=policy)


class EphemeralEnv:
    """Per-rollout mode: every lease starts a fresh instance and stops it afterwards."""

    def __init__(
        self, provider: Provider, *, name: str = "env", policy: PoolPolicy | None = None
    ) -> None:
        """Start instances of ``provider`` on demand."""
        self.provider, self.name = provider, name
        self.policy = policy or PoolPolicy()
        self._ids = itertools.count()
        self._live: dict[str, Any] = {}

    @asynccontextmanager
    async def lease(
        self, *, attempt_id: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[Instance]:
        """A brand-new instance for the body; stopped afterwards whatever happens."""
        instance_id = f"{self.name}-{next(self._ids)}"
        limit = timeout if timeout is not None else self.policy.start_timeout_s
        handle = await _bounded(self.provider.start(instance_id), limit, f"starting {instance_id}")
        self._live[instance_id] = handle
        try:
            yield Instance(
                instance_id=instance_id,
                pool=self.name,
                handle=handle,
                endpoint=self.provider.endpoint(handle),
                attempt_id=attempt_id,
            )
        finally:
            await asyncio.shield(self._stop(instance_id))

    async def _stop(self, instance_id: str) -> None:
        handle = self._live.pop(instance_id, None)
        if handle is not None:
            await self.provider.stop(handle)

    async def close(self) -> None:
        """Stop whatever is still running."""
        await asyncio.gather(*(self._stop(i) for i in list(self._live)))
