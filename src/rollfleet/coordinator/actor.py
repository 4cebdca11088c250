"""The coordinator as a Ray actor: ``get_actor(store_url)``.

The actor is async (Ray runs its methods on one event loop), named and detached-free: the first
call creates it, later calls with the same name return the same actor. It opens its own store
from the URL (stores are connections, not picklable values) and prepares itself on first use.
Its methods answer the coordinator's own records (``BatchInfo``, ``FinalizeResult`` …).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollfleet.coordinator.coordinator import RolloutCoordinator
from rollfleet.coordinator.experiences import ExperienceStats
from rollfleet.coordinator.state import AbortResult, BatchInfo, BatchType, FinalizeResult
from rollfleet.errors import ClusterError

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
        tasks: list[Any],
        batch_type: BatchType = "train",
        min_wait_num: int | None = None,
        repeat_times: int = 1,
        **kwargs: Any,
    ) -> BatchInfo:
        """Submit a batch."""
        return await self._coordinator.submit_batch(
            batch_id, tasks, batch_type, min_wait_num, repeat_times, **kwargs
        )

    async def get_batch(self, batch_id: str | int) -> BatchInfo:
        """One batch."""
        return await self._coordinator.get_batch(batch_id)

    async def finalize_train_batch(self, batch_id: str | int, **kwargs: Any) -> FinalizeResult:
        """Finalize a train batch."""
        return await self._coordinator.finalize_train_batch(batch_id, **kwargs)

    async def finalize_eval_batch(self, batch_id: str | int, **kwargs: Any) -> FinalizeResult:
        """Finalize an eval batch."""
        return await self._coordinator.finalize_eval_batch(batch_id, **kwargs)

    async def abort_batch(self, batch_id: str | int, **kwargs: Any) -> AbortResult:
        """Abort a batch."""
        return await self._coordinator.abort_batch(batch_id, **kwargs)

    async def process_experiences(self, batch_id: str | int, **kwargs: Any) -> ExperienceStats:
        """Write a batch's experiences; returns their figures."""
        return await self._coordinator.process_experiences(batch_id, **kwargs)

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
