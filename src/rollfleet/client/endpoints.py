"""Several control-plane replicas behind one client: requests go to the current replica, and
one that fails (refused, reset, too slow, 5xx) hands the next request over to the next URL.

Every replica serves the same fleet from one PostgreSQL database, so any of them may answer any
request. What may be sent again after a failure is the caller's decision (``HttpStore._call``):
a request whose connection was refused never reached a server and may always go elsewhere.

:class:`Backoff` is how a client waits out an overloaded server (a 503 over its connection limit,
or every replica failing in a row): exponential, with full jitter, so that thousands of runners
refused at once do not come back at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from rollfleet.client.wire import Client
from rollfleet.errors import InvalidInput


def split_urls(url: str | Sequence[str]) -> list[str]:
    """Control-plane URLs from ``"http://a,http://b"`` or a list, each without a trailing slash."""
    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in u.split(",")]
    urls = [p.strip().rstrip("/") for p in parts if p.strip()]
    if not urls:
        raise InvalidInput("no control-plane URL given")
    for one in urls:
        found = urlsplit(one)
        if found.scheme not in ("http", "https") or not found.hostname:
            raise InvalidInput(f"not an http(s) control-plane URL: {one!r}")
    return urls


def is_http(url: str | Sequence[str]) -> bool:
    """Whether ``url`` (one URL, a comma-separated list, or a list) names control planes."""
    first = url if isinstance(url, str) else (url[0] if url else "")
    return first.strip().startswith(("http://", "https://"))


def backoff_s(
    failures: int,
    base: float = 0.5,
    cap: float = 10.0,
    rng: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait after ``failures`` failures in a row before it (full jitter): uniform in
    ``[0, min(cap, base * 2**failures))``."""
    return rng() * min(cap, base * 2.0 ** min(failures, 32))


class Backoff:
    """Waits for an overloaded server: :meth:`delay` after each failure in a row (0.5 s doubling
    to 10 s, full jitter), and :meth:`reset` after a success."""

    def __init__(
        self, base: float = 0.5, cap: float = 10.0, rng: Callable[[], float] = random.random
    ) -> None:
        self.base, self.cap, self.rng = base, cap, rng
        self.failures = 0

    def delay(self) -> float:
        """The seconds to wait after one more failure in a row."""
        wait = backoff_s(self.failures, self.base, self.cap, self.rng)
        self.failures += 1
        return wait

    def reset(self) -> None:
        """A call succeeded: the next failure waits the least again."""
        self.failures = 0


class Endpoints:
    """The replicas' clients and which one requests go to now."""

    def __init__(self, urls: Sequence[str], headers: dict[str, str]) -> None:
        self.urls = list(urls)
        self._clients = [Client(u, headers) for u in self.urls]
        self._current = 0

    def __len__(self) -> int:
        return len(self._clients)

    def current(self) -> tuple[int, Client]:
        """The index and client of the replica requests go to now."""
        return self._current, self._clients[self._current]

    def failed(self, index: int) -> None:
        """Replica ``index`` failed: the next request goes to the next one (unless moved on)."""
        if index == self._current:
            self._current = (index + 1) % len(self._clients)

    def close(self) -> None:
        """Close every replica's pooled connections."""
        for client in self._clients:
            client.close()
