"""Reading a run's data file: every task checked for its mode before anything starts; stable ids.

A rollout's id is derived from the data file, the line and the sample number (plus a hash of
the line's content, so an edited line is a new rollout), which is what makes re-running the
same command resume: enqueueing an id that exists is a no-op and finished rollouts are kept.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from rollfleet.envs.tasks import TaskLine
from rollfleet.model import RolloutConfig, RolloutSpec


def _digest(*parts: str, size: int = 10) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:size]


def mode_label(mode: str) -> str:
    """A mode as ids may show it: a file path by its file name (ids hold no ``/``), at most 60
    characters of the id alphabet."""
    return re.sub(r"[^A-Za-z0-9._:@+=-]", "_", mode.rsplit("/", 1)[-1])[:60]


def run_key(path: Path, mode: str) -> str:
    """A short key for (data file, mode): the group id of the run's rollouts (the digest tells
    apart modes whose labels are alike)."""
    return f"run-{mode_label(mode)}-{_digest(str(path.resolve()), mode)}"


def rollout_id(key: str, line: TaskLine, sample: int) -> str:
    """The deterministic id of sample ``sample`` of the task on ``line``."""
    content = _digest(json.dumps(line.task, sort_keys=True), size=6)
    return f"{key}-L{line.lineno}-{content}-k{sample}"


def build_specs(
    tasks: list[TaskLine],
    *,
    path: Path,
    mode: str,
    samples: int,
    settings: dict[str, Any],
    max_attempts: int = 2,
) -> list[RolloutSpec]:
    """One RolloutSpec per (task, sample) with stable ids, all in the run's group."""
    key = run_key(path, mode)
    specs = []
    for line in tasks:
        for k in range(samples):
            specs.append(
                RolloutSpec(
                    input=line.task,
                    mode=mode,
                    rollout_id=rollout_id(key, line, k),
                    group_id=key,
                    config=RolloutConfig(max_attempts=max_attempts),
                    metadata={"run": settings, "data": str(path), "line": line.lineno, "sample": k},
                )
            )
    return specs
