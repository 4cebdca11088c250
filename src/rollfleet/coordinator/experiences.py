"""Experiences: finished trajectories as training rows, GRPO advantages, and the Parquet buffer.

A trajectory's LLM calls (steps of kind ``llm`` recorded by the gateway) become token sequences.
Calls whose prompt continues the previous call's prompt + completion (a multi-turn chat) merge into
one sequence: tokens the model generated get ``action_mask`` 1, tokens inserted between turns (tool
output, user messages) get 0. A call that does not continue the sequence starts a new one.

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
from rollfleet.model import Record, Rollout, Step
from rollfleet.store.blobs import image_refs

LLM_STEP = "llm"
GRPO_EPS = 1e-6


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


def sequences_from_steps(steps: Sequence[Step]) -> list[TokenSequence]:
    """Token sequences of a trajectory's LLM calls, merging calls that continue one another."""
    seqs: list[TokenSequence] = []
    for step in steps:
        if step.kind != LLM_STEP:
            continue
        prompt = _ints(step.payload.get("prompt_token_ids"), "prompt_token_ids")
        completion = _ints(step.payload.get("completion_token_ids"), "completion_token_ids")
        if not prompt and not completion:
            continue
        lps = _logprobs(step.payload.get("logprobs"), len(completion))
        cur = seqs[-1] if seqs else None
        if (
            cur is not None
            and prompt[: len(cur.tokens)] == cur.tokens
            and len(prompt) >= len(cur.tokens)
        ):
            gap = prompt[len(cur.tokens) :]
            versions = token_versions(step.payload, len(prompt), len(completion))
            cur.token_versions = (
                None
                if cur.token_versions is None or versions is None
                else cur.token_versions + versions[len(cur.tokens) :]
            )
            cur.tokens += gap + completion
            cur.action_mask += [0] * len(gap) + [1] * len(completion)
            cur.logprobs = (
                None
                if cur.logprobs is None or lps is None
                else cur.logprobs + [0.0] * len(gap) + lps
            )
            cur.completion_tokens += len(completion)
        else:
            cur = TokenSequence(
                tokens=prompt + completion,
                prompt_length=len(prompt),
                action_mask=[0] * len(prompt) + [1] * len(completion),
                logprobs=None if lps is None else [0.0] * len(prompt) + lps,
                policy_version=_version(step.payload.get("weights_version")),
                completion_tokens=len(completion),
                token_versions=token_versions(step.payload, len(prompt), len(completion)),
            )
            seqs.append(cur)
        cur.finish_reason = step.payload.get("finish_reason") or cur.finish_reason
        shown = image_refs(step.payload.get("messages"))  # each call resends the conversation
        cur.images = list(dict.fromkeys([*(cur.images or []), *shown])) or None
    for seq in seqs:  # the oldest policy that wrote any of its tokens
        oldest = _oldest_action(seq.token_versions, seq.action_mask)
        seq.policy_version = seq.policy_version if oldest is None else oldest
    return seqs


def grpo_advantages(
    rewards: Mapping[str, float],
    groups: Mapping[str, str],
    *,
    eps: float = GRPO_EPS,
    std_normalize: bool = True,
) -> dict[str, float]:
    """Group-normalised advantages: ``(r - mean(group)) / (std(group) + eps)``, std with n-1.

    ``rewards`` maps rollout id → reward, ``groups`` rollout id → group id. A group of one gives
    advantage 0 (it carries no signal). ``std_normalize=False`` gives Dr. GRPO's ``r - mean``.
    """
    members: dict[str, list[str]] = {}
    for rid in rewards:
        members.setdefault(groups[rid], []).append(rid)
    out: dict[str, float] = {}
    for ids in members.values():
        rs = [rewards[i] for i in ids]
        if len(rs) < 2:
            out.update({i: 0.0 for i in ids})
            continue
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        for i, r in zip(ids, rs, strict=True):
            out[i] = (r - mean) / (std + eps) if std_normalize else r - mean
    return out


def experiences_for_rollout(
    rollout: Rollout,
    steps: Sequence[Step],
    reward: float,
    advantage: float,
    batch_id: str,
    staleness: int,
) -> list[Experience]:
    """The Experiences of one scored rollout (one without LLM steps gives one token-less row)."""
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
        )
        for i, s in enumerate(sequences_from_steps(steps))
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
