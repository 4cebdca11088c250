"""rollfleet.coordinator: submit, finalize and abort train/eval batches; experiences to train on."""

from __future__ import annotations

from rollfleet.coordinator.actor import get_actor
from rollfleet.coordinator.advantages import group_advantages
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

__all__ = [
    "AbortHook",
    "AbortResult",
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
