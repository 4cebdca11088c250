"""Experiences: finished trajectories as training rows, GRPO advantages, and the Parquet buffer.

A trajectory's LLM calls (steps of kind ``llm`` recorded by the gateway) become token sequences.
Only the calls that earned the reward do (:func:`training_calls`): those of the attempt that
completed the rollout, never an aborted call, never a reply the agent discarded (it says so with a
``discard`` step naming the call). Calls whose prompt continues the previous call's prompt +
completion (a multi-turn chat; the gateway builds them so, token-in) merge into one sequence:
tokens the model generated get ``action_mask`` 1, tokens inserted between turns (the template's
text, tool output, user messages) get 0. A call that does not continue the sequence, or was
sampled at another temperature, starts a new one: a *merge break*, counted.

The buffer is a directory of Parquet files, one per processed batch, written atomically
(temporary file, then rename): any trainer reads them with pyarrow, pandas, polars or datasets.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from rollfleet.errors import InvalidInput, RollfleetError
from rollfleet.model import (
    CALL_REWARD_STEP,
    DISCARD_STEP,
    LLM_STEP,
    RESUME_STEP,
    Record,
    Rollout,
    Step,
)
from rollfleet.store.blobs import image_refs


@dataclass(frozen=True)
class Experience:
    """One training row: a token sequence of one rollout with its reward and advantage."""

    rollout_id: str
    batch_id: str
    group_id: str
    turn: int
    tokens: list[int]
    prompt_length: int
    logprobs: list[float] | None
    action_mask: list[int]
    reward: float
    advantage: float
    policy_version: int | None
    staleness: int
    finish_reason: str | None = None
    token_versions: list[int] | None = None
    images: list[str] | None = None  # sha256 of the images in its prompt, in order (get_blob)
    temperature: float = 1.0  # its calls' sampling temperature: the loss divides logits by it
    truncated: bool = False  # one of its calls was cut by max_tokens
    # per token, when a mode gave per-turn rewards: ``advantage`` plus the reward of the turn
    # that wrote the token (None: ``advantage`` on every token)
    token_advantages: list[float] | None = None


class ExperienceStats(Record):
    """What processing a batch's experiences gives: where they went, counts and their figures.

    In JSON the figures (``advantage/mean``, ``staleness/…``, ``action_tokens/…``) sit beside
    the counts, not under ``metrics``.
    """

    batch_id: str
    path: str
    experience_count: int
    rollout_count: int
    group_count: int
    experiences_without_tokens: int
    merge_breaks: int = 0  # rows beyond the first of a rollout: calls that did not continue
    metrics: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _gather_figures(cls, value: Any) -> Any:
        if isinstance(value, dict) and "metrics" not in value:
            figures = {k: v for k, v in value.items() if "/" in k}
            value = {k: v for k, v in value.items() if k not in figures} | {"metrics": figures}
        return value

    @model_serializer(mode="wrap")
    def _flatten_figures(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        data.update(data.pop("metrics", {}))
        return data


@dataclass
class TokenSequence:
    """A sequence being built from one or more LLM calls."""

    tokens: list[int]
    prompt_length: int
    action_mask: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    policy_version: int | None = None
    completion_tokens: int = field(default=0)
    token_versions: list[int] | None = None
    images: list[str] | None = None
    temperature: float = 1.0
    truncated: bool = False
    calls: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, first, end)


def _ints(value: Any, what: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise InvalidInput(f"llm step: {what} must be a list of integers")
    return list(value)


def _logprobs(value: Any, n: int) -> list[float] | None:
    """Per-token logprobs as floats, from plain numbers or OpenAI-style ``{"logprob": x}`` items."""
    if not isinstance(value, list) or len(value) != n:
        return None
    out = []
    for item in value:
        number = item.get("logprob") if isinstance(item, dict) else item
        if not isinstance(number, (int, float)):
            return None
        out.append(float(number))
    return out


def _version(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def token_versions(payload: Mapping[str, Any], prompt: int, completion: int) -> list[int] | None:
    """The weights version behind each token of one call: each completion token's from the
    call's version spans (several when new weights arrived mid-generation), and prompt tokens
    the version that read them; None when the call did not say."""
    spans = payload.get("weights_versions")
    if not spans:
        version = _version(payload.get("weights_version"))
        spans = None if version is None else [[0, version]]
    try:
        starts = sorted((int(start), int(version)) for start, version in spans or [])
    except (TypeError, ValueError):
        return None
    if not starts:
        return None
    out = [starts[0][1]] * prompt
    at = 0
    for i in range(completion):
        while at + 1 < len(starts) and starts[at + 1][0] <= i:
            at += 1
        out.append(starts[at][1])
    return out


def _oldest_action(versions: list[int] | None, mask: list[int]) -> int | None:
    acted = [v for v, m in zip(versions or [], mask, strict=False) if m]
    return min(acted) if acted else None


def training_calls(steps: Sequence[Step], attempt_id: str | None) -> list[Step]:
    """The LLM calls that earned a rollout's reward: those of ``attempt_id`` (the attempt that
    completed it; None: every attempt's) and those of earlier attempts it took over when it
    resumed (its ``resume`` step names them), not aborted, not discarded by the agent."""
    reused = {
        rid
        for s in steps
        if s.kind == RESUME_STEP and s.attempt_id == attempt_id
        for rid in s.payload.get("reused_calls") or []
    }
    mine = [
        s
        for s in steps
        if attempt_id is None
        or s.attempt_id == attempt_id
        or (s.kind == LLM_STEP and s.payload.get("request_id") in reused)
    ]
    discarded = {s.payload.get("request_id") for s in mine if s.kind == DISCARD_STEP}
    return [
        s
        for s in mine
        if s.kind == LLM_STEP
        and s.payload.get("finish_reason") != "abort"
        and s.payload.get("request_id") not in discarded
    ]


def call_rewards(steps: Sequence[Step], attempt_id: str | None) -> dict[str, float]:
    """Per-call rewards a mode gave (request id → summed reward), of ``attempt_id`` only."""
    out: dict[str, float] = {}
    for s in steps:
        if s.kind == CALL_REWARD_STEP and (attempt_id is None or s.attempt_id == attempt_id):
            rid, reward = s.payload.get("request_id"), s.payload.get("reward")
            if isinstance(rid, str) and isinstance(reward, (int, float)) and math.isfinite(reward):
                out[rid] = out.get(rid, 0.0) + float(reward)
    return out


def _temperature(payload: Mapping[str, Any]) -> float:
    sampling = payload.get("sampling")
    value = sampling.get("temperature") if isinstance(sampling, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else 1.0


def _extends(cur: TokenSequence, prompt: list[int], temperature: float) -> bool:
    return (
        cur.temperature == temperature
        and len(prompt) >= len(cur.tokens)
        and prompt[: len(cur.tokens)] == cur.tokens
    )


def sequences_from_steps(steps: Sequence[Step]) -> list[TokenSequence]:
    """Token sequences of LLM calls in order, merging calls that continue one another (pass
    :func:`training_calls` for the rows of a scored rollout)."""
    seqs: list[TokenSequence] = []
    for step in steps:
        if step.kind != LLM_STEP:
            continue
        prompt = _ints(step.payload.get("prompt_token_ids"), "prompt_token_ids")
        completion = _ints(step.payload.get("completion_token_ids"), "completion_token_ids")
        if not prompt and not completion:
            continue
        lps = _logprobs(step.payload.get("logprobs"), len(completion))
        temperature = _temperature(step.payload)
        cur = seqs[-1] if seqs else None
        if cur is not None and _extends(cur, prompt, temperature):
            gap = prompt[len(cur.tokens) :]
            versions = token_versions(step.payload, len(prompt), len(completion))
            cur.token_versions = (
                None
                if cur.token_versions is None or versions is None
                else cur.token_versions + versions[len(cur.tokens) :]
            )
            cur.tokens += gap
            cur.action_mask += [0] * len(gap) + [1] * len(completion)
            cur.logprobs = (
                None
                if cur.logprobs is None or lps is None
                else cur.logprobs + [0.0] * len(gap) + lps
            )
            cur.completion_tokens += len(completion)
        else:
            cur = TokenSequence(
                tokens=list(prompt),
                prompt_length=len(prompt),
                action_mask=[0] * len(prompt) + [1] * len(completion),
                logprobs=None if lps is None else [0.0] * len(prompt) + lps,
                policy_version=_version(step.payload.get("weights_version")),
                completion_tokens=len(completion),
                token_versions=token_versions(step.payload, len(prompt), len(completion)),
                temperature=temperature,
            )
            seqs.append(cur)
        start = len(cur.tokens)
        cur.tokens += completion
        cur.calls.append((str(step.payload.get("request_id") or ""), start, len(cur.tokens)))
        cur.finish_reason = step.payload.get("finish_reason") or cur.finish_reason
        cur.truncated = cur.truncated or step.payload.get("finish_reason") == "length"
        shown = image_refs(step.payload.get("messages"))  # each call resends the conversation
        cur.images = list(dict.fromkeys([*(cur.images or []), *shown])) or None
    for seq in seqs:  # the oldest policy that wrote any of its tokens
        oldest = _oldest_action(seq.token_versions, seq.action_mask)
        seq.policy_version = seq.policy_version if oldest is None else oldest
    return seqs


def token_advantages(
    seq: TokenSequence, advantage: float, rewards: Mapping[str, float]
) -> list[float] | None:
    """Each token's advantage when a call of ``seq`` got a reward of its own (``advantage``
    plus that reward on the tokens the call wrote); None when none did."""
    if not any(rid in rewards for rid, _, _ in seq.calls):
        return None
    out = [advantage] * len(seq.tokens)
    for rid, start, end in seq.calls:
        for i in range(start, end):
            out[i] = advantage + rewards.get(rid, 0.0)
    return out


def experiences_for_rollout(
    rollout: Rollout,
    steps: Sequence[Step],
    reward: float,
    advantage: float,
    batch_id: str,
    staleness: int,
) -> list[Experience]:
    """The Experiences of one scored rollout: one row per sequence of the calls that earned its
    reward (one without such calls gives one token-less row)."""
    attempt = rollout.attempt.attempt_id if rollout.attempt is not None else None
    rewards = call_rewards(steps, attempt)
    base = Experience(
        rollout_id=rollout.rollout_id,
        batch_id=batch_id,
        group_id=rollout.group_id or "",
        turn=0,
        tokens=[],
        prompt_length=0,
        logprobs=None,
        action_mask=[],
        reward=reward,
        advantage=advantage,
        policy_version=_version(rollout.metadata.get("policy_version")),
        staleness=staleness,
    )
    return [
        dataclasses.replace(
            base,
            turn=i,
            tokens=s.tokens,
            prompt_length=s.prompt_length,
            logprobs=s.logprobs,
            action_mask=s.action_mask,
            finish_reason=s.finish_reason,
            policy_version=base.policy_version if s.policy_version is None else s.policy_version,
            token_versions=s.token_versions,
            images=s.images,
            temperature=s.temperature,
            truncated=s.truncated,
            token_advantages=token_advantages(s, advantage, rewards),
        )
        for i, s in enumerate(sequences_from_steps(training_calls(steps, attempt)))
    ] or [base]


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("rollout_id", pa.string()),
            ("batch_id", pa.string()),
            ("group_id", pa.string()),
            ("turn", pa.int32()),
            ("tokens", pa.list_(pa.int64())),
            ("prompt_length", pa.int32()),
            ("logprobs", pa.list_(pa.float32())),
            ("action_mask", pa.list_(pa.int8())),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            ("policy_version", pa.int64()),
            ("staleness", pa.int32()),
            ("finish_reason", pa.string()),
            ("token_versions", pa.list_(pa.int64())),
            ("images", pa.list_(pa.string())),
            ("temperature", pa.float64()),
            ("truncated", pa.bool_()),
            ("token_advantages", pa.list_(pa.float32())),
        ]
    )


def _import_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise RollfleetError(
            "the experience buffer needs pyarrow: pip install 'rollfleet[coordinator]'"
        ) from exc
    return pq


def buffer_file(directory: str | Path, batch_id: str) -> Path:
    """The Parquet file of one batch inside the buffer directory."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", batch_id)
    return Path(directory) / f"{safe}.parquet"


def write_experiences(
    directory: str | Path, batch_id: str, experiences: Sequence[Experience]
) -> Path:
    """Write a batch's experiences as one Parquet file, atomically; returns its path."""
    pq = _import_pyarrow()
    import pyarrow as pa

    path = buffer_file(directory, batch_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(e) for e in experiences]
    table = pa.Table.from_pylist(rows, schema=_schema())
    tmp = path.with_suffix(f".parquet.tmp{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise RollfleetError(f"cannot write experiences to {path}: {exc}") from exc
    return path


def read_experiences(path: str | Path) -> list[Experience]:
    """Read experiences back from a buffer file (or every file of a buffer directory)."""
    pq = _import_pyarrow()
    target = Path(path)
    files = sorted(target.glob("*.parquet")) if target.is_dir() else [target]
    out: list[Experience] = []
    for file in files:
        try:
            rows = pq.read_table(file).to_pylist()
        except (OSError, ValueError) as exc:
            raise RollfleetError(f"cannot read experiences from {file}: {exc}") from exc
        out.extend(Experience(**row) for row in rows)  # a file made before images has none
    return out
