"""``ctx.llm``: an OpenAI async client already pointed at the gateway for one rollout attempt."""

from __future__ import annotations

from typing import Any

import httpx

from rollfleet.engines.gateway.app import ATTEMPT_HEADER, ROLLOUT_HEADER

# No read timeout: a long generation must never be cut by a client default.
LLM_TIMEOUT = httpx.Timeout(connect=30.0, read=None, write=60.0, pool=None)
# Sent when no key is given: OpenAI's client refuses to start without one. Never replaces a key.
NO_KEY = "rollfleet"


def gateway_v1_url(base_url: str) -> str:
    """The gateway's ``…/v1`` URL for a base URL given with or without ``/v1``."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class SharedPool(httpx.AsyncClient):
    """One connection pool for every ``ctx.llm`` of a runner: building an ``AsyncOpenAI`` with
    its own pool costs 22 ms (an SSL context is made even for http), with a shared one 0.2 ms,
    and calls reuse kept-alive connections to the gateway. An agent that closes its
    ``ctx.llm`` (``async with ctx.llm:``) does not close the pool; its owner calls ``shut``."""

    def __init__(self, max_connections: int | None = None) -> None:
        """A pool without a cap on connections (the runner caps its rollouts)."""
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=256)
        super().__init__(timeout=LLM_TIMEOUT, limits=limits)

    async def aclose(self) -> None:
        """Ignored: the pool outlives each rollout's client."""

    async def shut(self) -> None:
        """Close the pool (the runner is done)."""
        await super().aclose()


def llm_client(
    base_url: str, rollout_id: str, attempt_id: str, token: str | None = None, **kwargs: Any
) -> Any:
    """An ``openai.AsyncOpenAI`` for the gateway at ``base_url`` that tags every call.

    Calls carry ``X-Rollfleet-Rollout``/``X-Rollfleet-Attempt`` so the gateway records them
    as Steps of that attempt. Retries are off (a retried generation would be recorded twice)
    and reads never time out. Pass ``http_client=SharedPool()`` to share one pool. ``token`` is
    the API key sent as the bearer token; without one a placeholder is sent, which only a server
    that checks no key accepts (a gateway started without ``--token``, like the one
    ``rollfleet run`` starts).
    """
    import openai

    headers = {
        ROLLOUT_HEADER: rollout_id,
        ATTEMPT_HEADER: attempt_id,
        **kwargs.pop("default_headers", {}),
    }
    return openai.AsyncOpenAI(
        base_url=gateway_v1_url(base_url),
        api_key=token or NO_KEY,
        default_headers=headers,
        timeout=kwargs.pop("timeout", LLM_TIMEOUT),
        max_retries=kwargs.pop("max_retries", 0),
        **kwargs,
    )
