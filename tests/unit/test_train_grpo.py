"""GRPO's loss: collation of experiences, the model's token logprobs, the clipped surrogate, and
one optimizer step that makes an advantaged answer likelier (a tiny random Llama, on CPU); the
sampling temperature, per-token advantages and the loss options against numbers computed by hand
(stub models whose logits the test sets)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from types import SimpleNamespace

import pytest
from support import experience as row
from support import require

from rollfleet.errors import InvalidInput

HAVE = bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))


@pytest.fixture
def model():  # type: ignore[no-untyped-def]
    require(HAVE, "torch and transformers")
    import torch

    from rollfleet.engines.tiny import tiny_hf_model

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

    batch = collate([row([5, 6, 7, 8, 9], 3, 1.0), row([5, 6, 7, 4], 2, -1.0)])
    got = token_logprobs(model, batch)
    for i, n in enumerate((5, 4)):
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids[i : i + 1, :n]).logits[0]
        # from the batch's first action token (row 1's position 2) on; the prompt's are not computed
        want = [0.0, 0.0] + [
            torch.log_softmax(logits[t - 1], -1)[batch.input_ids[i, t]].item() for t in range(2, n)
        ]
        assert got[i, :n].tolist() == pytest.approx(want, abs=1e-5)


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


# -- the temperature, per-token advantages and the loss options, by hand --------------------

LOG4 = math.log(4.0)


class Fixed:
    """A stub model: the same logits whatever it reads."""

    def __init__(self, logits) -> None:  # type: ignore[no-untyped-def]
        self.logits = logits

    def __call__(self, input_ids, attention_mask, logits_to_keep=0):  # type: ignore[no-untyped-def]
        return SimpleNamespace(logits=self.logits[:, -logits_to_keep:])


def bigram(vocab: int = 4):  # type: ignore[no-untyped-def]
    """A trainable stub: the logits are a table row picked by the token read, all 0 (uniform:
    every token's logprob is -log 4, every entropy log 4)."""
    require(HAVE, "torch")
    import torch

    class Bigram(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))

        def forward(self, input_ids, attention_mask, logits_to_keep=0):  # type: ignore[no-untyped-def]
            return SimpleNamespace(logits=self.table[input_ids][:, -logits_to_keep:])

    return Bigram()


def sample(tokens, advantage, group="g", reward=0.0, **fields):  # type: ignore[no-untyped-def]
    """A row whose first token is the prompt, with on-policy logprobs under :func:`bigram`."""
    base = row(tokens, 1, advantage, logprobs=[-LOG4] * len(tokens))
    rid = f"{group}-{len(tokens)}-{advantage}-{reward}-{sorted(fields)}"
    return dataclasses.replace(base, rollout_id=rid, group_id=group, reward=reward, **fields)


def step(rows, **options):  # type: ignore[no-untyped-def]
    """One grpo_step of :func:`bigram` on ``rows`` (2 rows a micro-batch) with ``options``."""
    import torch

    from rollfleet.train.grpo import LossOptions
    from rollfleet.train.policy import grpo_step

    model = bigram()
    reference = options.pop("reference", None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = grpo_step(
        model, optimizer, rows, micro_batch=2, reference=reference, options=LossOptions(**options)
    )
    return stats, model


def log_softmax_at(values: list[float], temperature: float, k: int) -> float:
    """log softmax(values / temperature)[k], in plain Python."""
    scaled = [v / temperature for v in values]
    return scaled[k] - math.log(sum(math.exp(v) for v in scaled))


def test_token_logprobs_and_entropies_are_taken_at_each_rows_temperature() -> None:
    require(HAVE, "torch")
    import torch

    from rollfleet.train.grpo import collate, token_logprobs

    logits = [[[0.0, 1.0, 2.0], [1.0, -1.0, 0.5], [9.0, 9.0, 9.0]]] * 2
    hot = dataclasses.replace(row([0, 2, 1], 1, 1.0), temperature=0.5)
    greedy = dataclasses.replace(row([0, 2, 1], 1, 1.0), temperature=0.0)  # counts as 1
    batch = collate([hot, greedy])
    assert batch.temperatures.tolist() == [0.5, 1.0]
    model = Fixed(torch.tensor(logits, requires_grad=True))
    got, spread = token_logprobs(model, batch, entropy=True)
    for i, t in enumerate((0.5, 1.0)):
        want = [0.0, log_softmax_at(logits[0][0], t, 2), log_softmax_at(logits[0][1], t, 1)]
        assert got[i].tolist() == pytest.approx(want, abs=1e-6)
        for pos in (0, 1):
            lps = [log_softmax_at(logits[0][pos], t, k) for k in range(3)]
            entropy = -sum(math.exp(lp) * lp for lp in lps)
            assert spread[i, pos + 1].item() == pytest.approx(entropy, abs=1e-6)
    assert got[0, 1].item() == pytest.approx(4.0 - math.log(1 + math.e**2 + math.e**4), abs=1e-6)
    assert not spread.requires_grad
    assert token_logprobs(model, batch, entropy=True, entropy_grad=True)[1].requires_grad


def test_collate_takes_per_token_advantages_and_refuses_the_wrong_number() -> None:
    require(HAVE, "torch")
    from rollfleet.train.grpo import collate

    per_token = dataclasses.replace(row([5, 6, 7, 8], 2, 1.0), token_advantages=[0, 0, 0.5, 2.0])
    batch = collate([per_token, row([5, 9], 1, -1.0)])
    assert batch.advantages.tolist() == [[0.0, 0.0, 0.5, 2.0], [-1.0, -1.0, 0.0, 0.0]]
    with pytest.raises(InvalidInput, match="r1.0 has 2 token advantages for 4 tokens"):
        collate([dataclasses.replace(per_token, token_advantages=[1.0, 2.0])])


def test_per_token_advantages_weigh_each_token() -> None:
    require(HAVE, "torch")
    import torch

    from rollfleet.train.grpo import collate, grpo_loss

    rows = [
        dataclasses.replace(
            row([1, 2, 3, 4], 1, 9.0, logprobs=[0.0, -1.0, -1.0, -1.0]),
            token_advantages=[7.0, 0.5, -2.0, 3.0],
        ),
        row([1, 2], 1, -1.0, logprobs=[0.0, -1.0]),
    ]
    batch = collate(rows)
    new = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, 0.0, 0.0]], requires_grad=True)
    loss, stats = grpo_loss(new, batch)  # on-policy: ratio 1, the loss is -mean A
    loss.backward()
    assert stats.loss == pytest.approx(-(0.5 - 2.0 + 3.0 - 1.0) / 4, abs=1e-6)
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([0.0, -0.5 / 4, 2.0 / 4, -3.0 / 4], abs=1e-6)
    assert new.grad[1].tolist() == pytest.approx([0.0, 1.0 / 4, 0.0, 0.0], abs=1e-6)


def test_kl_coef_adds_k3_to_the_initial_policy_with_its_gradient() -> None:
    require(HAVE, "torch")
    import torch

    from rollfleet.train.grpo import LossOptions, collate, grpo_loss

    batch = collate([row([1, 2, 3], 1, 1.0, logprobs=[0.0, -1.0, -2.0])])
    initial = torch.tensor([[0.0, -1.5, -1.0]])  # log(initial / new): -0.5 then 1.0
    k3 = [math.exp(-0.5) + 0.5 - 1.0, math.exp(1.0) - 1.0 - 1.0]
    new = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    loss, stats = grpo_loss(new, batch, LossOptions(kl_coef=0.1), reference=initial)
    loss.backward()
    assert stats.loss == pytest.approx(-1.0 + 0.1 * (k3[0] + k3[1]) / 2, abs=1e-6)
    assert stats.kl_initial == pytest.approx((k3[0] + k3[1]) / 2, abs=1e-6)
    # d/dnew of -ratio * A is -1; of k3 is 1 - exp(initial - new)
    want = [0.0, (-1.0 + 0.1 * (1 - math.exp(-0.5))) / 2, (-1.0 + 0.1 * (1 - math.e)) / 2]
    assert new.grad is not None and new.grad[0].tolist() == pytest.approx(want, abs=1e-6)
    _, figures = grpo_loss(new, batch, reference=initial)  # kl_coef 0: reported only
    assert figures.loss == pytest.approx(-1.0, abs=1e-6)
    assert figures.kl_initial == stats.kl_initial
    with pytest.raises(InvalidInput, match="kl_coef needs the reference"):
        grpo_loss(new, batch, LossOptions(kl_coef=0.1))


def test_entropy_coef_subtracts_the_entropy_with_its_gradient() -> None:
    require(HAVE, "torch")
    import torch

    from rollfleet.train.grpo import LossOptions, collate, grpo_loss

    batch = collate([row([1, 2, 3], 1, 1.0, logprobs=[0.0, -1.0, -2.0])])
    new = torch.tensor([[0.0, -1.0, -2.0]])
    entropies = torch.tensor([[5.0, 1.2, 0.4]], requires_grad=True)  # token 0 is no action
    loss, stats = grpo_loss(new, batch, LossOptions(entropy_coef=0.05), entropies=entropies)
    loss.backward()
    assert stats.loss == pytest.approx(-1.0 - 0.05 * (1.2 + 0.4) / 2, abs=1e-6)
    assert stats.entropy == pytest.approx(0.8, abs=1e-6)
    assert entropies.grad is not None
    assert entropies.grad[0].tolist() == pytest.approx([0.0, -0.025, -0.025], abs=1e-7)


def test_grpo_step_adds_the_kl_and_entropy_terms_by_their_coefficients() -> None:
    require(HAVE, "torch")
    import torch

    rows = [sample([1, 2, 3], 1.0, reward=1.0), sample([1, 2], -1.0)]  # 2 tokens A=1, 1 A=-1

    def initial(batch):  # type: ignore[no-untyped-def]
        return torch.full(batch.input_ids.shape, -LOG4 - 0.5)  # log(initial / new) = -0.5

    k3 = math.exp(-0.5) + 0.5 - 1.0
    plain, _ = step(rows, reference=initial)
    assert plain is not None and plain.loss == pytest.approx(-1.0 / 3, abs=1e-6)
    assert plain.kl_initial == pytest.approx(k3, abs=1e-6)
    assert plain.entropy == pytest.approx(LOG4, abs=1e-6)
    both, _ = step(rows, reference=initial, kl_coef=0.5, entropy_coef=0.1)
    assert both is not None
    assert both.loss == pytest.approx(-1.0 / 3 + 0.5 * k3 - 0.1 * LOG4, abs=1e-6)
    with pytest.raises(InvalidInput, match="kl_coef needs the reference"):
        step(rows, kl_coef=0.5)


def test_the_kl_figure_off_the_loss_costs_one_reference_pass_in_the_loss_every_row() -> None:
    """Off the loss the initial policy's logprobs are taken for the first micro-batch only (a
    figure); with kl_coef for every micro-batch. Rows go to micro-batches by length."""
    require(HAVE, "torch")
    import torch

    rows = [sample([1] * n, (-1.0) ** n, reward=float(n % 2)) for n in (6, 2, 5, 3)]
    seen: list[int] = []

    def initial(batch):  # type: ignore[no-untyped-def]
        seen.append(batch.input_ids.shape[1])
        return torch.full(batch.input_ids.shape, -LOG4 - 0.5)

    figure, _ = step(rows, reference=initial)
    assert figure is not None and seen == [3]  # the shortest rows (2 and 3 tokens), once
    assert figure.kl_initial == pytest.approx(math.exp(-0.5) + 0.5 - 1.0, abs=1e-6)
    assert figure.padding == pytest.approx(2 / 18)  # [2, 3] padded to 3, [5, 6] to 6
    seen.clear()
    in_loss, _ = step(rows, reference=initial, kl_coef=0.1)
    assert in_loss is not None and seen == [3, 6]
    unsorted = collate_widths([rows[i] for i in (0, 1)], [rows[i] for i in (2, 3)])
    assert unsorted == pytest.approx(6 / 22)  # what the same rows in their given order would pad


def collate_widths(*chunks):  # type: ignore[no-untyped-def]
    """The padding fraction of these micro-batches."""
    from rollfleet.train.grpo import collate, padding_fraction

    return padding_fraction([collate(c) for c in chunks])


def test_dynamic_sampling_drops_uniform_groups_from_the_batch_and_its_denominator() -> None:
    rows = [
        sample([1, 2, 3], 1.0, "g1", reward=1.0),  # 2 action tokens, A = 1
        sample([1, 2], -1.0, "g1", reward=0.0),  # 1, A = -1
        sample([1, 2, 3, 0], 0.0, "g2", reward=0.5),  # 3, g2 all scored 0.5
        sample([1, 2, 3, 1], 0.0, "g2", reward=0.5),  # 3
        sample([1, 3], 0.0, "g3", reward=1.0),  # 1, a group of one
        sample([1, 2, 3], 0.0, "g4", token_advantages=[0.0, 0.5, 2.0]),  # 2, kept: per token
        sample([1, 2], 0.0, "g4"),  # 1, g4 all scored 0
    ]
    every, _ = step(rows)
    assert every is not None and every.action_tokens == 13 and every.rows_dropped == 0
    assert every.loss == pytest.approx(-(2 - 1 + 0.5 + 2.0) / 13, abs=1e-6)
    kept, _ = step(rows, dynamic_sampling=True)
    assert kept is not None and kept.action_tokens == 5 and kept.rows_dropped == 4
    assert kept.loss == pytest.approx(-(2 - 1 + 0.5 + 2.0) / 5, abs=1e-6)


def test_dynamic_sampling_that_leaves_nothing_trains_nothing_and_returns_none() -> None:
    require(HAVE, "torch")
    import torch

    rows = [sample([1, 2, 3], 0.0, "g1", reward=1.0), sample([1, 2], 0.0, "g1", reward=1.0)]
    stats, model = step(rows, dynamic_sampling=True)
    assert stats is None
    assert torch.equal(model.table, torch.zeros(4, 4)) and model.table.grad is None
    assert step(rows)[0] is not None  # without it the same rows train (on advantage 0)


def test_mask_truncated_trains_no_token_of_a_truncated_row() -> None:
    require(HAVE, "torch")
    from rollfleet.train.grpo import collate

    cut = sample([1, 2, 3, 0], -1.0, truncated=True)  # 3 action tokens, A = -1
    rows = [sample([1, 2, 3], 1.0), cut]
    assert collate(rows, mask_truncated=True).action_mask.tolist()[1] == [0.0] * 4
    assert collate(rows).action_tokens == 5
    every, _ = step(rows)
    assert every is not None and every.loss == pytest.approx(-(2 - 3) / 5, abs=1e-6)
    masked, _ = step(rows, mask_truncated=True)
    assert masked is not None and masked.action_tokens == 2
    assert masked.loss == pytest.approx(-1.0, abs=1e-6)
    assert step([cut], mask_truncated=True)[0] is None  # every action token is cut: nothing
    with pytest.raises(InvalidInput, match="no action token to train on"):
        step([sample([1], 1.0)])  # no action token at all is the caller's mistake


def test_loss_options_refuse_impossible_values() -> None:
    require(HAVE, "torch")
    from rollfleet.train.grpo import LossOptions

    assert LossOptions() == LossOptions(eps_low=0.2, eps_high=0.28, kl_coef=0.0)
    with pytest.raises(InvalidInput, match="eps_low must be in"):
        LossOptions(eps_low=1.0)
    with pytest.raises(InvalidInput, match="kl_coef must be a number at least 0, got -1"):
        LossOptions(kl_coef=-1.0)
    with pytest.raises(InvalidInput, match="entropy_coef must be a number at least 0, got nan"):
        LossOptions(entropy_coef=float("nan"))
