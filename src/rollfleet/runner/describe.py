"""How a rollout's input and an agent's failure are shown: bounded, whatever their size."""

from __future__ import annotations

import reprlib
import traceback
from typing import Any

from rollfleet.errors import describe_failure

INPUT_PREVIEW_CHARS = 200  # events carry this much of a rollout's input, never all of it


def input_preview(value: Any, limit: int = INPUT_PREVIEW_CHARS) -> str:
    """The start of a rollout's input as text, for events: never the whole of a large input."""
    text = value[: limit + 1] if isinstance(value, str) else reprlib_repr(value, limit)
    return text if len(text) <= limit else text[:limit] + "…"


def reprlib_repr(value: Any, limit: int) -> str:
    """``repr`` that stops building strings and containers early (a 200 KiB input costs little)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxdict = r.maxlist = r.maxtuple = r.maxset = 20
    r.maxlevel = 4
    return r.repr(value)


def describe(exc: BaseException) -> str:
    """An agent's exception as the rollout's error: type, message and the last frames, bounded."""
    tail = "".join(traceback.format_exception(exc)[-3:]).strip()
    return describe_failure(exc, f"{type(exc).__name__}: {exc}\n{tail}"[:4000])
