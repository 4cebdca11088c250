"""A task file read against a mode: every line checked, each task kept with its line number."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.envs.base import Mode
from rollfleet.errors import InvalidInput
from rollfleet.taskfile import read_records


@dataclass(frozen=True)
class TaskLine:
    """One checked task and where it came from."""

    lineno: int
    task: dict[str, Any]


def load_tasks(path: Path, mode: Mode, limit: int | None = None) -> list[TaskLine]:
    """Every task of ``path`` checked by ``mode``; InvalidInput names file:line and field."""
    if path.suffix not in (".json", ".jsonl"):
        raise InvalidInput(f"{path}: the data file must be .json or .jsonl")
    if not path.is_file():
        raise InvalidInput(f"{path}: no such file")
    tasks = []
    for lineno, record in read_records(path):
        mode.check(record, f"{path}:{lineno}")
        tasks.append(TaskLine(lineno, record))
    if not tasks:
        raise InvalidInput(f"{path}: no tasks in the file")
    return tasks[:limit] if limit else tasks
