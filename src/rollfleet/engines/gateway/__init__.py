"""The LLM gateway that agents talk to, in front of the engine replicas.

:mod:`~rollfleet.engines.gateway.gateway` is :class:`Gateway`: it routes each call to a replica
(sticky per rollout), records it as a Step, installs pushed weights on every replica, and answers a
call asked again with the tokens already generated (:mod:`~rollfleet.engines.gateway.repeats`).
:mod:`~rollfleet.engines.gateway.app` is its OpenAI-compatible HTTP surface (a FastAPI router and
a standalone server), :mod:`~rollfleet.engines.gateway.wire` the OpenAI wire format those routes
read and write, and :mod:`~rollfleet.engines.gateway.client` ``ctx.llm``, an OpenAI client pointed
at it for one rollout attempt. What the engines share with it (images, tool calls, token-in across
turns) sits one level up, in :mod:`rollfleet.engines`, since the engines below the gateway use it.
"""

from rollfleet.engines.gateway.gateway import Gateway

__all__ = ["Gateway"]
