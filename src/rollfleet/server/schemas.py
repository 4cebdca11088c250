"""Request bodies of the HTTP API (responses are the model records themselves)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rollfleet.model import (
    ID_PATTERN,
    MAX_LEASE_S,
    MAX_TIMEOUT_S,
    AttemptStatus,
    Completion,
    Record,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    StepIn,
    WorkerStatus,
)


class EnqueueMany(Record):
    """Body of POST /rollouts/batch."""

    items: list[RolloutSpec] = Field(max_length=100_000)


class StartRollout(RolloutSpec):
    """Body of POST /rollouts/start."""

    worker_id: str | None = None


class ClaimRequest(Record):
    """Body of POST /claims."""

    worker_id: str = Field(min_length=1, max_length=200, pattern=ID_PATTERN)
    wait_s: float = Field(default=0.0, ge=0, le=300)
    max_n: int = Field(default=1, ge=1, le=1000)


class HeartbeatMany(Record):
    """Body of POST /workers/{id}/heartbeat."""

    attempt_ids: list[str] = Field(default_factory=list, max_length=10_000)


class AddSteps(Record):
    """Body of POST /attempts/{id}/steps."""

    steps: list[StepIn] = Field(max_length=10_000)


class StepsQuery(Record):
    """Body of POST /rollouts/steps (the store refuses more than 1,000 ids)."""

    rollout_ids: list[str]
    cursor: str | None = None
    limit: int = Field(default=500, ge=1, le=1000)


class CompleteRequest(Record):
    """Body of POST /attempts/{id}/complete."""

    status: AttemptStatus
    result: RolloutResult | None = None
    error: str | None = None


class CompleteMany(Record):
    """Body of POST /attempts/complete."""

    items: list[Completion] = Field(max_length=10_000)


class CompleteAndClaim(Record):
    """Body of POST /attempts/complete-and-claim."""

    items: list[Completion] = Field(min_length=1, max_length=10_000)
    worker_id: str = Field(min_length=1, max_length=200, pattern=ID_PATTERN)
    max_n: int = Field(default=1, ge=0, le=1000)


class ReleaseRequest(Record):
    """Body of POST /attempts/{id}/release."""

    reason: str = "released"


class RequeueRequest(Record):
    """Body of POST /rollouts/requeue."""

    statuses: list[RolloutStatus] = Field(default_factory=lambda: [RolloutStatus.PREPARING])
    rollout_ids: list[str] | None = None
    older_than_s: float = Field(default=0.0, ge=0, le=10 * MAX_TIMEOUT_S)


class RegisterWorker(Record):
    """Body of POST /workers."""

    worker_id: str = Field(min_length=1, max_length=200, pattern=ID_PATTERN)
    metadata: dict[str, Any] = Field(default_factory=dict)
    lease_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_S)


class UpdateWorker(Record):
    """Body of PATCH /workers/{id}."""

    status: WorkerStatus | None = None


class WaitRequest(Record):
    """Body of POST /rollouts/wait."""

    rollout_ids: list[str] = Field(max_length=100_000)
    timeout: float = Field(default=30.0, ge=0, le=300)


class AddResources(Record):
    """Body of POST /resources."""

    values: dict[str, Any]
    resources_id: str | None = None


class PutState(Record):
    """Body of PUT /state/{key}."""

    value: Any
