"""BatchState: ids, groups, counting and the persisted form (no I/O)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

import rollfleet.coordinator
from rollfleet.coordinator.state import (
    BATCH_TRANSITIONS,
    AbortResult,
    BatchLifecycleState,
    BatchState,
    Carried,
    FinalizeResult,
    StragglerPolicy,
    group_of,
    move_batch,
    rollout_id_for,
)
from rollfleet.errors import Conflict
from rollfleet.model import RolloutStatus

S = BatchLifecycleState
LEGAL = sorted((old, new) for old, targets in BATCH_TRANSITIONS.items() for new in targets)


def _result(**extra: object) -> dict[str, object]:
    return {
        "batch_id": "b",
        "batch_type": "eval",
        "finished_task_count": 1,
        "expected_task_count": 1,
        "policy": "wait",
        "rollout_count": 1,
        "rollouts_by_status": {"succeeded": 1, "failed": 0, "cancelled": 0},
        "carried_in_task_count": 0,
        "carried_out_task_count": 0,
        "metrics": {"mean@1": 1.0},
        **extra,
    }


def test_rollout_ids_are_deterministic_and_grouped_by_task() -> None:
    b = BatchState(batch_id="step:7", batch_type="train", expected_task_count=2, repeat_times=2)
    assert b.rollout_ids == ["step:7:0:0", "step:7:0:1", "step:7:1:0", "step:7:1:1"]
    assert b.groups() == {
        "step:7:0": ["step:7:0:0", "step:7:0:1"],
        "step:7:1": ["step:7:1:0", "step:7:1:1"],
    }
    assert group_of(rollout_id_for("a:b", 3, 1)) == "a:b:3"


def test_completed_task_count_needs_every_repeat_terminal() -> None:
    b = BatchState(batch_id="b", batch_type="train", expected_task_count=2, repeat_times=2)
    b.statuses = {
        "b:0:0": RolloutStatus.SUCCEEDED,
        "b:0:1": RolloutStatus.RUNNING,
        "b:1:0": RolloutStatus.FAILED,
        "b:1:1": RolloutStatus.SUCCEEDED,
    }
    assert b.completed_task_count == 1
    b.statuses["b:0:1"] = RolloutStatus.CANCELLED
    assert b.completed_task_count == 2
    assert b.wait_target == 2
    b.min_wait_num = 1
    assert b.wait_target == 1


def test_persisted_form_round_trips() -> None:
    b = BatchState(
        batch_id="b",
        batch_type="eval",
        expected_task_count=1,
        policy=StragglerPolicy.WAIT,
        state=BatchLifecycleState.FINALIZED,
        statuses={"b:0:0": RolloutStatus.SUCCEEDED},
        final_result=FinalizeResult.model_validate(_result()),
        included={"b:0:0": 0},
        carry_pool=[
            Carried(group_id="a:0", rollout_ids=["a:0:0"], origin_batch_id="a", origin_index=2)
        ],
    )
    data = b.to_json()
    assert data["state"] == "finalized" and "completed_task_count" not in data
    again = BatchState.from_json({**data, "completed_task_count": 1})
    assert again == b
    assert again.state.done and not BatchLifecycleState.RUNNING.done


def test_a_persisted_result_comes_back_as_the_record_it_was() -> None:
    base = BatchState(batch_id="b", batch_type="eval", expected_task_count=1)
    finalized = BatchState.from_json({**base.to_json(), "final_result": _result()})
    aborted = BatchState.from_json(
        {**base.to_json(), "final_result": _result(aborted=True, reason="x")}
    )
    assert type(finalized.final_result) is FinalizeResult
    assert isinstance(aborted.final_result, AbortResult) and aborted.final_result.reason == "x"
    assert aborted.to_json()["final_result"] == _result(aborted=True, reason="x")


def test_the_table_has_a_row_for_every_state_and_ends_in_done_states() -> None:
    assert set(BATCH_TRANSITIONS) == set(S)
    assert all(not BATCH_TRANSITIONS[s] for s in S if s.done)
    assert all(BATCH_TRANSITIONS[s] for s in S if not s.done)


@pytest.mark.parametrize("old, new", LEGAL)
def test_every_legal_move_is_made(old: BatchLifecycleState, new: BatchLifecycleState) -> None:
    batch = BatchState(batch_id="b", batch_type="train", expected_task_count=1, state=old)
    move_batch(batch, new)
    assert batch.state is new


@pytest.mark.parametrize("old, new", [p for p in itertools.product(S, S) if p not in LEGAL])
def test_every_other_move_is_a_conflict(old: BatchLifecycleState, new: BatchLifecycleState) -> None:
    batch = BatchState(
        batch_id="b", batch_type="train", expected_task_count=1, state=old, reason="why"
    )
    with pytest.raises(Conflict, match="batch b "):
        move_batch(batch, new)
    assert batch.state is old


def test_refusals_say_why() -> None:
    aborted = BatchState(
        batch_id="b", batch_type="train", expected_task_count=1, state=S.ABORTED, reason="diverged"
    )
    with pytest.raises(Conflict, match=r"batch b was aborted \(diverged\): it cannot be finalized"):
        move_batch(aborted, S.FINALIZED)
    finalized = BatchState(
        batch_id="b", batch_type="train", expected_task_count=1, state=S.FINALIZED
    )
    with pytest.raises(Conflict, match="batch b is finalized already: it cannot be aborted"):
        move_batch(finalized, S.ABORTED)


def test_the_coordinator_changes_batch_states_only_through_the_table() -> None:
    package = Path(rollfleet.coordinator.__file__).parent
    for module in package.glob("*.py"):
        assigned = re.findall(r"\.state(?:, *[\w.]+)* *= *[^=]", module.read_text())
        assert module.name == "state.py" or not assigned, (
            f"{module.name} assigns a batch state by hand"
        )
