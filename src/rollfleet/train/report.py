"""What a training run writes beside its checkpoints: ``metrics.jsonl`` and ``reward.png``.

``metrics.jsonl`` has one JSON line per record: ``{"kind": "step", ...}`` after each training step
(reward, loss, KL, entropy, staleness, step time split) and ``{"kind": "eval", ...}`` after each
evaluation of a weights version on the eval split (reward and its standard error).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
PLOT = "reward.png"
TENSORBOARD = "tensorboard"


def rewrite(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace ``path`` with these records, one JSON line each, atomically."""
    work = path.with_name(f".{path.name}.tmp")
    work.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(work, path)


def append(path: Path, record: dict[str, Any]) -> None:
    """Add one record line to ``path``."""
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def plot(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Draw train reward per step and eval reward (with its standard error) per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if steps:
        ax.plot(
            [r["step"] + 1 for r in steps],
            [r["reward/mean"] for r in steps],
            ".-",
            alpha=0.6,
            label="train reward (batch mean)",
        )
    if evals:
        ax.errorbar(
            [r["version"] for r in evals],
            [r["reward"] for r in evals],
            yerr=[r["stderr"] for r in evals],
            fmt="o-",
            capsize=3,
            color="C3",
            label="eval reward (greedy, ± s.e.)",
        )
    ax.set_xlabel("training steps done (weights version)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    work = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(work)
    plt.close(fig)
    os.replace(work, path)
    return path


class TensorBoard:
    """Every record's numbers as TensorBoard scalars (``step/…`` at the steps done, ``eval/…`` at
    the weights version), event files in one directory (``--report-to tensorboard``)."""

    def __init__(self, directory: Path) -> None:
        """Open a writer on ``directory`` (the tensorboard package is an optional extra)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def write(self, record: dict[str, Any]) -> None:
        """Add one record's numeric fields and flush them to disk."""
        kind = str(record["kind"])
        at = int(record["step"]) + 1 if kind == "step" else int(record["version"])
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{kind}/{key}", value, at)
        self.writer.flush()

    def close(self) -> None:
        """Close the event file."""
        self.writer.close()
