"""What a run writes: ``trajectories.jsonl`` (one line per rollout) and ``summary.json``, in an
output directory the command claims (:func:`claim_output_dir`)."""

from __future__ import annotations

import contextlib
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollfleet.errors import InvalidInput, failure_kind
from rollfleet.model import Rollout, RolloutStatus, Step
from rollfleet.stats import pass_at_k, percentile


def latency(rollout: Rollout) -> float | None:
    """Seconds from the final attempt's start to the rollout's end."""
    if rollout.attempt is None or rollout.finished_at is None:
        return None
    return max(0.0, rollout.finished_at - rollout.attempt.started_at)


def trajectory(rollout: Rollout, steps: Sequence[Step]) -> dict[str, Any]:
    """One line of trajectories.jsonl."""
    result = rollout.result
    output = result.output if result is not None and isinstance(result.output, dict) else {}
    metrics = result.metrics if result is not None else {}
    return {
        "rollout_id": rollout.rollout_id,
        "mode": rollout.mode,
        "line": rollout.metadata.get("line"),
        "sample": rollout.metadata.get("sample"),
        "status": rollout.status.value,
        "input": rollout.input,
        "answer": output.get("answer"),
        "reward": None if result is None else result.reward,
        "correct": bool(metrics.get("correct", 0.0)),
        "score": output.get("score"),
        "messages": output.get("messages", []),
        "steps": [
            {"sequence": s.sequence, "kind": s.kind, "payload": s.payload, "timestamp": s.timestamp}
            for s in steps
        ],
        "tokens": {
            "prompt": int(metrics.get("prompt_tokens", 0)),
            "completion": int(metrics.get("completion_tokens", 0)),
        },
        "timings": {
            "created_at": rollout.created_at,
            "started_at": rollout.attempt.started_at if rollout.attempt else None,
            "finished_at": rollout.finished_at,
            "latency_s": latency(rollout),
            "llm_s": metrics.get("llm_s"),
        },
        "attempts": rollout.num_attempts,
        "error": rollout.error,
        "failure": failure_kind(rollout.status.value, rollout.error),
    }


def summarize(
    records: Sequence[dict[str, Any]],
    *,
    samples: int,
    wall_s: float,
    ran_now: int,
    completion_tokens_now: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Counts by status and by failure kind, reward mean/std, pass@k, latency p50/p95, tokens/s.

    ``accuracy`` is over the rollouts that were scored: one that failed (above all for the
    infrastructure's reasons, counted in ``failures``) is not a wrong answer.
    """
    rewards = [r["reward"] for r in records if r["reward"] is not None]
    latencies = [
        r["timings"]["latency_s"] for r in records if r["timings"]["latency_s"] is not None
    ]
    scored = [float(r["correct"]) for r in records if r["reward"] is not None]
    by_task: dict[Any, list[bool]] = defaultdict(list)
    for r in records:
        if r["status"] == RolloutStatus.SUCCEEDED.value:
            by_task[r["line"]].append(r["correct"])
    summary: dict[str, Any] = {
        "rollouts": len(records),
        "counts": dict(Counter(r["status"] for r in records)),
        "reward": {
            "mean": statistics.fmean(rewards) if rewards else None,
            "std": statistics.pstdev(rewards) if rewards else None,
            "n": len(rewards),
        },
        "failures": dict(Counter(r["failure"] for r in records if r.get("failure"))),
        "accuracy": statistics.fmean(scored) if scored else None,
        "latency_s": {
            "p50": percentile(latencies, 0.5) if latencies else None,
            "p95": percentile(latencies, 0.95) if latencies else None,
        },
        "tokens": {
            "prompt": sum(r["tokens"]["prompt"] for r in records),
            "completion": sum(r["tokens"]["completion"] for r in records),
        },
        "tokens_per_s": completion_tokens_now / wall_s if wall_s > 0 and ran_now else None,
        "ran_now": ran_now,
        "kept_from_before": len(records) - ran_now,
        "wall_s": wall_s,
        "samples_per_task": samples,
        **(extra or {}),
    }
    if samples > 1 and by_task:
        summary["pass_at_k"] = {
            f"pass@{k}": statistics.fmean(pass_at_k(len(v), sum(v), k) for v in by_task.values())
            for k in sorted({1, samples})
            if all(len(v) >= k for v in by_task.values())
        }
    return summary


def write_outputs(
    out_dir: Path, records: Sequence[dict[str, Any]], summary: dict[str, Any]
) -> None:
    """Write both files (atomically: a killed run never leaves half a file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, default=str) + "\n" for r in records)
    _atomic(out_dir / "trajectories.jsonl", lines)
    _atomic(out_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


OWNER = ".rollfleet-output"  # names the command whose outputs the directory holds


def claim_output_dir(path: Path, command: str) -> None:
    """Create ``path`` for ``command`` (``run``, ``train``), or take it again for the same
    command (a resume); InvalidInput, with nothing written, when it holds files rollfleet did not
    write there, or another command's (an unrelated ``store.db`` would get our tables)."""
    owner = path / OWNER
    if owner.is_file():
        claimed = owner.read_text(encoding="utf-8", errors="replace").strip()
        if claimed != command:
            raise InvalidInput(
                f"--output-dir {path}: holds the outputs of rollfleet {claimed[:40]!r}, not of"
                f" rollfleet {command}; use another directory"
            )
        return
    if path.exists():
        if not path.is_dir():
            raise InvalidInput(f"--output-dir {path}: exists and is not a directory")
        found = sorted(p.name for p in path.iterdir())
        if found and not _written_before(path, found, command):
            raise InvalidInput(
                f"--output-dir {path}: holds {', '.join(found[:3])}"
                f"{' ...' if len(found) > 3 else ''}, which rollfleet did not write; use an empty"
                " or new directory"
            )
    path.mkdir(parents=True, exist_ok=True)
    owner.write_text(command + "\n", encoding="utf-8")


WRITES = {  # what each command writes in its output directory (besides OWNER)
    "run": {"trajectories.jsonl", "summary.json", "experiences"},
    "train": {"metrics.jsonl", "reward.png", "tensorboard", "checkpoints", "experiences", "trl"},
}
STORE = ("store.db", "store.db-wal", "store.db-shm")


def _written_before(path: Path, found: list[str], command: str) -> bool:
    """Whether a directory without OWNER holds only what ``command`` writes, its ``store.db``
    one of rollfleet's (an output directory of a rollfleet from before OWNER: resumed)."""
    if not set(found) <= WRITES.get(command, set()) | set(STORE):
        return False
    return "store.db" not in found or _is_our_store(path / "store.db")


def _is_our_store(db: Path) -> bool:
    """Whether ``db`` is a SQLite file holding rollfleet's ``rollouts`` and ``steps`` tables."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as c:
            names = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.Error:
        return False
    return {"rollouts", "steps"} <= names
