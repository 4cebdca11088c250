"""GRPO's clipped policy-gradient loss over rollfleet experiences (torch; no trainer state here).

An :class:`~rollfleet.coordinator.experiences.Experience` row holds a token sequence, the mask of
the tokens the policy wrote (``action_mask``), the logprob the engine gave each of them when it
sampled it (the *behaviour* policy, whatever weights version it was) and the group-normalised
advantage. The loss is PPO's clipped surrogate per action token,

    ratio = exp(logp_new - logp_behaviour)
    loss  = -mean over action tokens of min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

so samples written by an older policy (asynchronous mode, ``max_staleness`` >= 1) are corrected
by their importance ratio, and the clip keeps one step from moving far from the policy that
sampled them. The mean is over every action token of the batch (not per sequence first), so a
long answer weighs as much as its tokens. The engine's logprobs come from its own kernels and
quantization (llama.cpp serves f16 or Q8_0), so even on-policy the ratio is only near 1: the
clip absorbs that mismatch, and :attr:`LossStats.ratio_mean` shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollfleet.coordinator.experiences import Experience
from rollfleet.errors import InvalidInput

MAX_SEQUENCE_TOKENS = 8192  # a row longer than this is refused, never allocated


@dataclass(frozen=True)
class TrainBatch:
    """Experiences as right-padded tensors, each ``(rows, tokens)`` but ``advantages``."""

    input_ids: Any
    attention_mask: Any
    action_mask: Any  # float: 1.0 on tokens the policy wrote, which the loss trains
    old_logprobs: Any  # the behaviour policy's logprob of each token (0 off the action mask)
    advantages: Any  # (rows,)

    @property
    def action_tokens(self) -> int:
        """How many tokens the loss trains on."""
        return int(self.action_mask.sum().item())


@dataclass(frozen=True)
class LossStats:
    """Figures of one loss computation (per action token)."""

    loss: float
    ratio_mean: float
    clipped: float  # fraction of action tokens whose ratio was clipped
    approx_kl: float  # mean of (ratio - 1) - log ratio: behaviour → current policy


def collate(experiences: Sequence[Experience], pad_id: int = 0) -> TrainBatch:
    """Pad experiences into one batch; InvalidInput for a row without logprobs or too long."""
    import torch

    if not experiences:
        raise InvalidInput("collate: no experiences")
    width = max(len(e.tokens) for e in experiences)
    if width > MAX_SEQUENCE_TOKENS:
        raise InvalidInput(f"collate: a row has {width} tokens, at most {MAX_SEQUENCE_TOKENS}")
    rows = len(experiences)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    action = torch.zeros((rows, width), dtype=torch.float32)
    old = torch.zeros((rows, width), dtype=torch.float32)
    for i, e in enumerate(experiences):
        if e.logprobs is None or len(e.logprobs) != len(e.tokens):
            raise InvalidInput(f"collate: {e.rollout_id} has no logprob for every token")
        n = len(e.tokens)
        ids[i, :n] = torch.tensor(e.tokens)
        attention[i, :n] = 1
        action[i, :n] = torch.tensor(e.action_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    action[:, 0] = 0.0  # nothing predicts the first token
    advantages = torch.tensor([e.advantage for e in experiences], dtype=torch.float32)
    return TrainBatch(ids, attention, action, old * action, advantages)


def token_logprobs(model: Any, batch: TrainBatch, *, entropy: bool = False) -> Any:
    """``(rows, tokens)``: the model's logprob of each token given those before it (0 at 0);
    with ``entropy``, ``(logprobs, entropies)``: the entropy of each next-token distribution too
    (no gradient)."""
    import torch

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    picked = torch.nn.functional.pad(picked, (1, 0))
    if not entropy:
        return picked
    with torch.no_grad():
        spread = -(logp.exp() * logp).sum(-1)
    return picked, torch.nn.functional.pad(spread, (1, 0))


def masked_mean(values: Any, mask: Any) -> float:
    """The mean of ``values`` over the tokens ``mask`` selects (0.0 when it selects none)."""
    return float(((values * mask).sum() / mask.sum().clamp(min=1.0)).item())


def grpo_loss(
    new_logprobs: Any, batch: TrainBatch, eps_low: float = 0.2, eps_high: float = 0.28
) -> tuple[Any, LossStats]:
    """The clipped surrogate loss (a scalar tensor to backpropagate) and its figures."""
    import torch

    mask = batch.action_mask
    count = mask.sum().clamp(min=1.0)
    log_ratio = (new_logprobs - batch.old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    advantage = batch.advantages.unsqueeze(-1)
    bounded = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * advantage, bounded * advantage)
    loss = (per_token * mask).sum() / count
    with torch.no_grad():
        clipped = ((ratio * advantage) > (bounded * advantage)).float()
        stats = LossStats(
            loss=float(loss.item()),
            ratio_mean=float(((ratio * mask).sum() / count).item()),
            clipped=float(((clipped * mask).sum() / count).item()),
            approx_kl=float((((ratio - 1.0 - log_ratio) * mask).sum() / count).item()),
        )
    return loss, stats
