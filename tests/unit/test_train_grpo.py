"""GRPO's loss: collation of experiences, the model's token logprobs, the clipped surrogate, and
one optimizer step that makes an advantaged answer likelier (a tiny random Llama, on CPU)."""

from __future__ import annotations

import importlib.util

import pytest
from support import experience as row
from support import require

from rollfleet.errors import InvalidInput

HAVE = bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))


@pytest.fixture
def model():  # type: ignore[no-untyped-def]
    require(HAVE, "torch and transformers")
    import torch

    from rollfleet.engines.hf import tiny_hf_model

    torch.manual_seed(0)
    return tiny_hf_model(seed=0)[0].train()


def test_collate_pads_masks_and_refuses_rows_without_logprobs() -> None:
    require(HAVE, "torch")
    from rollfleet.train.grpo import collate

    batch = collate([row([5, 6, 7, 8], 2, 1.0), row([5, 9], 1, -1.0)])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.action_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]] and batch.action_tokens == 3
    with pytest.raises(InvalidInput, match="r2.0 has no logprob for every token"):
        collate([row([1, 2, 3], 1, 2.0, logprobs=[0.0])])
    with pytest.raises(InvalidInput, match="no experiences"):
        collate([])


def test_token_logprobs_are_the_models_next_token_logprobs(model) -> None:
    import torch

    from rollfleet.train.grpo import collate, token_logprobs

    batch = collate([row([5, 6, 7, 8], 2, 1.0)])
    got = token_logprobs(model, batch)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[0]
    want = [0.0] + [
        torch.log_softmax(logits[t - 1], -1)[batch.input_ids[0, t]].item() for t in range(1, 4)
    ]
    assert got[0].tolist() == pytest.approx(want, abs=1e-5)


def test_on_policy_the_loss_is_minus_advantage_and_the_ratio_one(model) -> None:
    import torch

    from rollfleet.train.grpo import collate, grpo_loss, token_logprobs

    base = collate([row([5, 6, 7, 8], 2, 0.5)])
    with torch.no_grad():
        behaviour = token_logprobs(model, base)
    batch = collate([row([5, 6, 7, 8], 2, 0.5, logprobs=behaviour[0].tolist())])
    loss, stats = grpo_loss(token_logprobs(model, batch), batch)
    assert stats.loss == pytest.approx(-0.5, abs=1e-5) and stats.ratio_mean == pytest.approx(
        1.0, abs=1e-5
    )
    assert stats.clipped == 0.0 and stats.approx_kl == pytest.approx(0.0, abs=1e-6)


def test_a_ratio_past_the_clip_gives_no_gradient_in_the_advantages_direction() -> None:
    require(HAVE, "torch")
    import torch

    from rollfleet.train.grpo import collate, grpo_loss

    batch = collate([row([1, 2, 3], 1, 1.0, logprobs=[0.0, -2.0, -2.0])])
    new = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)  # token 1: ratio e (clipped)
    loss, stats = grpo_loss(new, batch)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0, 1].item() == 0.0 and new.grad[0, 2].item() < 0.0
    assert stats.clipped == pytest.approx(0.5)


def test_one_step_makes_the_advantaged_answer_likelier_and_the_other_rarer(model) -> None:
    import torch

    from rollfleet.train.grpo import collate, grpo_loss, token_logprobs

    good, bad = [5, 6, 7, 8, 9], [5, 6, 11, 12, 13]
    with torch.no_grad():
        lp = token_logprobs(model, collate([row(good, 2, 1.0), row(bad, 2, -1.0)]))
    batch = collate([row(good, 2, 1.0, lp[0].tolist()), row(bad, 2, -1.0, lp[1].tolist())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss, _ = grpo_loss(token_logprobs(model, batch), batch)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = token_logprobs(model, batch)
    mask = batch.action_mask
    assert ((after[0] - lp[0]) * mask[0]).sum() > 0 > ((after[1] - lp[1]) * mask[1]).sum()
