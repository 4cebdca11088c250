"""rollfleet: durable, fast rollouts for LLM agents.

The public API is exactly ``__all__`` (guarded by a test). Heavy parts (Ray, torch, pyarrow) load
only when their names are first used.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollfleet.client import HttpStore, SyncStore, connect, connect_sync
from rollfleet.errors import (
    AgentError,
    ClusterError,
    ClusterTimeout,
    Conflict,
    EngineError,
    InvalidInput,
    NotFound,
    PoolError,
    PoolTimeout,
    RollfleetError,
    StoreUnavailable,
    Unauthorized,
)
from rollfleet.model import (
    Attempt,
    AttemptStatus,
    Completion,
    Page,
    Resources,
    Rollout,
    RolloutConfig,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    Statistics,
    Step,
    StepIn,
    Worker,
    WorkerStatus,
)
from rollfleet.runner import Fleet, RolloutContext, Runner, agent, run_workers
from rollfleet.store import SqlStore, Store

_LAZY = {
    "RolloutCoordinator": "rollfleet.coordinator",
    "BatchLifecycleState": "rollfleet.coordinator",
    "StragglerPolicy": "rollfleet.coordinator",
    "Pool": "rollfleet.pool",
    "env_source": "rollfleet.pool",
    "Cluster": "rollfleet.cluster",
}

__all__ = [
    "AgentError",
    "Attempt",
    "AttemptStatus",
    "BatchLifecycleState",
    "Cluster",
    "ClusterError",
    "ClusterTimeout",
    "Completion",
    "Conflict",
    "EngineError",
    "Fleet",
    "HttpStore",
    "InvalidInput",
    "NotFound",
    "Page",
    "Pool",
    "PoolError",
    "PoolTimeout",
    "Resources",
    "RollfleetError",
    "Rollout",
    "RolloutConfig",
    "RolloutContext",
    "RolloutCoordinator",
    "RolloutResult",
    "RolloutSpec",
    "RolloutStatus",
    "Runner",
    "SqlStore",
    "Statistics",
    "Step",
    "StepIn",
    "Store",
    "StoreUnavailable",
    "StragglerPolicy",
    "SyncStore",
    "Unauthorized",
    "Worker",
    "WorkerStatus",
    "agent",
    "connect",
    "connect_sync",
    "env_source",
    "run_workers",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Load the heavy parts of the public API on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rollfleet' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
