"""Reading task files (.jsonl, or .json holding a list): every line checked before anything is
queued.

A line with an ``input`` key is a full rollout spec (``input``, ``mode``, ``rollout_id``,
``priority``, ``config``, ``metadata``…); any other object is itself the task input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollfleet.errors import InvalidInput
from rollfleet.model import RolloutSpec


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (line number, decoded JSON) for every record of a .jsonl or .json file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read: {exc}") from None
    if path.suffix == ".json":
        data = decode_json(text, str(path), whole_file=True)
        if not isinstance(data, list):
            raise InvalidInput(f"{path}: a .json task file must hold a list of objects")
        yield from ((i + 1, item) for i, item in enumerate(data))
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield lineno, decode_json(line, f"{path}:{lineno}")


def decode_json(text: str, where: str, *, whole_file: bool = False) -> Any:
    """``text`` as JSON, or InvalidInput naming ``where`` (file:line; a ``whole_file`` adds the
    line) and the fault: not JSON, nested too deep, an integer too long, NaN or Infinity, a lone
    surrogate."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate cannot
    except json.JSONDecodeError as exc:
        at = f"{where}:{exc.lineno}" if whole_file else where
        raise InvalidInput(f"{at}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise InvalidInput(f"{where}: the JSON is nested too deep") from None
    except UnicodeEncodeError:
        raise InvalidInput(
            f"{where}: a string holds a lone surrogate (not valid Unicode)"
        ) from None
    except ValueError as exc:  # an integer over Python's digit limit, or NaN / Infinity
        raise InvalidInput(f"{where}: {str(exc).split('; ')[0]}") from None
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond a float's range")
    return value


def _field_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"field {where!r}: {err['msg']}"


def read_specs(path: str | Path, mode: str | None = None, **defaults: Any) -> list[RolloutSpec]:
    """Parse and check a whole task file; raise InvalidInput naming file:line and field."""
    path = Path(path)
    specs: list[RolloutSpec] = []
    seen: dict[str, int] = {}
    for lineno, record in read_records(path):
        if not isinstance(record, dict):
            raise InvalidInput(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
            )
        fields = dict(record) if "input" in record else {"input": record}
        if mode is not None:
            fields.setdefault("mode", mode)
        for key, value in defaults.items():
            fields.setdefault(key, value)
        try:
            spec = RolloutSpec.model_validate(fields)
        except ValidationError as exc:
            raise InvalidInput(f"{path}:{lineno}: {_field_error(exc)}") from None
        if spec.rollout_id is not None:
            if spec.rollout_id in seen:
                raise InvalidInput(
                    f"{path}:{lineno}: field 'rollout_id': {spec.rollout_id!r} "
                    f"already used on line {seen[spec.rollout_id]}"
                )
            seen[spec.rollout_id] = lineno
        specs.append(spec)
    if not specs:
        raise InvalidInput(f"{path}: no tasks in the file")
    return specs
