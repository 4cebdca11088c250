"""The shared HTTP plumbing: one bearer-token check and one error shape, both ways."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from starlette.requests import Request

from rollfleet.errors import (
    Conflict,
    NotFound,
    PoolError,
    RollfleetError,
    StoreUnavailable,
    Unauthorized,
)
from rollfleet.web.errors import error_from_answer, error_named, error_response
from rollfleet.web.serving import HeadWithBody, bearer_check, check_bind, token_matches


def request_with(authorization: str | None) -> Request:
    """A bare ASGI request carrying an Authorization header (or none)."""
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def test_token_matches_only_the_exact_bearer_token() -> None:
    assert token_matches("Bearer s3cret", "s3cret")
    assert not token_matches("Bearer s3cre", "s3cret")
    assert not token_matches("Bearer s3cretX", "s3cret")
    assert not token_matches("s3cret", "s3cret")
    assert not token_matches(None, "s3cret")
    assert token_matches(None, None)  # no token configured: open


async def test_bearer_check_raises_unauthorized_naming_the_service() -> None:
    check = bearer_check("s3cret", "gateway")
    await check(request_with("Bearer s3cret"))
    with pytest.raises(Unauthorized, match="^gateway: missing or wrong bearer token"):
        await check(request_with("Bearer nope"))
    await bearer_check(None)(request_with(None))


def test_check_bind_refuses_an_open_non_loopback_port() -> None:
    with pytest.raises(StoreUnavailable, match="0.0.0.0"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "t")
    check_bind("::1", None)


@pytest.mark.parametrize(
    "exc", [NotFound("no rollout ro-1"), Conflict("fenced"), PoolError("broken")]
)
def test_an_error_travels_and_comes_back_as_its_class(exc: RollfleetError) -> None:
    response = error_response(exc)
    back = error_from_answer(response.status_code, bytes(response.body))
    assert type(back) is type(exc) and back.message == exc.message
    assert response.status_code == exc.status_code


def test_an_answer_that_is_not_our_shape_becomes_the_default_with_its_status() -> None:
    back = error_from_answer(
        502, b"<html>bad gateway</html>", default=PoolError, where="http://h/pools"
    )
    assert type(back) is PoolError
    assert back.message == "<html>bad gateway</html> (HTTP 502 from http://h/pools)"
    plain = error_from_answer(500, b"oops")
    assert type(plain) is RollfleetError and plain.message == "HTTP 500: oops"
    assert (
        type(error_from_answer(404, orjson.dumps({"error": "NoSuchClass", "message": "m"})))
        is RollfleetError
    )


def test_error_named_falls_back_to_the_default() -> None:
    assert type(error_named("Conflict", "x")) is Conflict
    assert type(error_named(None, "x", PoolError)) is PoolError


class RecordingTransport:
    """What a connection was asked to do, in order: each ``write``'s bytes, ``"close"``."""

    def __init__(self) -> None:
        self.writes: list[bytes | str] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.writes.append("close")

    def is_closing(self) -> bool:
        return "close" in self.writes


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


async def test_a_response_head_goes_out_with_its_body_in_one_write() -> None:
    sent = RecordingTransport()
    transport = HeadWithBody(sent, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    assert sent.writes == []
    transport.write(b"{}")
    transport.write(b"more")  # after the head, straight through
    assert sent.writes == [HEAD + b"{}", b"more"]
    assert not transport.is_closing()  # anything else is the connection's own


async def test_a_head_whose_body_does_not_follow_goes_out_at_the_end_of_the_turn() -> None:
    sent = RecordingTransport()
    transport = HeadWithBody(sent, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    await asyncio.sleep(0)  # one turn of the loop: a streamed body's first chunk comes later
    assert sent.writes == [HEAD]
    transport.write(b"{}")
    assert sent.writes == [HEAD, b"{}"]


async def test_an_informational_head_is_not_held_and_close_sends_what_is_held() -> None:
    sent = RecordingTransport()
    transport = HeadWithBody(sent, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    transport.write(HEAD)
    transport.close()
    assert sent.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", HEAD, "close"]


async def test_a_held_head_is_dropped_when_the_connection_went_meanwhile() -> None:
    sent = RecordingTransport()
    transport = HeadWithBody(sent, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    sent.close()  # the client hung up before the end of the turn
    await asyncio.sleep(0)
    assert sent.writes == ["close"]
