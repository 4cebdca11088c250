"""The batch coordinator's API, declared once: :class:`BatchCoordinator`, which the coordinator
itself, its HTTP client and its Ray actor each satisfy (mypy checks it in
``rollfleet.coordinator``), and the request bodies the HTTP service validates, with their bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollfleet.coordinator.experiences import ExperienceStats
from rollfleet.coordinator.staleness import MAX_STALENESS_BOUND
from rollfleet.coordinator.state import (
    AbortResult,
    BatchInfo,
    BatchType,
    FinalizeResult,
    StragglerPolicy,
)
from rollfleet.model import ID_PATTERN, MAX_TIMEOUT_S, PRIORITY_BOUND, RolloutConfig, RolloutSpec


class BatchCoordinator(Protocol):
    """Submit batches of tasks, finalize or abort them, turn them into experiences."""

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
        """Enqueue every task x ``repeat_times`` as rollouts (or hold them while
        ``max_staleness`` allows no more); returns at once."""
        ...

    async def get_batch(self, batch_id: str | int) -> BatchInfo:
        """One batch, its rollouts counted by status."""
        ...

    async def list_batches(self) -> list[BatchInfo]:
        """Every batch, oldest first."""
        ...

    async def finalize_train_batch(
        self,
        batch_id: str | int,
        *,
        timeout: float | None = None,
        wait_after_min: float | None = None,
    ) -> FinalizeResult:
        """Wait for the train batch, apply its straggler policy, aggregate."""
        ...

    async def finalize_eval_batch(
        self, batch_id: str | int, *, timeout: float | None = None
    ) -> FinalizeResult:
        """Wait for the eval batch; its metrics."""
        ...

    async def abort_batch(
        self, batch_id: str | int, *, reason: str, keep_partial_results: bool = False
    ) -> AbortResult:
        """Cancel the batch's unfinished rollouts."""
        ...

    async def process_experiences(
        self, batch_id: str | int, *, estimator: str = "grpo"
    ) -> ExperienceStats:
        """Write the finalized batch's experiences; their figures."""
        ...

    async def set_policy_version(self, version: int) -> list[str]:
        """Report the version the engines serve; the ids of held batches now admitted."""
        ...


MAX_REPEAT_TIMES = 1024  # samples per task
MAX_BATCH_ROLLOUTS = 100_000  # tasks x repeat_times: one request never allocates more


class SubmitBatch(BaseModel):
    """Body of ``POST /batches``."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str = Field(min_length=1, max_length=150, pattern=ID_PATTERN)
    tasks: list[Any] = Field(
        default_factory=list, max_length=MAX_BATCH_ROLLOUTS, description="task inputs"
    )
    specs: list[RolloutSpec] = Field(
        default_factory=list,
        max_length=MAX_BATCH_ROLLOUTS,
        description="or full rollout specs, one per task",
    )
    batch_type: BatchType = "train"
    min_wait_num: int | None = Field(default=None, ge=1)
    repeat_times: int = Field(default=1, ge=1, le=MAX_REPEAT_TIMES)
    policy: StragglerPolicy | None = None
    mode: str | None = None
    config: RolloutConfig | None = None
    priority: int = Field(default=0, gt=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    max_staleness: int | None = Field(
        default=None, ge=0, le=MAX_STALENESS_BOUND, description="train: versions a sample may lag"
    )

    @model_validator(mode="after")
    def _one_kind(self) -> SubmitBatch:
        if bool(self.tasks) == bool(self.specs):
            raise ValueError(
                "give exactly one of tasks (inputs) or specs (rollout specs), not empty"
            )
        total = len(self.tasks or self.specs) * self.repeat_times
        if total > MAX_BATCH_ROLLOUTS:
            raise ValueError(
                f"tasks x repeat_times is {total} rollouts; a batch holds at most "
                f"{MAX_BATCH_ROLLOUTS}"
            )
        return self


class PolicyVersion(BaseModel):
    """Body of ``POST /batches/policy_version``: the version every engine serves now."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=2**63 - 1)


class FinalizeBatch(BaseModel):
    """Body of ``POST /batches/{id}/finalize``."""

    model_config = ConfigDict(extra="forbid")

    timeout: float | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)
    wait_after_min: float | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)


class AbortBatch(BaseModel):
    """Body of ``POST /batches/{id}/abort``."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=2000)
    keep_partial_results: bool = False


class ProcessExperiences(BaseModel):
    """Body of ``POST /batches/{id}/experiences`` (files go to the server's experience dir)."""

    model_config = ConfigDict(extra="forbid")

    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
