"""Batch records: the lifecycle and its transition table, the straggler policy, the persisted
``BatchState``, the results it keeps (``FinalizeResult``, ``AbortResult``) and ``BatchInfo``, the
view of a batch callers get.

A batch is persisted in the store's key/value state under ``batch/<batch_id>`` as the JSON of
its ``BatchState`` (:func:`save_batch` writes it); a restarted coordinator rebuilds everything from
those records. Its state changes only through :func:`move_batch`, which follows
``BATCH_TRANSITIONS``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from rollfleet.errors import Conflict, InvalidInput
from rollfleet.model import Record, RolloutConfig, RolloutSpec, RolloutStatus
from rollfleet.store.base import Store

BatchType = Literal["train", "eval"]
STATE_PREFIX = "batch/"


class BatchLifecycleState(str, enum.Enum):
    """Lifecycle states for one submitted batch."""

    PENDING = "pending"
    RUNNING = "running"
    FINALIZING = "finalizing"
    FINALIZED = "finalized"
    ABORTED = "aborted"

    @property
    def done(self) -> bool:
        """True once the batch can never change again."""
        return self in (BatchLifecycleState.FINALIZED, BatchLifecycleState.ABORTED)


_S = BatchLifecycleState
# The one transition table: a batch runs once submitted, is finalized or aborted; nothing after.
# Every other change raises Conflict (HTTP 409).
BATCH_TRANSITIONS: dict[BatchLifecycleState, frozenset[BatchLifecycleState]] = {
    _S.PENDING: frozenset({_S.RUNNING, _S.ABORTED}),  # pending: held by max_staleness
    _S.RUNNING: frozenset({_S.FINALIZING, _S.ABORTED}),
    _S.FINALIZING: frozenset({_S.FINALIZED, _S.ABORTED}),
    _S.FINALIZED: frozenset(),
    _S.ABORTED: frozenset(),
}
_DOING = {
    _S.PENDING: "reset",
    _S.RUNNING: "submitted again",
    _S.FINALIZING: "finalized",
    _S.FINALIZED: "finalized",
    _S.ABORTED: "aborted",
}


class StragglerPolicy(str, enum.Enum):
    """What finalize does with rollouts still running once it stops waiting."""

    CANCEL = "cancel"  # Trinity-RFT's behaviour: cancel them, their unfinished work is lost
    CARRY_OVER = "carry_over"  # keep them running; their results join the next train finalize
    WAIT = "wait"  # wait for every rollout (stragglers left at a timeout are carried over)


def rollout_id_for(batch_id: str, task_index: int, repeat: int) -> str:
    """The deterministic rollout id of one repeat of one task (re-submitting changes nothing)."""
    return f"{batch_id}:{task_index}:{repeat}"


def group_id_for(batch_id: str, task_index: int) -> str:
    """The GRPO group of every repeat of one task."""
    return f"{batch_id}:{task_index}"


def group_of(rollout_id: str) -> str:
    """The group (``batch:task``) a coordinator-made rollout id belongs to."""
    return rollout_id.rsplit(":", 1)[0]


class Carried(BaseModel):
    """A straggler group left running by one train finalize, waiting to join a later one."""

    model_config = ConfigDict(frozen=True)

    group_id: str
    rollout_ids: list[str]
    origin_batch_id: str
    origin_index: int  # finalize_index of the batch that carried it out
    admitted_at: int | None = None  # policy version served when its batch was admitted
    max_staleness: int | None = None  # its batch's bound: it must be consumed within it


class FinalizeResult(Record):
    """What finalizing a batch gives: task and rollout counts, and the aggregated metrics."""

    batch_id: str
    batch_type: BatchType
    finished_task_count: int
    expected_task_count: int
    policy: StragglerPolicy
    rollout_count: int
    rollouts_by_status: dict[RolloutStatus, int]  # every terminal status, zeros included
    carried_in_task_count: int
    carried_out_task_count: int
    # reward/…, metric/<name>/…, latency/…, tokens/…, staleness/…; eval: mean@n, pass@k…
    metrics: dict[str, float]


class AbortResult(FinalizeResult):
    """What aborting a batch gives: the finished results it kept (none unless asked), and why."""

    aborted: Literal[True] = True
    reason: str


# An abort's JSON has every field of a finalize's: try the larger record first
BatchResult = AbortResult | FinalizeResult


class BatchState(BaseModel):
    """Everything tracked for one train or eval batch; this record's JSON is what is persisted."""

    model_config = ConfigDict(validate_assignment=True)

    batch_id: str
    batch_type: BatchType
    expected_task_count: int
    statuses: dict[str, RolloutStatus] = Field(default_factory=dict)
    min_wait_num: int | None = None
    state: BatchLifecycleState = BatchLifecycleState.PENDING  # changed only by move_batch
    final_result: BatchResult | None = Field(default=None, union_mode="left_to_right")
    policy: StragglerPolicy = StragglerPolicy.CARRY_OVER
    repeat_times: int = 1
    created_at: float = 0.0
    finished_at: float | None = None
    reason: str | None = None
    # order among train finalizes (staleness is measured in these)
    finalize_index: int | None = None
    # rollout_id → staleness: what the result used
    included: dict[str, int] = Field(default_factory=dict)
    carried_out: list[str] = Field(default_factory=list)  # groups this finalize left running
    # every straggler group pending after it
    carry_pool: list[Carried] = Field(default_factory=list)
    max_staleness: int | None = None  # train batches: consumed within this many versions
    admitted_at: int | None = None  # policy version served when its rollouts were enqueued
    held: list[RolloutSpec] = Field(default_factory=list)  # PENDING: waiting for admission

    @property
    def rollout_ids(self) -> list[str]:
        """Every rollout of the batch, task by task."""
        return [
            rollout_id_for(self.batch_id, t, r)
            for t in range(self.expected_task_count)
            for r in range(self.repeat_times)
        ]

    def groups(self) -> dict[str, list[str]]:
        """Rollout ids by task group."""
        out: dict[str, list[str]] = {}
        for rid in self.rollout_ids:
            out.setdefault(group_of(rid), []).append(rid)
        return out

    def task_done(self, group: list[str]) -> bool:
        """True when every repeat of a task is terminal."""
        return all(rid in self.statuses and self.statuses[rid].terminal for rid in group)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def completed_task_count(self) -> int:
        """The number of tasks whose every repeat is terminal."""
        return sum(1 for group in self.groups().values() if self.task_done(group))

    @property
    def wait_target(self) -> int:
        """How many tasks finalize waits for before the grace period starts."""
        return self.expected_task_count if self.min_wait_num is None else self.min_wait_num

    def to_json(self) -> dict[str, Any]:
        """The persisted form."""
        return self.model_dump(mode="json", exclude={"completed_task_count"})

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> BatchState:
        """Rebuild from the persisted form."""
        return cls.model_validate({k: v for k, v in value.items() if k != "completed_task_count"})

    def info(self) -> BatchInfo:
        """The batch as callers see it: a frozen copy, with rollouts counted by status."""
        counts: dict[RolloutStatus, int] = {}
        for status in self.statuses.values():
            counts[status] = counts.get(status, 0) + 1
        fields = self.model_dump(exclude={"statuses", "included", "carry_pool", "held"})
        return BatchInfo(**fields, rollout_statuses=counts)


class BatchInfo(Record):
    """One batch as the API answers it (``GET /batches/{id}``): its settings, state and result."""

    batch_id: str
    batch_type: BatchType
    expected_task_count: int
    min_wait_num: int | None = None
    state: BatchLifecycleState
    final_result: BatchResult | None = Field(default=None, union_mode="left_to_right")
    policy: StragglerPolicy
    repeat_times: int
    created_at: float
    finished_at: float | None = None
    reason: str | None = None
    finalize_index: int | None = None
    carried_out: list[str] = Field(default_factory=list)
    max_staleness: int | None = None
    admitted_at: int | None = None  # None while held back by max_staleness (state pending)
    completed_task_count: int  # tasks whose every repeat is terminal
    rollout_statuses: dict[RolloutStatus, int] = Field(default_factory=dict)


async def save_batch(store: Store, batch: BatchState) -> None:
    """Persist ``batch``'s record (under ``batch/<batch_id>``), replacing the one before."""
    await store.put_state(STATE_PREFIX + batch.batch_id, batch.to_json())


def check_batch_transition(batch: BatchState, new: BatchLifecycleState) -> None:
    """Raise Conflict unless the table allows the batch to move to ``new``."""
    old = batch.state
    if new in BATCH_TRANSITIONS[old]:
        return
    if old is _S.ABORTED:
        why = f"was aborted ({batch.reason})"
    else:
        why = "is finalized already" if old is _S.FINALIZED else f"is {old.value}"
    raise Conflict(f"batch {batch.batch_id} {why}: it cannot be {_DOING[new]}")


def move_batch(batch: BatchState, new: BatchLifecycleState) -> None:
    """Change a batch's state, the one way it changes: as the table allows, else Conflict."""
    check_batch_transition(batch, new)
    batch.state = new


def check_submit(
    batch_id: str,
    tasks: Sequence[Any],
    batch_type: str,
    min_wait_num: int | None,
    repeat_times: int,
    policy: StragglerPolicy | str | None,
    default: StragglerPolicy,
) -> StragglerPolicy:
    """Validate a submission; returns the straggler policy to use."""
    if not batch_id:
        raise InvalidInput("submit_batch: batch_id must not be empty")
    if batch_type not in ("train", "eval"):
        raise InvalidInput(
            f"submit_batch: batch_type must be 'train' or 'eval', not {batch_type!r}"
        )
    if not tasks:
        raise InvalidInput("submit_batch: tasks must not be empty")
    if repeat_times < 1:
        raise InvalidInput(f"submit_batch: repeat_times must be at least 1, got {repeat_times}")
    if min_wait_num is not None and not 1 <= min_wait_num <= len(tasks):
        raise InvalidInput(
            f"submit_batch: min_wait_num must be between 1 and {len(tasks)}, got {min_wait_num}"
        )
    try:
        chosen = (
            StragglerPolicy(policy)
            if policy is not None
            else (default if batch_type == "train" else StragglerPolicy.WAIT)
        )
    except ValueError:
        raise InvalidInput(
            f"submit_batch: policy must be one of {[p.value for p in StragglerPolicy]}"
        ) from None
    if batch_type == "eval" and chosen is StragglerPolicy.CARRY_OVER:
        raise InvalidInput(
            "submit_batch: an eval batch cannot carry stragglers over (use 'wait' or 'cancel')"
        )
    return chosen


def rollout_specs(
    batch: BatchState,
    tasks: Sequence[Any],
    mode: str | None,
    config: RolloutConfig | None,
    priority: int,
    version: int | None,
) -> list[RolloutSpec]:
    """One RolloutSpec per task × repeat, with deterministic ids and a group per task."""
    specs = []
    for t, task in enumerate(tasks):
        base = (
            task
            if isinstance(task, RolloutSpec)
            else RolloutSpec(
                input=task, mode=mode, priority=priority, config=config or RolloutConfig()
            )
        )
        for r in range(batch.repeat_times):
            meta = {
                **base.metadata,
                "batch_id": batch.batch_id,
                "task_index": t,
                "repeat": r,
                "batch_type": batch.batch_type,
                "policy_version": version,
            }
            specs.append(
                base.model_copy(
                    update={
                        "rollout_id": rollout_id_for(batch.batch_id, t, r),
                        "batch_id": batch.batch_id,
                        "group_id": group_id_for(batch.batch_id, t),
                        "metadata": meta,
                    }
                )
            )
    return specs
