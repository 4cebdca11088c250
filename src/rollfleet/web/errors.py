"""The one error shape on the wire, both ways: ``{"error": <class name>, "message": …}``.

Servers answer a :class:`~rollfleet.errors.RollfleetError` with :func:`error_response`; clients
turn an answer back into the same class with :func:`error_from_answer` (or :func:`error_named`
when only the name and message travelled, as in a batched completion's outcome).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel
from starlette.responses import JSONResponse

from rollfleet.errors import ERRORS_BY_NAME, RollfleetError


class ErrorBody(BaseModel):
    """Every error answer's body: the error's class name and what went wrong."""

    error: str
    message: str


_MEANINGS = {
    400: "the body is not JSON",
    401: "a missing or wrong bearer token",
    403: "a cross-site request, or an attempt capability used beyond what it allows",
    404: "an id this server does not know",
    409: "an illegal transition, or a write from an attempt that is no longer current",
    413: "a body over the server's cap",
    415: "a body that is not application/json",
    421: "a Host this server does not answer to",
    422: "a malformed request, naming the field",
    503: "the store or a pool cannot serve now",
}
# documented on every route, so that a client (or a fuzzer) knows each answer's shape
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": meaning} for code, meaning in _MEANINGS.items()
}


def error_body(name: str, message: str, status: int) -> JSONResponse:
    """The one error response of the API."""
    return JSONResponse({"error": name, "message": message}, status_code=status)


def error_response(exc: RollfleetError, status: int | None = None) -> JSONResponse:
    """The error response for ``exc`` (its class's status unless ``status`` is given)."""
    return error_body(type(exc).__name__, exc.message, status or exc.status_code)


def error_named(
    name: str | None, message: str, default: type[RollfleetError] = RollfleetError
) -> RollfleetError:
    """The rollfleet error called ``name`` (``default`` for a name not known) with ``message``."""
    return ERRORS_BY_NAME.get(name or "", default)(message)


def error_from_answer(
    status: int,
    data: bytes | str | Any,
    *,
    default: type[RollfleetError] = RollfleetError,
    where: str = "",
) -> RollfleetError:
    """The rollfleet error an error answer stands for; ``data`` is its raw body or its parsed JSON.

    An answer that is not our error shape (a proxy's HTML page, a bare 502) becomes ``default``
    naming the status and the first bytes; ``where`` (a URL) is added to the message when given.
    """
    body = data
    if isinstance(data, (bytes, str)):
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError:
            body = None
    suffix = f" (HTTP {status} from {where})" if where else ""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        message = body.get("message", body.get("detail", ""))
        return error_named(body["error"], f"{message}{suffix}", default)
    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    return default(f"HTTP {status}: {text[:200]}{suffix}" if not where else f"{text[:200]}{suffix}")
