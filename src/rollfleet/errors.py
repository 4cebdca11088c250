"""Every error rollfleet raises, rooted at :class:`RollfleetError`.

The tree::

    RollfleetError                 anything rollfleet raises on purpose
    ├── InvalidInput               the caller sent something malformed (HTTP 422)
    ├── NotFound                   an id that the store does not know (HTTP 404)
    ├── Conflict                   an illegal transition or a fenced (stale) write (HTTP 409)
    ├── Unauthorized               a missing or wrong bearer token (HTTP 401)
    ├── StoreUnavailable           the store's backend or server cannot be reached
    ├── AgentError                 an agent could not be loaded or has a bad signature
    ├── InfraError                 the environment or infrastructure failed, not the policy
    │   ├── PoolError              a resource pool could not serve a request
    │   │   └── PoolTimeout        acquire() waited longer than its timeout
    │   └── EngineError            an inference engine failed to start, answer or abort
    └── ClusterError               a cluster-layer (Ray) failure
        ├── ClusterTimeout         a wait on a peer outlived its timeout
        ├── ChannelEmpty           Channel.get_nowait on an empty queue (also an asyncio.QueueEmpty)
        └── ChannelFull            Channel.put_nowait on a full channel (also an asyncio.QueueFull)

Backend errors (sqlite3, psycopg, httpx, Ray) are wrapped at the boundary with ``raise … from exc``.
"""

from __future__ import annotations

import asyncio


class RollfleetError(Exception):
    """Root of every error rollfleet raises on purpose."""

    status_code: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(RollfleetError):
    """Raised when a caller sends malformed input; names the file, line or field."""

    status_code = 422


class NotFound(RollfleetError):
    """Raised when an id is not known to the store."""

    status_code = 404


class Conflict(RollfleetError):
    """Raised for an illegal transition or a write from an attempt that is no longer current."""

    status_code = 409


class Unauthorized(RollfleetError):
    """Raised when a request lacks the bearer token the server requires."""

    status_code = 401


class Forbidden(Unauthorized):
    """Raised when a caller's key is valid but does not allow this request (an attempt
    capability used for another rollout, or for an operator's route)."""

    status_code = 403


class StoreUnavailable(RollfleetError):
    """Raised when the store backend or the store server cannot be reached."""

    status_code = 503


class AgentError(RollfleetError):
    """Raised when an agent cannot be imported or does not have the agent signature."""


class InfraError(RollfleetError):
    """Raised when the environment or the infrastructure fails (a sandbox, a VM, an engine).

    An attempt that ends with one is an infrastructure failure: retried like any failure, stored
    with the ``infrastructure:`` prefix, counted apart in summaries and metrics, and never scored
    (a reward of 0 would teach the policy that its answer was wrong).
    """


class PoolError(InfraError):
    """Raised when a resource pool cannot serve a request."""

    status_code = 503


class PoolTimeout(PoolError):
    """Raised when acquiring from a pool takes longer than the given timeout."""

    status_code = 504


class EngineError(InfraError):
    """Raised when an inference engine fails to start, answer or abort."""


class ClusterError(RollfleetError):
    """Raised for failures in the Ray cluster layer."""


class ClusterTimeout(ClusterError):
    """Raised when a wait on a peer worker or channel outlives its timeout."""


class ChannelEmpty(ClusterError, asyncio.QueueEmpty):
    """Raised by Channel.get_nowait when the key's queue is empty."""


class ChannelFull(ClusterError, asyncio.QueueFull):
    """Raised by Channel.put_nowait when the channel holds maxsize items."""


INFRASTRUCTURE = "infrastructure: "  # how a stored attempt error marks an InfraError
_LOST = ("lease expired", "requeued by operator")  # the store's words for a runner that went away


def describe_failure(exc: BaseException, detail: str) -> str:
    """An attempt's stored error: ``detail``, marked when ``exc`` is the infrastructure's."""
    return (INFRASTRUCTURE if isinstance(exc, InfraError) else "") + detail


def failure_kind(status: str, error: str | None) -> str | None:
    """Why a finished rollout did not succeed: ``infrastructure`` (a sandbox, VM or engine
    failed, or its runner went away), ``timeout``, ``agent`` (the agent's own error), or None
    for one that succeeded, was cancelled or has not ended."""
    if status != "failed":
        return None
    text = error or ""
    if text.startswith(INFRASTRUCTURE) or text.startswith(_LOST):
        return "infrastructure"
    if "timeout_s" in text and "exceeded" in text:
        return "timeout"
    return "agent"


ERRORS_BY_NAME: dict[str, type[RollfleetError]] = {
    cls.__name__: cls
    for cls in (
        RollfleetError,
        InvalidInput,
        NotFound,
        Conflict,
        Unauthorized,
        Forbidden,
        StoreUnavailable,
        AgentError,
        InfraError,
        PoolError,
        PoolTimeout,
        EngineError,
        ClusterError,
        ClusterTimeout,
        ChannelEmpty,
        ChannelFull,
    )
}
