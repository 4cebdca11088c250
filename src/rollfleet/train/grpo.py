"""GRPO's clipped policy-gradient loss over rollfleet experiences (torch; no trainer state here).

An :class:`~rollfleet.coordinator.experiences.Experience` row holds a token sequence, the mask of
the tokens the policy wrote (``action_mask``), the logprob the engine gave each of them when it
sampled it (the *behaviour* policy, whatever weights version it was, at the row's sampling
``temperature``) and its advantage (one for the row, or one per token). The loss is PPO's clipped
surrogate per action token,

    ratio = exp(logp_new - logp_behaviour)
    loss  = -mean over action tokens of min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
            + kl_coef * k3(policy || initial) - entropy_coef * entropy

so samples written by an older policy (asynchronous mode, ``max_staleness`` >= 1) are corrected
by their importance ratio, and the clip keeps one step from moving far from the policy that
sampled them. ``logp_new`` is taken from the same distribution the engine sampled from: the
logits divided by the row's temperature (greedy rows count as temperature 1). The mean is over
every action token of the batch (not per sequence first), so a long answer weighs as much as its
tokens. The engine's logprobs come from its own kernels and quantization (llama.cpp serves f16
or Q8_0), so even on-policy the ratio is only near 1: the clip absorbs that mismatch, and
:attr:`LossStats.ratio_mean` shows it. :class:`LossOptions` holds the knobs; its defaults are
the plain clipped surrogate above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from rollfleet.coordinator.experiences import Experience
from rollfleet.errors import InvalidInput

MAX_SEQUENCE_TOKENS = 8192  # a row longer than this is refused, never allocated
# Rows of a micro-batch that start alike for at least this many tokens (a group's prompt) have
# that start computed once: its keys and values serve every row, and its gradient is the sum of
# theirs. A shorter common start is not worth a forward pass of its own.
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class LossOptions:
    """The loss's knobs; the defaults are the plain clipped surrogate."""

    eps_low: float = 0.2  # the ratio is clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    kl_coef: float = 0.0  # weight of k3 KL(policy || initial policy) per action token
    entropy_coef: float = 0.0  # weight of the entropy bonus per action token
    dynamic_sampling: bool = False  # rows of groups that all scored alike leave the batch
    mask_truncated: bool = False  # rows cut by max_tokens train no token

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise InvalidInput(
                f"loss: eps_low must be in [0, 1) and eps_high at least 0,"
                f" got {self.eps_low} and {self.eps_high}"
            )
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0.0:
                raise InvalidInput(f"loss: {name} must be a number at least 0, got {value}")


DEFAULT_LOSS = LossOptions()  # today's loss: the clipped surrogate alone


@dataclass(frozen=True)
class TrainBatch:
    """Experiences as right-padded tensors, each ``(rows, tokens)`` but ``temperatures``."""

    input_ids: Any
    attention_mask: Any
    action_mask: Any  # float: 1.0 on tokens the policy wrote, which the loss trains
    old_logprobs: Any  # the behaviour policy's logprob of each token (0 off the action mask)
    advantages: Any  # each token's advantage (the row's on every token unless given per token)
    temperatures: Any  # (rows,): each row's sampling temperature (1.0 for greedy rows)

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
    entropy: float | None = None  # mean entropy of the policy, when its entropies were given
    kl_initial: float | None = None  # mean k3 KL(policy || initial), when reference was given


def sampling_temperature(experience: Experience) -> float:
    """The temperature a row's tokens were drawn at; greedy (0 or less) counts as 1."""
    t = experience.temperature
    if not math.isfinite(t):
        raise InvalidInput(f"collate: {experience.rollout_id} has temperature {t}")
    return t if t > 0 else 1.0


def collate(
    experiences: Sequence[Experience], pad_id: int = 0, *, mask_truncated: bool = False
) -> TrainBatch:
    """Pad experiences into one batch (with ``mask_truncated``, a truncated row trains no token);
    InvalidInput for a row without logprobs, with per-token advantages of another length, or
    too long."""
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
    advantages = torch.zeros((rows, width), dtype=torch.float32)
    for i, e in enumerate(experiences):
        if e.logprobs is None or len(e.logprobs) != len(e.tokens):
            raise InvalidInput(f"collate: {e.rollout_id} has no logprob for every token")
        n = len(e.tokens)
        ids[i, :n] = torch.tensor(e.tokens)
        attention[i, :n] = 1
        if not (mask_truncated and e.truncated):
            action[i, :n] = torch.tensor(e.action_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
        advantages[i, :n] = _token_advantages(e)
    action[:, 0] = 0.0  # nothing predicts the first token
    temperatures = torch.tensor([sampling_temperature(e) for e in experiences])
    return TrainBatch(ids, attention, action, old * action, advantages, temperatures)


def _token_advantages(e: Experience) -> Any:
    """A row's advantage per token: ``token_advantages``, or ``advantage`` on every token."""
    import torch

    if e.token_advantages is None:
        return torch.full((len(e.tokens),), float(e.advantage))
    if len(e.token_advantages) != len(e.tokens):
        raise InvalidInput(
            f"collate: {e.rollout_id} has {len(e.token_advantages)} token advantages"
            f" for {len(e.tokens)} tokens"
        )
    return torch.tensor(e.token_advantages, dtype=torch.float32)


def drop_uniform_groups(experiences: Sequence[Experience]) -> list[Experience]:
    """Dynamic sampling: the rows left once those of groups whose rewards are all equal (no
    signal: every advantage 0) leave, unless a row carries per-token advantages."""
    rewards: dict[str, set[float]] = {}
    for e in experiences:
        rewards.setdefault(e.group_id or e.rollout_id, set()).add(e.reward)
    return [
        e
        for e in experiences
        if e.token_advantages is not None or len(rewards[e.group_id or e.rollout_id]) > 1
    ]


def token_logprobs(
    model: Any, batch: TrainBatch, *, entropy: bool = False, entropy_grad: bool = False
) -> Any:
    """``(rows, tokens)``: the model's logprob of each token given those before it, under its
    logits divided by the row's sampling temperature (0 before the batch's first action token:
    the prompt's logits are never computed); with ``entropy``,
    ``(logprobs, entropies)``: the entropy of each such next-token distribution too (with a
    gradient only under ``entropy_grad``)."""
    import torch

    start = first_action(batch) - 1  # the position whose logits predict the first action token
    width = batch.input_ids.shape[1]
    shared = shared_prompt(batch)
    if not shared:
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            logits_to_keep=width - start,  # the vocabulary head only where a token is trained
        ).logits
    else:  # the rows' common prompt once, its keys and values given to every row
        prompt = model(input_ids=batch.input_ids[:1, :shared], use_cache=True, logits_to_keep=1)
        cache = prompt.cache
        cache.batch_repeat_interleave(batch.input_ids.shape[0])
        logits = model(
            input_ids=batch.input_ids[:, shared:],
            attention_mask=batch.attention_mask,
            cache=cache,
            logits_to_keep=width - start,
        ).logits
    temperatures = batch.temperatures.to(logits.device, torch.float32)[:, None, None]
    logp = torch.log_softmax(logits[:, :-1].float() / temperatures, dim=-1)
    picked = logp.gather(-1, batch.input_ids[:, start + 1 :].unsqueeze(-1)).squeeze(-1)
    picked = torch.nn.functional.pad(picked, (start + 1, 0))
    if not entropy:
        return picked
    grad: AbstractContextManager[Any] = nullcontext() if entropy_grad else torch.no_grad()
    with grad:
        spread = -(logp.exp() * logp).sum(-1)
    return picked, torch.nn.functional.pad(spread, (start + 1, 0))


def shared_prompt(batch: TrainBatch) -> int:
    """How many leading tokens of ``batch`` a forward pass computes once for every row (0: none):
    the tokens every row has alike, up to the position before the first action token (whose
    logits are the first the loss needs), when at least MIN_SHARED_PREFIX."""
    ids = batch.input_ids
    if ids.shape[0] < 2:
        return 0
    alike = (ids == ids[:1]).all(0) & batch.attention_mask.bool().all(0)
    differ = (~alike).nonzero()
    shared = min(int(differ[0].item()) if len(differ) else ids.shape[1], first_action(batch) - 1)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def padding_fraction(chunks: Sequence[TrainBatch]) -> float:
    """The share of the token slots the micro-batches' forward passes computed that were
    padding (a prompt the rows share counts once)."""
    slots = tokens = 0
    for c in chunks:
        rows, width = c.input_ids.shape
        shared = shared_prompt(c)
        slots += shared + rows * (width - shared)
        tokens += shared + int(c.attention_mask.sum()) - rows * shared
    return 1.0 - tokens / slots if slots else 0.0


def first_action(batch: TrainBatch) -> int:
    """The first position any row of ``batch`` trains (1 when none does)."""
    trained = batch.action_mask.sum(0).nonzero()
    return max(1, int(trained[0].item())) if len(trained) else 1


def masked_mean(values: Any, mask: Any) -> float:
    """The mean of ``values`` over the tokens ``mask`` selects (0.0 when it selects none)."""
    return float(((values * mask).sum() / mask.sum().clamp(min=1.0)).item())


def grpo_loss(
    new_logprobs: Any,
    batch: TrainBatch,
    options: LossOptions = DEFAULT_LOSS,
    *,
    reference: Any = None,
    entropies: Any = None,
) -> tuple[Any, LossStats]:
    """The loss (a scalar tensor to backpropagate) and its figures: the clipped surrogate, plus
    ``kl_coef`` times the k3 KL to the ``reference`` logprobs (the initial policy's), minus
    ``entropy_coef`` times the ``entropies``, all per action token."""
    import torch

    mask = batch.action_mask
    count = mask.sum().clamp(min=1.0)
    log_ratio = (new_logprobs - batch.old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    advantage = batch.advantages
    bounded = torch.clamp(ratio, 1.0 - options.eps_low, 1.0 + options.eps_high)
    per_token = -torch.minimum(ratio * advantage, bounded * advantage)
    kl = None
    if reference is not None:
        grad: AbstractContextManager[Any] = nullcontext() if options.kl_coef else torch.no_grad()
        with grad:
            diff = (reference - new_logprobs) * mask
            kl = diff.exp() - diff - 1.0
        if options.kl_coef:
            per_token = per_token + options.kl_coef * kl
    elif options.kl_coef:
        raise InvalidInput("grpo_loss: kl_coef needs the reference policy's logprobs")
    if options.entropy_coef:
        if entropies is None:
            raise InvalidInput("grpo_loss: entropy_coef needs the policy's entropies")
        per_token = per_token - options.entropy_coef * entropies
    loss = (per_token * mask).sum() / count
    with torch.no_grad():
        clipped = ((ratio * advantage) > (bounded * advantage)).float()
        stats = LossStats(
            loss=float(loss.item()),
            ratio_mean=float(((ratio * mask).sum() / count).item()),
            clipped=float(((clipped * mask).sum() / count).item()),
            approx_kl=float((((ratio - 1.0 - log_ratio) * mask).sum() / count).item()),
            entropy=None if entropies is None else masked_mean(entropies.detach(), mask),
            kl_initial=None if kl is None else masked_mean(kl.detach(), mask),
        )
    return loss, stats
