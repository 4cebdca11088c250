"""Which calls become training rows, through a real SQLite store and process_experiences: only
the attempt that completed the rollout (not a lost one, not an aborted call), never a reply the
agent discarded, and per-call rewards on the tokens of the call they name."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.coordinator import RolloutCoordinator, read_experiences
from rollfleet.errors import Conflict
from rollfleet.model import (
    CALL_REWARD_STEP,
    DISCARD_STEP,
    LLM_STEP,
    AttemptStatus,
    RolloutConfig,
    RolloutResult,
    RolloutStatus,
    StepIn,
)
from rollfleet.store import open_sql_store
from rollfleet.testing import FakeClock

pytestmark = pytest.mark.timeout(60)
EOS = 2
PROMPT = [1, 5, 6, 7]
OBSERVATION = [9, 9, 9]  # the template's gap and a tool's output, as the engine tokenized them


def llm(
    request_id: str,
    prompt: list[int],
    completion: list[int],
    finish: str = "stop",
    continues: str | None = None,
) -> StepIn:
    """An LLM call as the gateway records it."""
    return StepIn(
        kind=LLM_STEP,
        payload={
            "request_id": request_id,
            "continues": continues,
            "token_in": None if continues is None else True,
            "messages": [],
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "logprobs": [-0.5] * len(completion),
            "finish_reason": finish,
            "weights_version": 3,
            "sampling": {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 1},
        },
    )


def grpo(rewards: list[float]) -> list[float]:
    """GRPO advantages of one group, by hand: (r - mean) / (sample std + 1e-6)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[Any, FakeClock, RolloutCoordinator]]:
    """A SQLite store on a fake clock and a coordinator on it (no background reaper)."""
    require(importlib.util.find_spec("pyarrow") is not None, "pyarrow (rollfleet[coordinator])")
    clock = FakeClock()
    store = open_sql_store(f"sqlite:///{tmp_path}/rf.db", clock=clock)
    coord = RolloutCoordinator(
        store, experience_dir=tmp_path / "buffer", poll_interval_s=0.05, reap_interval_s=None
    )
    try:
        yield store, clock, coord
    finally:
        await store.close()


async def test_only_the_attempt_that_completed_the_rollout_gives_rows(world) -> None:
    store, clock, coord = world
    await coord.submit_batch(
        "s1", ["q"], repeat_times=2, config=RolloutConfig(heartbeat_s=5, retry_delay_s=0)
    )
    leased = {r.rollout_id: r.attempt.attempt_id for r in await store.claim("w1", max_n=2)}
    lost, other = leased["s1:0:0"], leased["s1:0:1"]
    await store.add_steps(other, [llm("o1", PROMPT, [60, 61, EOS])])
    await store.complete(other, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.0))

    # attempt 1: an aborted call and a finished one, then its runner goes silent
    await store.add_steps(
        lost,
        [
            llm("x1", PROMPT, [70, 71], finish="abort"),
            llm("x2", PROMPT, [72, 73, EOS]),
        ],
    )
    clock.advance(6)  # past its 5 s lease: no heartbeat came
    report = await store.reap()
    assert lost in report.lost and "s1:0:0" in report.requeued
    with pytest.raises(Conflict):  # a late call of the lost attempt is refused
        await store.add_steps(lost, [llm("x3", PROMPT, [74, EOS])])

    # attempt 2: two turns, the second continuing the first token-in, and a reward
    (again,) = await store.claim("w2")
    assert again.rollout_id == "s1:0:0" and again.attempt.sequence == 2
    second = again.attempt.attempt_id
    first_turn = [80, 81, EOS]
    await store.add_steps(
        second,
        [
            llm("y1", PROMPT, first_turn),
            StepIn(kind="tool", payload={"name": "lookup", "output": "code 4821"}),
            llm("y2", PROMPT + first_turn + OBSERVATION, [82, 83, EOS], continues="y1"),
        ],
    )
    done = await store.complete(second, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0))
    assert done.status is RolloutStatus.SUCCEEDED

    await coord.finalize_train_batch("s1")
    stats = await coord.process_experiences("s1")
    assert stats.experience_count == 2 and stats.merge_breaks == 0
    rows = read_experiences(stats.path)
    (row,) = [e for e in rows if e.rollout_id == "s1:0:0"]  # one row: the two turns merged
    assert row.tokens == PROMPT + first_turn + OBSERVATION + [82, 83, EOS]
    assert row.action_mask == [0] * 4 + [1] * 3 + [0] * 3 + [1] * 3
    assert row.prompt_length == len(PROMPT) and row.finish_reason == "stop"
    assert not {70, 71, 72, 73, 74} & {t for e in rows for t in e.tokens}  # nothing of attempt 1
    assert row.reward == 1.0 and row.advantage == pytest.approx(grpo([1.0, 0.0])[0])
    assert row.advantage > 0 and row.token_advantages is None  # no per-call rewards here


async def test_a_discarded_reply_gives_no_row_and_call_rewards_land_on_their_calls(world) -> None:
    store, _, coord = world
    await coord.submit_batch("s2", ["q"], repeat_times=2)
    leased = {r.rollout_id: r.attempt.attempt_id for r in await store.claim("w1", max_n=2)}
    attempt, other = leased["s2:0:0"], leased["s2:0:1"]
    await store.add_steps(other, [llm("o1", PROMPT, [60, EOS])])
    await store.complete(other, AttemptStatus.SUCCEEDED, RolloutResult(reward=0.0))

    reply = [40, 41, EOS]
    await store.add_steps(
        attempt,
        [
            llm("a", PROMPT, [90, 91, EOS]),  # unreadable: the agent asks again
            StepIn(kind=DISCARD_STEP, payload={"request_id": "a", "reason": "no tool call"}),
            llm("b", PROMPT, reply, continues="a"),  # the same question asked again
            StepIn(kind=CALL_REWARD_STEP, payload={"request_id": "b", "turn": 0, "reward": 0.25}),
            StepIn(kind=CALL_REWARD_STEP, payload={"request_id": "a", "turn": 0, "reward": 5.0}),
            llm("c", PROMPT + reply + OBSERVATION, [42, EOS], continues="b"),
        ],
    )
    await store.complete(attempt, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0))

    await coord.finalize_train_batch("s2")
    stats = await coord.process_experiences("s2")
    assert stats.merge_breaks == 0
    rows = read_experiences(stats.path)
    assert not {90, 91} & {t for e in rows for t in e.tokens}  # the discarded reply's tokens
    (row,) = [e for e in rows if e.rollout_id == "s2:0:0"]
    assert row.tokens == PROMPT + reply + OBSERVATION + [42, EOS]
    assert row.action_mask == [0] * 4 + [1] * 3 + [0] * 3 + [1] * 2
    advantage = grpo([1.0, 0.0])[0]
    assert row.advantage == pytest.approx(advantage)
    # b's reward on b's tokens; the discarded a's reward nowhere; the rest the plain advantage
    assert row.token_advantages == pytest.approx(
        [advantage] * 4 + [advantage + 0.25] * 3 + [advantage] * 3 + [advantage] * 2
    )
    (plain,) = [e for e in rows if e.rollout_id == "s2:0:1"]
    assert plain.token_advantages is None and plain.advantage == pytest.approx(-advantage)
