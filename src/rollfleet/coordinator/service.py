"""HTTP routes for batches: ``coordinator_router(coordinator)``, mounted at ``/batches`` by serve.

Answers are the coordinator's records as JSON (``BatchInfo``, ``FinalizeResult``, ``AbortResult``,
``ExperienceStats``). Errors are the app's usual ``{"error", "message"}`` bodies (404 unknown
batch, 409 a state change the batch's lifecycle refuses or a reused batch id, 422 bad input): the
router raises rollfleet errors and the app maps them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from rollfleet.coordinator.api import (
    AbortBatch,
    FinalizeBatch,
    PolicyVersion,
    ProcessExperiences,
    SubmitBatch,
)
from rollfleet.coordinator.coordinator import RolloutCoordinator
from rollfleet.coordinator.experiences import ExperienceStats
from rollfleet.coordinator.state import AbortResult, BatchInfo, FinalizeResult


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
