"""Attempt capabilities: a key that lets an agent's ``ctx.llm`` call the gateway for one rollout
attempt, and nothing else.

An agent used to call the gateway with the operator's token, and the rollout it wrote to came from
headers nobody checked: with ``ctx.llm``'s key an agent could record LLM steps with chosen token
ids and logprobs into another rollout (its training rows), abort that rollout's calls, push
weights and read any stored image. Now the runner, which holds the operator token, mints each
attempt a capability: ``rfcap1.<payload>.<mac>``, where the payload names the rollout, the
attempt and an expiry, and the MAC is an HMAC-SHA256 under a key derived from the operator token.
The gateway checks it without a lookup (one HMAC, a few microseconds), records the call to that
attempt only, and keeps every other route (weights, abort, replicas, the store) for the token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from starlette.requests import Request

from rollfleet.errors import Forbidden, Unauthorized
from rollfleet.web.serving import bearer_check, token_matches

PREFIX = "rfcap1."
BEARER = "Bearer "
MAX_CAPABILITY = 4096  # bytes of a presented capability: ids are bounded, so is the key
MAX_TTL_S = 7 * 24 * 3600.0
DEFAULT_TTL_S = 24 * 3600.0  # an attempt without a timeout: a day, then the runner's next attempt
MARGIN_S = 300.0  # past an attempt's own timeout, for the calls it makes while it is cut off


def capability_key(token: str) -> bytes:
    """The MAC key derived from the operator ``token`` (a capability never reveals the token)."""
    return hmac.new(token.encode(), b"rollfleet attempt capability v1", hashlib.sha256).digest()


@dataclass(frozen=True)
class Capability:
    """What a verified capability allows: LLM calls recorded to this rollout attempt."""

    rollout_id: str
    attempt_id: str
    expires: float

    def bind(self, rollout_id: str | None, attempt_id: str | None) -> tuple[str, str]:
        """The ids a call records to: this capability's; :class:`Forbidden` when the call names
        another rollout or attempt (in its path or headers)."""
        if rollout_id not in (None, self.rollout_id) or attempt_id not in (None, self.attempt_id):
            raise Forbidden(
                f"this key records to rollout {self.rollout_id!r} attempt {self.attempt_id!r}"
                f" only, not rollout {rollout_id!r} attempt {attempt_id!r}"
            )
        return self.rollout_id, self.attempt_id


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, payload: str) -> str:
    return _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())


def mint(
    token: str,
    rollout_id: str,
    attempt_id: str,
    ttl_s: float | None = None,
    now: float | None = None,
) -> str:
    """A capability for one attempt, valid ``ttl_s`` seconds (a day without one, at most a week)."""
    ttl = min(DEFAULT_TTL_S if ttl_s is None else ttl_s, MAX_TTL_S)
    expires = int((time.time() if now is None else now) + ttl)
    payload = _b64(orjson.dumps({"r": rollout_id, "a": attempt_id, "e": expires}))
    return f"{PREFIX}{payload}.{_mac(capability_key(token), payload)}"


def attempt_ttl(timeout_s: float | None) -> float:
    """How long an attempt's capability lives: its timeout and a margin, or a day."""
    return DEFAULT_TTL_S if timeout_s is None else timeout_s + MARGIN_S


def is_capability(key: str) -> bool:
    """Whether ``key`` (a bearer token as sent) has the form of a capability."""
    return key.startswith(PREFIX)


def verify(key: bytes, presented: str, now: float | None = None) -> Capability:
    """The capability ``presented`` grants; :class:`Unauthorized` when it is malformed, was not
    made with ``key``, or has expired."""
    if len(presented) > MAX_CAPABILITY or not presented.startswith(PREFIX):
        raise Unauthorized("not an attempt capability")
    payload, _, mac = presented[len(PREFIX) :].partition(".")
    if not hmac.compare_digest(mac.encode(), _mac(key, payload).encode()):
        raise Unauthorized("attempt capability: wrong signature")
    try:
        fields = orjson.loads(_unb64(payload))
        granted = Capability(str(fields["r"]), str(fields["a"]), float(fields["e"]))
    except (binascii.Error, ValueError, TypeError, KeyError) as exc:
        raise Unauthorized("attempt capability: malformed") from exc
    if granted.expires < (time.time() if now is None else now):
        raise Unauthorized(f"attempt capability for rollout {granted.rollout_id!r} has expired")
    return granted


def caller_check(
    token: str | None, what: str = ""
) -> Callable[[Request], Awaitable[Capability | None]]:
    """An async check (a FastAPI dependency) for routes an agent calls: the operator ``token``
    (None returned) or a valid attempt capability (returned); :class:`Unauthorized` otherwise.
    Without a token nothing is checked, as :func:`~rollfleet.web.serving.bearer_check` does."""
    key = None if token is None else capability_key(token)
    prefix = f"{what}: " if what else ""

    async def check(request: Request) -> Capability | None:
        authorization = request.headers.get("authorization") or ""
        if key is None:
            return None
        if authorization.startswith(BEARER + PREFIX):
            try:
                return verify(key, authorization[len(BEARER) :])
            except Unauthorized as exc:
                raise Unauthorized(prefix + exc.message) from None
        if not token_matches(authorization, token):
            raise Unauthorized(f"{prefix}missing or wrong bearer token")
        return None

    return check


def operator_check(token: str | None, what: str = "") -> Callable[[Request], Awaitable[None]]:
    """An async check for the operator's routes: the token alone; an attempt capability is
    :class:`Forbidden` by name (it is valid, but not here)."""
    prefix = f"{what}: " if what else ""
    bearer = bearer_check(token, what)

    async def check(request: Request) -> None:
        authorization = request.headers.get("authorization") or ""
        if token is not None and authorization.startswith(BEARER + PREFIX):
            raise Forbidden(f"{prefix}an attempt capability allows model calls only")
        await bearer(request)

    return check
