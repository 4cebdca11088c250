"""process_experiences: gateway-recorded steps → Experiences in Parquet files (real store, real pyarrow)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.client import connect
from rollfleet.coordinator import RolloutCoordinator, aggregate, read_experiences
from rollfleet.errors import Conflict
from rollfleet.model import AttemptStatus, RolloutConfig, RolloutResult, RolloutSpec, StepIn


def _llm(prompt: list[int], completion: list[int], version: int) -> StepIn:
    return StepIn(
        kind="llm",
        payload={
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "logprobs": [-0.5] * len(completion),
            "messages": [],
            "finish_reason": "stop",
            "weights_version": version,
        },
    )


class CountingStore:
    """A real store that counts the step reads made through it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("query_steps"):
            self.calls[name] += 1
        return getattr(self.store, name)


async def test_experiences_carry_tokens_masks_and_hand_checked_grpo_advantages(
    tmp_path: Path,
) -> None:
    require(importlib.util.find_spec("pyarrow") is not None, "pyarrow (rollfleet[coordinator])")
    store = connect(f"sqlite:///{tmp_path}/rf.db")
    counted = CountingStore(store)
    try:
        coord = RolloutCoordinator(
            counted, experience_dir=tmp_path / "buffer", poll_interval_s=0.05
        )
        await coord.submit_batch(
            "s1", ["q0", "q1"], repeat_times=3, config=RolloutConfig(max_attempts=1)
        )
        claimed = {
            r.rollout_id: r.attempt.attempt_id
            for r in await store.claim("w", max_n=10)
            if r.attempt
        }
        rewards = {"s1:0:0": 1.0, "s1:0:1": 0.0, "s1:0:2": 0.0, "s1:1:0": 0.5, "s1:1:1": 0.5}
        for i, (rid, reward) in enumerate(rewards.items()):
            steps = [
                _llm([1, 2, 3], [10 + i, 11], 7),
                StepIn(kind="tool", payload={"out": "x"}),
                _llm([1, 2, 3, 10 + i, 11, 42], [12], 7),
            ]
            await store.add_steps(claimed[rid], steps)
            await store.complete(
                claimed[rid], AttemptStatus.SUCCEEDED, RolloutResult(reward=reward)
            )
        await store.complete(claimed["s1:1:2"], AttemptStatus.FAILED, error="agent crashed")

        with pytest.raises(Conflict, match="finalize it before"):
            await coord.process_experiences("s1")
        final = await coord.finalize_train_batch("s1")
        assert final.metrics["tokens/completion_total"] == 15.0  # 3 generated tokens × 5 rollouts
        out = await coord.process_experiences("s1")
        assert out.experience_count == 5 and out.rollout_count == 5 and out.group_count == 2
        assert Path(out.path) == tmp_path / "buffer" / "s1.parquet"

        rows = {e.rollout_id: e for e in read_experiences(tmp_path / "buffer")}
        assert set(rows) == set(rewards)  # the failed rollout has no reward, so no experience
        e = rows["s1:0:1"]
        assert e.tokens == [1, 2, 3, 11, 11, 42, 12] and e.prompt_length == 3
        assert e.action_mask == [0, 0, 0, 1, 1, 0, 1]
        assert e.logprobs == pytest.approx([0.0, 0.0, 0.0, -0.5, -0.5, 0.0, -0.5])
        assert (
            e.policy_version == 7 and e.staleness == 0 and e.group_id == "s1:0" and e.reward == 0.0
        )
        # group s1:0 rewards 1, 0, 0: mean 1/3, sample std sqrt(1/3) → advantages 2/√3·… by hand
        mean, std = 1 / 3, (((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) ** 0.5
        assert rows["s1:0:0"].advantage == pytest.approx((1 - mean) / (std + 1e-6))
        assert rows["s1:0:1"].advantage == pytest.approx((0 - mean) / (std + 1e-6))
        assert (
            rows["s1:1:0"].advantage == rows["s1:1:1"].advantage == 0.0
        )  # the failed one is left out
        again = await coord.process_experiences("s1")
        assert again.experience_count == 5 and len(read_experiences(again.path)) == 5
        # one query for the 5 rollouts' steps in each finalize and each processing, none per rollout
        assert counted.calls == {"query_steps_many": 3}
    finally:
        await store.close()


async def test_rollouts_without_llm_steps_give_tokenless_rows_with_policy_version(
    tmp_path: Path,
) -> None:
    require(importlib.util.find_spec("pyarrow") is not None, "pyarrow (rollfleet[coordinator])")
    store = connect(f"sqlite:///{tmp_path}/rf.db")
    try:
        await store.add_resources({"weights": "v1"})
        await store.add_resources({"weights": "v2"})
        coord = RolloutCoordinator(store, experience_dir=tmp_path / "buffer")
        await coord.submit_batch("s1", ["q"], repeat_times=2)
        for r in await store.claim("w", max_n=2):
            assert r.attempt is not None
            await store.complete(
                r.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
            )
        await coord.finalize_train_batch("s1")
        out = await coord.process_experiences("s1", output_dir=tmp_path / "other")
        assert out.experiences_without_tokens == 2
        rows = read_experiences(out.path)
        assert {e.policy_version for e in rows} == {2} and all(e.tokens == [] for e in rows)
    finally:
        await store.close()


async def test_steps_come_a_rollout_at_a_time_across_pages_and_id_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aggregate, "MAX_STEP_ROLLOUTS", 2)  # 3 rollouts: two queries
    monkeypatch.setattr(aggregate, "STEPS_PAGE", 2)  # 3 steps a rollout: a rollout spans pages
    store = connect(f"sqlite:///{tmp_path}/rf.db")
    try:
        await store.enqueue_many([RolloutSpec(rollout_id=f"r{i}", input=i) for i in range(4)])
        for r in await store.claim("w", max_n=4):
            if r.rollout_id != "r1":  # r1 has no steps
                await store.add_steps(
                    r.attempt.attempt_id, [StepIn(kind="llm", payload={"j": j}) for j in range(3)]
                )
        got = [
            (rid, [st.payload["j"] for st in steps])
            async for rid, steps in aggregate.steps_by_rollout(store, ["r3", "r0", "r1", "r2"])
        ]
        assert got == [("r0", [0, 1, 2]), ("r3", [0, 1, 2]), ("r2", [0, 1, 2])]
    finally:
        await store.close()
