"""rollfleet.coordinator: submit, finalize and abort train/eval batches; experiences to train on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollfleet.coordinator.actor import CoordinatorActor, get_actor
from rollfleet.coordinator.advantages import group_advantages
from rollfleet.coordinator.api import BatchCoordinator
from rollfleet.coordinator.client import CoordinatorClient
from rollfleet.coordinator.coordinator import RolloutCoordinator
from rollfleet.coordinator.experiences import (
    Experience,
    ExperienceStats,
    read_experiences,
)
from rollfleet.coordinator.state import (
    AbortResult,
    BatchInfo,
    BatchLifecycleState,
    BatchState,
    FinalizeResult,
    StragglerPolicy,
)
from rollfleet.coordinator.stragglers import AbortHook

if TYPE_CHECKING:

    def _each_declares_the_api(
        here: RolloutCoordinator, remote: CoordinatorClient, actor: CoordinatorActor
    ) -> list[BatchCoordinator]:
        """mypy fails here when one of the three drifts from :class:`BatchCoordinator`."""
        return [here, remote, actor]


__all__ = [
    "AbortHook",
    "AbortResult",
    "BatchCoordinator",
    "BatchInfo",
    "BatchLifecycleState",
    "BatchState",
    "CoordinatorClient",
    "Experience",
    "ExperienceStats",
    "FinalizeResult",
    "RolloutCoordinator",
    "StragglerPolicy",
    "get_actor",
    "group_advantages",
    "read_experiences",
]
