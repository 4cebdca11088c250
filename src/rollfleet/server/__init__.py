"""The control plane's HTTP service."""

from rollfleet.server.app import Hook, create_app
from rollfleet.server.routes import store_router

__all__ = ["Hook", "create_app", "store_router"]
