"""The public API is exactly what rollfleet/__init__.py exports; importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import rollfleet

EXPECTED = {
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
}


def test_all_is_the_public_surface() -> None:
    assert set(rollfleet.__all__) == EXPECTED
    for name in rollfleet.__all__:
        assert getattr(rollfleet, name) is not None, name


def test_import_does_not_load_ray_torch_or_pyarrow() -> None:
    code = "import sys, rollfleet; print(sorted({'ray', 'torch', 'pyarrow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
