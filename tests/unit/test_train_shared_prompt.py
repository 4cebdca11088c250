"""A prompt the rows of a micro-batch share is computed once (a tiny random Llama, on CPU): the
logprobs and the gradient are those of every row computed whole, a step puts the rows of one
prompt side by side, and the padding figure counts the shared prompt once."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from support import experience, require

HAVE = bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))
PROMPT = [7 + i % 50 for i in range(24)]  # longer than MIN_SHARED_PREFIX


def rows() -> list:  # type: ignore[type-arg]
    """Four rows of PROMPT with answers of different lengths (right-padded in a batch)."""
    answers = ([3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14, 15, 16])
    return [experience(PROMPT + a, len(PROMPT), 1.0 - i / 2) for i, a in enumerate(answers)]


def logprobs_and_grads(monkeypatch: pytest.MonkeyPatch, share: bool) -> tuple:  # type: ignore[type-arg]
    """The batch's token logprobs and the gradient of their sum over action tokens, with the
    shared prompt computed once (``share``) or every row computed whole; the input widths of
    the model's forward passes."""

    from rollfleet.engines.tiny import tiny_hf_model
    from rollfleet.train import grpo

    if not share:
        monkeypatch.setattr(grpo, "MIN_SHARED_PREFIX", 10**9)
    model = tiny_hf_model(seed=0)[0].train()
    widths: list[tuple[int, int]] = []
    model.register_forward_pre_hook(
        lambda _, args, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    batch = grpo.collate(rows())
    picked = grpo.token_logprobs(model, batch)
    (picked * batch.action_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return picked.detach(), grads, widths


def test_a_shared_prompt_once_gives_every_rows_logprobs_and_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require(HAVE, "torch and transformers")
    import torch

    whole, whole_grads, whole_widths = logprobs_and_grads(monkeypatch, share=False)
    monkeypatch.undo()
    once, once_grads, once_widths = logprobs_and_grads(monkeypatch, share=True)
    assert whole_widths == [(4, 29)]  # every row whole: 24 prompt tokens + 5, padded
    # the prompt once, up to the token before the first action token, then every row's rest
    assert once_widths == [(1, 23), (4, 6)]
    assert torch.allclose(once, whole, atol=1e-5)
    assert once_grads.keys() == whole_grads.keys() and len(once_grads) > 5
    for name, grad in whole_grads.items():
        assert torch.allclose(once_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_a_batch_with_no_common_prompt_is_computed_whole() -> None:
    require(HAVE, "torch")
    from rollfleet.train.grpo import collate, padding_fraction, shared_prompt

    first, *others = rows()
    other = dataclasses.replace(first, tokens=[99] + first.tokens[1:])
    assert shared_prompt(collate([first, *others])) == 23
    assert shared_prompt(collate([first, other])) == 0  # they differ at the first token
    assert shared_prompt(collate([first])) == 0
    short = experience(PROMPT[:10] + [3, 4], 10, 1.0)  # a common start shorter than 16 tokens
    assert shared_prompt(collate([short, dataclasses.replace(short, rollout_id="r2")])) == 0
    # 4 rows of 29, 26, 27, 28 tokens: 23 shared once, then 4 x 6 slots of which 24 - 10 hold
    # tokens (the rows' 6, 3, 4 and 5 after the shared 23)
    assert padding_fraction([collate(rows())]) == pytest.approx(6 / (23 + 24))


def test_a_step_puts_rows_of_one_prompt_side_by_side_shorter_first() -> None:
    require(HAVE, "torch")
    from rollfleet.train.policy import micro_batch_order

    a = rows()
    b = [
        dataclasses.replace(r, tokens=[1] + r.tokens[1:], rollout_id=f"b{i}")
        for i, r in enumerate(a)
    ]
    alone = [experience([50 + i, 3] + [4] * n, 2, 0.5) for i, n in enumerate((6, 1))]  # prompts
    # no other row has
    ordered = micro_batch_order(
        [a[0], b[1], alone[0], a[2], b[0], alone[1], a[1], b[3], a[3], b[2]]
    )
    lengths = [len(r.tokens) for r in ordered]
    assert ordered[:2] == [alone[1], alone[0]]  # by length alone, before the shared prompts
    assert [r.tokens[0] for r in ordered[2:6]] == [1] * 4  # b's prompt starts with 1, a's with 7
    assert lengths[2:6] == sorted(lengths[2:6]) and lengths[6:] == sorted(lengths[6:])
