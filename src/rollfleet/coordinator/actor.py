"""The coordinator as a Ray actor: ``get_actor(store_url)``.

The actor is async (Ray runs its methods on one event loop), named and detached-free: the first
call creates it, later calls with the same name return the same actor. It opens its own store
from the URL (stores are connections, not picklable values) and prepares itself on first use.
Its methods answer the coordinator's own records (``BatchInfo``, ``FinalizeResult`` …).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollfleet.coordinator.coordinator import RolloutCoordinator
from rollfleet.coordinator.experiences import ExperienceStats
from rollfleet.coordinator.state import (
    AbortResult,
    BatchInfo,
    BatchType,
    FinalizeResult,
    StragglerPolicy,
)
from rollfleet.errors import ClusterError
from rollfleet.model import RolloutConfig

DEFAULT_NAME = "rollfleet-coordinator"


class CoordinatorActor:
    """A RolloutCoordinator behind Ray's actor interface; every method is the coordinator's own."""

    def __init__(self, store_url: str, coordinator_options: dict[str, Any]) -> None:
        self._coordinator = RolloutCoordinator(store_url, **coordinator_options)

    async def prepare(self) -> None:
        """Open the store and load persisted batches."""
        await self._coordinator.prepare()

    async def shutdown(self) -> None:
        """Close the store."""
        await self._coordinator.shutdown()

    async def submit_batch(
        self,
        batch_id: str | int,
        tasks: Sequence[Any],
        batch_type: BatchType = "train",
        min_wait_num: int | None = None,
        repeat_times: int = 1,
        *,
        policy: StragglerPolicy | str | None = None,
        mode: str | None = None,
        config: RolloutConfig | None = None,
        priority: int = 0,
        max_staleness: int | None = None,
    ) -> BatchInfo:
        """Submit a batch."""
        return await self._coordinator.submit_batch(
            batch_id,
            tasks,
            batch_type,
            min_wait_num,
            repeat_times,
            policy=policy,
            mode=mode,
            config=config,
            priority=priority,
            max_staleness=max_staleness,
        )

    async def get_batch(self, batch_id: str | int) -> BatchInfo:
        """One batch."""
        return await self._coordinator.get_batch(batch_id)

    async def list_batches(self) -> list[BatchInfo]:
        """Every batch, oldest first."""
        return await self._coordinator.list_batches()

    async def finalize_train_batch(
        self,
        batch_id: str | int,
        *,
        timeout: float | None = None,
        wait_after_min: float | None = None,
    ) -> FinalizeResult:
        """Finalize a train batch."""
        return await self._coordinator.finalize_train_batch(
            batch_id, timeout=timeout, wait_after_min=wait_after_min
        )

    async def finalize_eval_batch(
        self, batch_id: str | int, *, timeout: float | None = None
    ) -> FinalizeResult:
        """Finalize an eval batch."""
        return await self._coordinator.finalize_eval_batch(batch_id, timeout=timeout)

    async def abort_batch(
        self, batch_id: str | int, *, reason: str, keep_partial_results: bool = False
    ) -> AbortResult:
        """Abort a batch."""
        return await self._coordinator.abort_batch(
            batch_id, reason=reason, keep_partial_results=keep_partial_results
        )

    async def process_experiences(
        self, batch_id: str | int, *, estimator: str = "grpo"
    ) -> ExperienceStats:
        """Write a batch's experiences; returns their figures."""
        return await self._coordinator.process_experiences(batch_id, estimator=estimator)

    async def set_policy_version(self, version: int) -> list[str]:
        """Report the version the engines serve; the ids of held batches now admitted."""
        return await self._coordinator.set_policy_version(version)


def get_actor(
    store_url: str,
    *,
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    experience_dir: str | Path | None = None,
    **coordinator_options: Any,
) -> Any:
    """The named Ray actor running a coordinator on ``store_url`` (created once, then found again).

    Ray must be initialised by the caller; ``coordinator_options`` go to ``RolloutCoordinator``.
    """
    try:
        import ray
    except ImportError as exc:
        raise ClusterError("the coordinator actor needs Ray: pip install 'rollfleet[ray]'") from exc
    if not ray.is_initialized():
        raise ClusterError("call ray.init() before get_actor()")
    if experience_dir is not None:
        coordinator_options["experience_dir"] = str(experience_dir)
    remote = ray.remote(num_cpus=0)(CoordinatorActor)
    return remote.options(
        name=name, namespace=namespace, get_if_exists=True, max_concurrency=64
    ).remote(store_url, coordinator_options)
