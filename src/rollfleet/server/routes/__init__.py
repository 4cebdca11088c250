"""The store's HTTP routes, one module per noun; :func:`store_router` mounts them all.

The hot calls (enqueue many, claim, complete many) are declared once, in :mod:`.hot`: the same
records feed :class:`LeanRoutes` and the FastAPI routes that document them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from rollfleet.server.routes import attempts, fleet, resources, rollouts, state, steps, workers
from rollfleet.server.routes.common import as_json, describe
from rollfleet.server.routes.hot import HotRoute, LeanRoutes, add_documenting_route, hot_routes
from rollfleet.store.base import Store

NOUNS = (rollouts, attempts, steps, workers, resources, fleet, state)


def store_router(store: Store, hot: Sequence[HotRoute[Any]] | None = None) -> APIRouter:
    """Routes for every Store operation; ``hot``: the hot calls' records, if already built."""
    r = APIRouter()
    for route in hot if hot is not None else hot_routes(store):
        add_documenting_route(r, route)
    for noun in NOUNS:
        noun.routes(store, r)  # declared flat: FastAPI matches an included router per request
    return r


__all__ = ["HotRoute", "LeanRoutes", "as_json", "describe", "hot_routes", "store_router"]
