"""The cells of README.md's performance table: numbers and medians with their range."""

from __future__ import annotations

from typing import Any


def n(x: float, digits: int = 0) -> str:
    """A number with thousands separators."""
    return f"{x:,.{digits}f}"


def spread(f: dict[str, Any], digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    """A median with its range: ``1.2 [1.0–1.5]`` (values times ``scale``, then ``unit``)."""
    m, lo, hi = (f[k] * scale for k in ("median", "min", "max"))
    return f"{m:,.{digits}f} [{lo:,.{digits}f}–{hi:,.{digits}f}]{unit}"
