"""What a replay found (``rollfleet replay``): each check against the recording, the first
divergence, and short diffs of what differs."""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DIFF_LINES = 14  # of a diff shown under a divergence
SHOWN_CHARS = 160  # of one shown value or diff line


@dataclass
class Check:
    """One comparison of the replay with the recording: where, whether it held, and how not."""

    where: str
    ok: bool
    detail: str
    diff: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The check as one line of output."""
        return f"{'ok' if self.ok else 'DIVERGED'}  {self.where}: {self.detail}"


class Diverged(Exception):
    """The replay differs from the recording (the first difference stops it)."""

    def __init__(self, check: Check) -> None:
        """For the failed ``check``."""
        super().__init__(check.line())
        self.check = check


@dataclass
class ReplayReport:
    """What a replay found: every check in order, what was not checked and why."""

    rollout_id: str
    checks: list[Check] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    calls: int = 0
    observations: int = 0
    reward: float | None = None

    @property
    def divergence(self) -> Check | None:
        """The first check that failed (None when the replay reproduces the recording)."""
        return next((c for c in self.checks if not c.ok), None)

    @property
    def reproduces(self) -> bool:
        """True when every check held."""
        return self.divergence is None

    def verdict(self) -> str:
        """The final line: reproduces, or where it diverges first."""
        first = self.divergence
        if first is not None:
            return f"DIVERGES at {first.where}: {first.detail}"
        tokens = "token ids not checked" if self.not_checked else "token ids byte-identical"
        return (
            f"REPRODUCES {self.rollout_id}: {self.calls} model calls, {self.observations} tool"
            f" observations, reward {self.reward} as recorded; {tokens}"
        )


def short(value: Any) -> str:
    """A value shown in one line, cut at SHOWN_CHARS."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…")


def _lines(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.splitlines() or [""]
    return json.dumps(value, indent=1, ensure_ascii=False, sort_keys=True).splitlines()


def diff(recorded: Any, replayed: Any) -> list[str]:
    """A short unified diff of two values (text, or JSON values as indented JSON)."""
    out = [
        line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + "…"
        for line in difflib.unified_diff(
            _lines(recorded), _lines(replayed), "recorded", "replayed", n=1, lineterm=""
        )
    ]
    if len(out) > DIFF_LINES:
        out = out[:DIFF_LINES] + [f"… ({len(out) - DIFF_LINES} more lines)"]
    return out


def first_difference(recorded: Sequence[Any], replayed: Sequence[Any]) -> int:
    """The index of the first item that differs (the shorter length when one is a prefix)."""
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a != b:
            return i
    return min(len(recorded), len(replayed))
