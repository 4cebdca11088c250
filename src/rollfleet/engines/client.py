"""``ctx.llm``: an OpenAI async client already pointed at the gateway for one rollout attempt."""

from __future__ import annotations

from typing import Any

import httpx

from rollfleet.engines.gateway_app import ATTEMPT_HEADER, ROLLOUT_HEADER

# No read timeout: a long generation must never be cut by a client default.
LLM_TIMEOUT = httpx.Timeout(connect=30.0, read=None, write=60.0, pool=None)
# Sent when no key is given: OpenAI's client refuses to start without one. Never replaces a key.
NO_KEY = "rollfleet"


def gateway_v1_url(base_url: str) -> str:
    """The gateway's ``…/v1`` URL for a base URL given with or without ``/v1``."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def llm_client(
    base_url: str, rollout_id: str, attempt_id: str, token: str | None = None, **kwargs: Any
) -> Any:
    """An ``openai.AsyncOpenAI`` for the gateway at ``base_url`` that tags every call.

    Calls carry ``X-Rollfleet-Rollout``/``X-Rollfleet-Attempt`` so the gateway records them
    as Steps of that attempt. Retries are off (a retried generation would be recorded twice)
    and reads never time out. ``token`` is the API key sent as the bearer token; without one a
    placeholder is sent, which only a server that checks no key accepts (a gateway started
    without ``--token``, like the one ``rollfleet run`` starts).
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
