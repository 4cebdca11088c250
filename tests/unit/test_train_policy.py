"""The trainer's Policy and checkpoints on a tiny random Llama (CPU): LoRA steps push only the
merged q/v matrices, the KL to the initial policy starts at 0 and grows, the loss options reach
every step, and a checkpoint restores the trainable weights and optimizer exactly, refusing one
written by other settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support import experience as row
from support import require

from rollfleet.errors import InvalidInput

HAVE = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))


def tiny() -> object:
    """A tiny random Llama, the same every call."""
    import torch

    from rollfleet.engines.tiny import tiny_hf_model

    torch.manual_seed(0)
    return tiny_hf_model(seed=0)[0].train()


def rows() -> list[object]:
    """Two answers to one prompt, one advantaged, with behaviour logprobs of 0 (off-policy)."""
    return [row([5, 6, 7, 8, 9], 2, 1.0), row([5, 6, 11, 12, 13], 2, -1.0)]


def test_lora_steps_push_merged_q_and_v_and_measure_the_kl_to_the_start() -> None:
    require(HAVE, "torch, transformers and peft")
    import torch

    from rollfleet.train.policy import Policy, push_tensors

    policy = Policy(tiny(), lr=1e-2, lora_rank=4)
    before, delta = push_tensors(policy.model)
    assert delta  # only what LoRA changes travels
    assert before and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in before)
    assert all(not n.startswith("base_model") for n in before)  # transformers' names
    first = policy.step(rows())
    assert first.kl_initial == pytest.approx(0.0, abs=1e-6)  # B starts at 0: still the start
    second = policy.step(rows())
    assert second.kl_initial is not None and second.kl_initial > 1e-6 and second.entropy > 0
    after, _ = push_tensors(policy.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_the_policys_loss_options_reach_every_step() -> None:
    """The same two steps with and without kl_coef: the first is the same (no KL at the start,
    nor its gradient), the second's loss differs by exactly kl_coef times the KL; dynamic
    sampling on a group that scored alike trains nothing."""
    require(HAVE, "torch, transformers and peft")
    import dataclasses

    from rollfleet.train.grpo import LossOptions
    from rollfleet.train.policy import Policy

    plain = Policy(tiny(), lr=1e-2, lora_rank=4)
    kl = Policy(tiny(), lr=1e-2, lora_rank=4, loss=LossOptions(kl_coef=0.5))
    first, first_kl = plain.step(rows()), kl.step(rows())
    assert first is not None and first_kl is not None
    assert first_kl.loss == pytest.approx(first.loss, abs=1e-6)
    second, second_kl = plain.step(rows()), kl.step(rows())
    assert second is not None and second_kl is not None and second_kl.kl_initial
    assert second_kl.loss - second.loss == pytest.approx(0.5 * second_kl.kl_initial, abs=1e-6)

    alike = [dataclasses.replace(r, reward=0.0) for r in rows()]  # type: ignore[type-var]
    dynamic = Policy(tiny(), lr=1e-2, lora_rank=4, loss=LossOptions(dynamic_sampling=True))
    assert dynamic.step(alike) is None


def test_a_checkpoint_restores_weights_and_optimizer_and_refuses_other_settings(
    tmp_path: Path,
) -> None:
    require(HAVE, "torch, transformers and peft")
    import torch

    from rollfleet.train import checkpoint
    from rollfleet.train.policy import Policy

    root, settings = tmp_path / "checkpoints", {"lr": 0.01, "data": "a.jsonl"}
    assert checkpoint.find(root, settings) is None  # nothing saved yet
    trained = Policy(tiny(), lr=1e-2, lora_rank=4)
    trained.step(rows())
    checkpoint.save(root, 0, trained.model, trained.optimizer, [{"step": 0}], settings)
    trained.step(rows())
    checkpoint.save(root, 1, trained.model, trained.optimizer, [{"step": 0}, {"step": 1}], settings)
    assert (root / "latest").read_text() == "step-1" and not (root / "step-0").exists()

    fresh = Policy(tiny(), lr=1e-2, lora_rank=4)
    where = checkpoint.find(root, settings)
    assert where is not None
    found = checkpoint.load(where, fresh.model, fresh.optimizer)
    assert found.step == 1 and found.records == [{"step": 0}, {"step": 1}]
    mine = dict(fresh.model.named_parameters())
    for name, value in trained.model.named_parameters():
        assert torch.equal(mine[name], value), name
    # the optimizer goes on exactly where it stopped: the next steps agree
    assert fresh.step(rows()).loss == pytest.approx(trained.step(rows()).loss, abs=1e-6)

    with pytest.raises(InvalidInput, match=r"other settings: lr 0\.01 \(now 0\.02\)"):
        checkpoint.find(root, {**settings, "lr": 0.02})
    # a setting only one side has (a newer run's --agent) differs too, named
    with pytest.raises(InvalidInput, match=r"other settings: agent None \(now 'mine:agent'\)"):
        checkpoint.find(root, {**settings, "agent": "mine:agent"})


def test_a_run_at_the_defaults_of_newer_settings_resumes_an_older_checkpoint() -> None:
    """``--agent`` and ``--model`` came after checkpoints did: at their defaults they are left out
    of the fingerprint (what an older checkpoint holds), set otherwise."""
    from rollfleet.run.train_options import TrainOptions

    plain = TrainOptions(mode="math", data=Path("a.jsonl"), output_dir=Path("out"))
    assert "agent" not in plain.fingerprint() and "model" not in plain.fingerprint()
    custom = TrainOptions(
        mode="math", data=Path("a.jsonl"), output_dir=Path("out"), agent="mine:agent"
    )
    assert custom.fingerprint()["agent"] == "mine:agent"
