"""What every route module shares: records to a JSON response, and validation errors as one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import orjson
from fastapi import Query
from fastapi.responses import Response
from pydantic import BaseModel

from rollfleet.model import adapter

PageLimit = Annotated[int, Query(ge=1, le=1000)]  # ``limit`` of every paged list route


def as_json(value: Any) -> Response:
    """Serialise records, pages, lists of records or plain JSON into a response."""
    if isinstance(value, BaseModel):
        return Response(value.model_dump_json(), media_type="application/json")
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        # one call for the whole list: half the time of one model_dump_json per record
        records = adapter(list[type(value[0])])  # type: ignore[misc]
        return Response(records.dump_json(value), media_type="application/json")
    return Response(orjson.dumps(value), media_type="application/json")


def describe(errors: Sequence[Any]) -> str:
    """The first few validation errors as one line: ``items.0.input: Field required; …``."""
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)
