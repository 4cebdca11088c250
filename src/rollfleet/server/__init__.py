"""The control plane's HTTP service."""

from rollfleet.server.app import create_app, store_router

__all__ = ["create_app", "store_router"]
