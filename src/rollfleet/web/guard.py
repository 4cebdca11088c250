"""What every rollfleet server refuses before a request reaches the app: one ASGI middleware.

:class:`RequestGuard` sits outermost in the control plane, the gateway and the pool service (ahead
of the control plane's lean hot routes too) and answers, in the API's one error shape:

- **421** ``InvalidInput`` when a request that arrived on a loopback address names a ``Host`` other
  than ``localhost``, ``127.0.0.1``, ``[::1]``, this machine's host name (any port, or none), the
  address itself or one of :attr:`GuardConfig.allowed_hosts`. A page on a rebinding DNS name
  reaches a loopback server with its own name in ``Host``; this stops it reading any answer. The
  rule goes by the address a request arrived on, so it covers every request to a server bound to
  loopback, and a local browser's requests to one bound to all addresses.
- **403** ``Unauthorized`` for a state-changing request (POST, PUT, PATCH, DELETE) that a browser
  sent from another origin: an ``Origin`` other than the server's own (``null`` included), or
  ``Sec-Fetch-Site: cross-site``/``same-site``. Clients that are not browsers send neither.
- **415** ``InvalidInput`` for a state-changing request with a body that is not
  ``application/json``: the content types a page may send another site without asking first
  (``text/plain``, forms) never reach a route. A body-less request may omit the type.
- **413** ``InvalidInput`` for a body over :attr:`GuardConfig.max_body`: from ``Content-Length``
  before a byte of the body is read, or counted as a chunked body streams in.

Every refusal closes the connection (``connection: close``), so an unread body is never drained.
The connection-level limits in :class:`GuardConfig` (head timeout and size, idle keep-alive,
concurrency) are applied by :func:`rollfleet.web.serving.uvicorn_options`.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass, field

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollfleet.errors import InvalidInput
from rollfleet.web.errors import error_body

MiB = 1024 * 1024
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# this machine's own name too: Debian maps it to 127.0.1.1, and no rebinding page can be named so
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", socket.gethostname().lower()})
FOREIGN_FETCH_SITES = frozenset({"cross-site", "same-site"})
_READ = {
    name.encode(): name
    for name in (
        "host",
        "origin",
        "sec-fetch-site",
        "content-type",
        "content-length",
        "transfer-encoding",
    )
}


@dataclass(frozen=True, slots=True)
class BodyRoute:
    """Paths under ``prefix`` take bodies of other types and sizes (a weight push: gigabytes of
    ``application/octet-stream``, streamed, behind the same bearer token)."""

    prefix: str
    max_body: int
    body_types: frozenset[str]


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """What one server accepts from a client: body size and type, Host names, and connections.

    ``max_body``: bytes of one request body. ``body_types``: the media types a state-changing body
    may have. ``allowed_hosts``: ``Host`` names accepted on a loopback address besides the
    loopback names (a reverse proxy's public name). ``header_timeout_s``: seconds a connection has
    to send a whole request head (from connecting, or from the first byte of the next request).
    ``max_head``: bytes of one request head. ``keep_alive_s``: seconds an idle connection is kept
    after an answer. ``limit_concurrency``: open connections and running requests past which
    the server answers 503 at once (``rollfleet serve`` sets it from ``--max-connections`` or
    the open-file limit: :func:`rollfleet.web.serving.connection_limit`).
    """

    max_body: int = 32 * MiB
    body_types: frozenset[str] = field(default=frozenset({"application/json"}))
    allowed_hosts: frozenset[str] = frozenset()
    header_timeout_s: float = 10.0
    max_head: int = 64 * 1024
    keep_alive_s: float = 5.0
    limit_concurrency: int = 2048
    routes: tuple[BodyRoute, ...] = ()

    def for_path(self, path: str) -> tuple[int, frozenset[str]]:
        """The body cap and types for a request to ``path``."""
        for route in self.routes:
            if path.startswith(route.prefix):
                return route.max_body, route.body_types
        return self.max_body, self.body_types


# a weight push (rollfleet.engines.weights.wire): one streamed body, capped there too
WEIGHTS_ROUTE = BodyRoute(
    "/v1/rollfleet/weights/", 256 * 1024 * MiB, frozenset({"application/octet-stream"})
)
GUARD = GuardConfig(routes=(WEIGHTS_ROUTE,))  # the control plane (it may mount the gateway)
# the gateway: larger bodies (long multimodal prompts), weight pushes, and the long keep-alive
# OpenAI clients expect
GATEWAY_GUARD = GuardConfig(max_body=64 * MiB, keep_alive_s=75.0, routes=(WEIGHTS_ROUTE,))


class _BodyTooLarge(InvalidInput):
    """Raised inside the app's ``receive`` once a streamed body passes the cap."""

    status_code = 413


class RequestGuard:
    """ASGI middleware refusing oversized, cross-site and misdirected requests (see the module)."""

    def __init__(self, app: ASGIApp, config: GuardConfig = GUARD) -> None:
        self.app = app
        self.config = config
        self._names = LOOPBACK_NAMES | {name.lower() for name in config.allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a refusal, or pass the request on (counting a chunked body as it streams)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
        elif "transfer-encoding" in headers:
            await self._counted(scope, receive, send)
        else:  # the body is Content-Length bytes, or none (RFC 9112 §6.3): the parser holds it
            await self.app(scope, receive, send)

    def refusal(self, scope: Scope, headers: dict[str, str]) -> Response | None:
        """The answer refusing this request, or ``None`` to serve it."""
        host = headers.get("host")
        if host is not None and _on_loopback(scope) and not self._host_allowed(host, scope):
            return _refuse("InvalidInput", f"Host {host!r} is not this server's name", 421)
        if scope["method"] in STATE_CHANGING:
            if (site := headers.get("sec-fetch-site")) in FOREIGN_FETCH_SITES:
                return _refuse("Unauthorized", f"refused a {site} request from a browser", 403)
            origin = headers.get("origin")
            if origin is not None and not _same_origin(origin, host, scope):
                return _refuse("Unauthorized", f"refused a request from origin {origin!r}", 403)
            max_body, types = self.config.for_path(scope["path"])
            if not self._type_allowed(headers, types):
                kind = headers.get("content-type", "none")
                allowed = ", ".join(sorted(types))
                return _refuse("InvalidInput", f"content type {kind!r}: send {allowed}", 415)
        return self._length_refusal(headers.get("content-length"), scope["path"])

    def _host_allowed(self, host: str, scope: Scope) -> bool:
        name = _host_name(host)
        if name is None:
            return False
        own = _bracketed(str(scope["server"][0]))
        return name in self._names or name == own

    def _type_allowed(self, headers: dict[str, str], types: frozenset[str]) -> bool:
        kind = headers.get("content-type")
        if kind is None:  # only a request without a body may leave its type out
            return "transfer-encoding" not in headers and headers.get("content-length", "0") == "0"
        return kind.split(";", 1)[0].strip().lower() in types

    def _length_refusal(self, length: str | None, path: str) -> Response | None:
        if length is None:
            return None
        if not length.isdigit():
            return _refuse("InvalidInput", f"Content-Length {length!r} is not a number", 400)
        if int(length) > self.config.for_path(path)[0]:
            return self._too_large(path)
        return None

    def _too_large(self, path: str) -> Response:
        cap = self.config.for_path(path)[0]
        return _refuse("InvalidInput", f"request body over {cap} bytes", 413)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app counting body bytes; past the cap, its answer becomes a 413."""
        cap, seen, over, started = self.config.for_path(scope["path"])[0], 0, False, False

        async def counting_receive() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    over = True
                    raise _BodyTooLarge(f"request body over {cap} bytes")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:  # whatever the app answers to a body it could not read is dropped
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._too_large(scope["path"])(scope, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    """The headers the guard reads, by name: the first of a repeated name, except that differing
    ``Content-Length`` values become an unreadable one."""
    found: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = _READ.get(raw_name.lower())
        if name is None:
            continue
        value = raw_value.decode("latin-1").strip()
        if name == "content-length" and found.get(name, value) != value:
            found[name] = "conflicting values"
        else:
            found.setdefault(name, value)
    return found


def _refuse(name: str, message: str, status: int) -> Response:
    """A refusal in the API's error shape that also ends the connection."""
    response = error_body(name, message, status)
    response.headers["connection"] = "close"
    return response


def _on_loopback(scope: Scope) -> bool:
    """Whether the request arrived on a loopback address of this machine."""
    server = scope.get("server")
    return _is_loopback(str(server[0])) if server else False


@functools.lru_cache(maxsize=64)
def _is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP address (an IPv4-mapped one included)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _bracketed(address: str) -> str:
    """An address as a Host header names it: an IPv6 address in brackets."""
    return f"[{address}]" if ":" in address else address


def _split_authority(authority: str) -> tuple[str, str] | None:
    """``(name, port)`` of ``host[:port]`` in lower case (port ``""`` if none); ``None`` if
    malformed."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, sep, rest = authority.partition("]")
        name, port = name + sep, rest.removeprefix(":")
        if not sep or (rest and not rest.startswith(":")):
            return None
    else:
        name, _, port = authority.partition(":")
    if not name or (port and not port.isdigit()) or any(c in name for c in "@/\\?# "):
        return None
    return name, port


def _host_name(host: str) -> str | None:
    """The name part of a ``Host`` header, or ``None`` for a malformed one."""
    parts = _split_authority(host)
    return None if parts is None else parts[0]


def _same_origin(origin: str, host: str | None, scope: Scope) -> bool:
    """Whether ``Origin`` is the server's own: the request's ``Host``, or a loopback name on the
    server's own port."""
    scheme, sep, authority = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or "/" in authority:
        return False
    if host is not None and authority == host.strip().lower():
        return True
    parts = _split_authority(authority)
    server = scope.get("server")
    if parts is None or not server or not _on_loopback(scope):
        return False
    return parts[0] in LOOPBACK_NAMES and parts[1] == str(server[1])
