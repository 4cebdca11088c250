"""Resource pools: N rollouts share M expensive environments (VMs, containers, sandboxes).

Entry points: :class:`Pool` (in-process), :class:`RemotePool` (leases from a pool service),
:func:`env_source` (the seed's pool / per-runner modes), :func:`pool_router` and
:class:`PoolRegistry` (serving pools from the control plane), :func:`load_registry` (a
config file). Every source has ``async with source.lease(attempt_id=...) as instance``.
"""

from rollfleet.pool.base import (
    EnvSource,
    Instance,
    InstanceInfo,
    InstanceState,
    PoolStats,
    Provider,
)
from rollfleet.pool.config import load_config, load_registry, parse_config
from rollfleet.pool.leases import Lease, PoolRegistry
from rollfleet.pool.modes import EphemeralEnv, env_source
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.command import CommandProvider, CommandSpec
from rollfleet.pool.providers.desktop import DesktopEnvStandIn, DesktopOptions, DesktopProvider
from rollfleet.pool.providers.memory import MemoryProvider
from rollfleet.pool.providers.sandbox import Sandbox, SandboxProvider
from rollfleet.pool.providers.sandbox_records import (
    RunResult,
    SandboxError,
    SandboxLimits,
    TestReport,
)
from rollfleet.pool.remote import RemotePool, fetch_pool_stats
from rollfleet.pool.service import pool_app, pool_router

__all__ = [
    "CommandProvider",
    "CommandSpec",
    "DesktopEnvStandIn",
    "DesktopOptions",
    "DesktopProvider",
    "EnvSource",
    "EphemeralEnv",
    "Instance",
    "InstanceInfo",
    "InstanceState",
    "Lease",
    "MemoryProvider",
    "Pool",
    "PoolPolicy",
    "PoolRegistry",
    "PoolStats",
    "Provider",
    "RemotePool",
    "RunResult",
    "Sandbox",
    "SandboxLimits",
    "SandboxProvider",
    "SandboxError",
    "TestReport",
    "env_source",
    "fetch_pool_stats",
    "load_config",
    "load_registry",
    "parse_config",
    "pool_app",
    "pool_router",
]
