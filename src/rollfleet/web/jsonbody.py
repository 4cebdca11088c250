"""Strict JSON for request bodies: what the store can keep, or a 422 naming what it cannot.

Python's ``json`` (what FastAPI parses bodies with) accepts ``NaN`` and ``Infinity``, lone UTF-16
surrogates, integers of any size and any nesting; the store writes with orjson, which refuses all
of them (or, for NaN, silently writes ``null``). Each became a 500 after the request was accepted,
or a value changed on its way in. A body is checked once, before anything is done with it:

- it parses under orjson (no NaN/Infinity, no number overflowing a double, no lone surrogate);
- it serialises back (nesting within orjson's limit);
- its integers fit 64 bits (signed, or unsigned up to 2**64 - 1: what orjson writes);
- no string holds a NUL character (PostgreSQL's text cannot).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request

from rollfleet.errors import InvalidInput

# only a run of 19 digits can be an integer out of the 64-bit range; finding one is a C-speed
# translate-and-search (a regex scan took ~9 ns a byte: more than parsing the body)
_DIGITS_ONLY = bytes(0x30 if 0x30 <= c <= 0x39 else 0x2E for c in range(256))
_LONG_RUN = b"0" * 19
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _find(value: Any, bad: Callable[[Any], bool], path: str = "") -> str | None:
    """The dotted path of the first value (or key) ``bad`` holds for, or None."""
    if bad(value):
        return path or "(the body)"
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if bad(key):
            return where
        found = _find(item, bad, where)
        if found is not None:
            return found
    return None


def _too_big(value: Any) -> bool:
    return type(value) is int and not _INT_MIN <= value <= _UINT_MAX


def _nul(value: Any) -> bool:
    return isinstance(value, str) and "\x00" in value


def strict_json(body: bytes) -> Any:
    """``body`` parsed, or InvalidInput saying why the store could not keep it (and where)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"body is not valid JSON: {exc}") from None
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise InvalidInput(f"body cannot be stored as JSON: {exc}") from None
    if _LONG_RUN in body.translate(_DIGITS_ONLY):  # orjson read a long integer as a float
        where = _find(json.loads(body), _too_big)
        if where is not None:
            raise InvalidInput(f"body: field {where!r} holds an integer that does not fit 64 bits")
    if b"\\u0000" in body:
        where = _find(value, _nul)
        if where is not None:
            raise InvalidInput(f"body: field {where!r} holds a NUL character (it cannot be stored)")
    return value


async def check_json_body(request: Request) -> None:
    """A FastAPI dependency: a state-changing request's JSON body must be strict JSON (other
    media types reach only the routes the request guard admits them to, which read them)."""
    kind = request.headers.get("content-type", "application/json").split(";", 1)[0].strip()
    if request.method in STATE_CHANGING and kind.lower() == "application/json":
        body = await request.body()
        if body.strip():
            strict_json(body)
