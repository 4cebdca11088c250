"""HTTP routes for batches: ``coordinator_router(coordinator)``, mounted at ``/batches`` by serve.

Answers are the coordinator's records as JSON (``BatchInfo``, ``FinalizeResult``, ``AbortResult``,
``ExperienceStats``). Errors are the app's usual ``{"error", "message"}`` bodies (404 unknown
batch, 409 a state change the batch's lifecycle refuses or a reused batch id, 422 bad input): the
router raises rollfleet errors and the app maps them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollfleet.coordinator.coordinator import RolloutCoordinator
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


def coordinator_router(coordinator: RolloutCoordinator) -> APIRouter:
    """Routes for submit, list, get, finalize, abort and experiences."""
    r = APIRouter(tags=["batches"])

    @r.post("")
    async def submit(body: SubmitBatch) -> BatchInfo:
        return await coordinator.submit_batch(
            body.batch_id,
            body.specs or body.tasks,
            body.batch_type,
            body.min_wait_num,
            body.repeat_times,
            policy=body.policy,
            mode=body.mode,
            config=body.config,
            priority=body.priority,
            max_staleness=body.max_staleness,
        )

    @r.post("/policy_version")
    async def policy_version(body: PolicyVersion) -> dict[str, Any]:
        """Report the policy version the engines serve; held batches that now fit are admitted."""
        admitted = await coordinator.set_policy_version(body.version)
        return {"version": body.version, "admitted": admitted}

    @r.get("")
    async def list_batches() -> list[BatchInfo]:
        return await coordinator.list_batches()

    @r.get("/{batch_id}")
    async def get_batch(batch_id: str) -> BatchInfo:
        return await coordinator.get_batch(batch_id)

    @r.post("/{batch_id}/finalize")
    async def finalize(batch_id: str, body: FinalizeBatch | None = None) -> FinalizeResult:
        body = body or FinalizeBatch()
        return await coordinator.finalize_batch(
            batch_id, timeout=body.timeout, wait_after_min=body.wait_after_min
        )

    @r.post("/{batch_id}/abort")
    async def abort(batch_id: str, body: AbortBatch) -> AbortResult:
        return await coordinator.abort_batch(
            batch_id, reason=body.reason, keep_partial_results=body.keep_partial_results
        )

    @r.post("/{batch_id}/experiences")
    async def experiences(batch_id: str, body: ProcessExperiences | None = None) -> ExperienceStats:
        body = body or ProcessExperiences()
        return await coordinator.process_experiences(batch_id, estimator=body.estimator)

    return r
