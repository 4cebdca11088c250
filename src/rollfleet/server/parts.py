"""What a control plane mounts beside the store API: routers under prefixes, start and stop hooks.

The service layer knows only this shape; the composition of a whole ``rollfleet serve`` (batches,
pools, engines) happens above it, in :mod:`rollfleet.compose`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import APIRouter

from rollfleet.server.app import Hook, Middleware
from rollfleet.store.base import Store


@dataclass
class ServerParts:
    """Routers to mount as ``(prefix, router)`` behind the operator's token, routers that check
    their own callers (``checked``: the gateway, which takes attempt capabilities too), hooks run
    as the app starts and stops, and ASGI middleware (inside the request guard) as
    ``(class, options)``."""

    routers: list[tuple[str, APIRouter]] = field(default_factory=list)
    checked: list[tuple[str, APIRouter]] = field(default_factory=list)
    on_startup: list[Hook] = field(default_factory=list)
    on_shutdown: list[Hook] = field(default_factory=list)
    middleware: list[Middleware] = field(default_factory=list)


PartsFactory = Callable[[Store], ServerParts]


def dashboard_only(store: Store) -> ServerParts:
    """A plain control plane's parts: the dashboard, with no pools, engines or batches panels."""
    from rollfleet.server.dashboard import dashboard_router

    return ServerParts(routers=[("", dashboard_router(store, {}))])
