"""Experiences: GRPO advantages by hand, token sequences from gateway steps (no I/O)."""

from __future__ import annotations

import math

import pytest

from rollfleet.coordinator.advantages import group_advantages
from rollfleet.coordinator.experiences import sequences_from_steps
from rollfleet.errors import InvalidInput
from rollfleet.model import Step


def _llm(
    seq: int,
    prompt: list[int],
    completion: list[int],
    logprobs: list[float] | None = None,
    version: int | None = 3,
) -> Step:
    payload = {
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "logprobs": logprobs,
        "finish_reason": "stop",
        "weights_version": version,
    }
    return Step(
        rollout_id="r", attempt_id="a", sequence=seq, kind="llm", payload=payload, timestamp=0.0
    )


def test_grpo_advantages_match_hand_computation() -> None:
    rewards = {"a0": 1.0, "a1": 0.0, "a2": 0.5, "b0": 2.0, "b1": 2.0, "c0": 7.0}
    groups = {"a0": "a", "a1": "a", "a2": "a", "b0": "b", "b1": "b", "c0": "c"}
    adv = group_advantages(rewards, groups)
    # group a: mean 0.5, sample std sqrt(((0.5)^2 + (0.5)^2 + 0) / 2) = 0.5
    assert adv["a0"] == pytest.approx(0.5 / (0.5 + 1e-6))
    assert adv["a1"] == pytest.approx(-0.5 / (0.5 + 1e-6))
    assert adv["a2"] == pytest.approx(0.0)
    assert adv["b0"] == adv["b1"] == 0.0  # equal rewards carry no signal
    assert adv["c0"] == 0.0  # a group of one carries no signal
    dr = group_advantages(rewards, groups, "drgrpo")
    assert dr["a0"] == pytest.approx(0.5) and dr["a1"] == pytest.approx(-0.5)


def test_grpo_advantages_of_a_group_sum_to_zero() -> None:
    rewards = {f"g{i}": r for i, r in enumerate([0.3, 0.9, 0.1, 0.7, 0.2])}
    adv = group_advantages(rewards, {k: "g" for k in rewards})
    assert math.isclose(sum(adv.values()), 0.0, abs_tol=1e-9)


def test_multi_turn_calls_merge_with_action_mask() -> None:
    steps = [
        _llm(1, [1, 2, 3], [4, 5], [-0.1, -0.2]),
        Step(rollout_id="r", attempt_id="a", sequence=2, kind="tool", payload={}, timestamp=0.0),
        _llm(3, [1, 2, 3, 4, 5, 9, 9], [6], [-0.3]),  # continues: 9, 9 is a tool's output
    ]
    (seq,) = sequences_from_steps(steps)
    assert seq.tokens == [1, 2, 3, 4, 5, 9, 9, 6]
    assert seq.prompt_length == 3
    assert seq.action_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert seq.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert seq.completion_tokens == 3 and seq.policy_version == 3 and seq.finish_reason == "stop"


def test_calls_that_do_not_continue_start_new_sequences() -> None:
    seqs = sequences_from_steps(
        [_llm(1, [1, 2], [3], None), _llm(2, [7, 8], [9], [{"logprob": -1.5}])]
    )
    assert [s.tokens for s in seqs] == [[1, 2, 3], [7, 8, 9]]
    assert seqs[0].logprobs is None  # missing logprobs are missing, not zeros
    assert seqs[1].logprobs == [0.0, 0.0, -1.5]


def test_bad_token_ids_are_named() -> None:
    with pytest.raises(InvalidInput, match="prompt_token_ids"):
        sequences_from_steps([_llm(1, ["x"], [1])])  # type: ignore[list-item]


def test_every_token_carries_the_policy_version_that_wrote_it() -> None:
    """A call that new weights interrupted (spans [[0, 3], [2, 4]]) and a later turn at 5: each
    token says which policy wrote it, and the sequence's policy_version is the oldest one."""
    first = _llm(1, [1, 2], [10, 11, 12, 13])
    first.payload["weights_versions"] = [[0, 3], [2, 4]]
    later = _llm(2, [1, 2, 10, 11, 12, 13, 9], [20], version=5)
    (seq,) = sequences_from_steps([first, later])
    assert seq.token_versions == [3, 3, 3, 3, 4, 4, 5, 5]
    assert seq.policy_version == 3
    (solo,) = sequences_from_steps([_llm(1, [1], [2], version=None)])
    assert solo.token_versions is None and solo.policy_version is None


def test_a_sequence_references_the_images_its_prompts_showed_once_each_in_order() -> None:
    from rollfleet.store.blobs import PREFIX

    a, b = "a" * 64, "b" * 64

    def shot(h: str) -> dict:  # type: ignore[type-arg]
        return {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": PREFIX + h}}],
        }

    first, second = (
        _llm(1, [1, 2], [3]),
        _llm(2, [1, 2, 3, 4], [5]),
    )  # the 2nd call continues the 1st
    first.payload["messages"] = [shot(a)]
    second.payload["messages"] = [
        shot(a),
        shot(b),
    ]  # the conversation is resent with a new screenshot
    (seq,) = sequences_from_steps([first, second])
    assert seq.images == [a, b]
    (text_only,) = sequences_from_steps([_llm(1, [1], [2])])
    assert text_only.images is None
