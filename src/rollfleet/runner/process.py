"""What a runner process runs, built from its :class:`~rollfleet.runner.spec.RunnerSpec`: the
Runner with its store client, ``ctx.llm`` (a gateway URL, or an engine of its own) and ``ctx.env``,
all closed when it ends. The runner child process and the Ray runner actor both build it here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from rollfleet.client import connect
from rollfleet.errors import AgentError, RollfleetError
from rollfleet.model import Rollout
from rollfleet.runner.runner import Runner
from rollfleet.runner.spec import RunnerSpec


@dataclass(frozen=True)
class Tokens:
    """The secrets a runner reads from its environment or its launcher, never a command line."""

    store: str | None = None
    llm: str | None = None

    @classmethod
    def take(cls) -> Tokens:
        """Read them from the environment and remove them: nothing the agent starts inherits
        them."""
        store = os.environ.pop("ROLLFLEET_TOKEN", None)
        return cls(store, os.environ.pop("ROLLFLEET_LLM_TOKEN", None))


@contextlib.asynccontextmanager
async def spec_runner(
    spec: RunnerSpec,
    tokens: Tokens,
    *,
    agent: str | Callable[..., Any] | None = None,
    on_event: Callable[..., None] | None = None,
) -> AsyncIterator[Runner]:
    """The Runner ``spec`` describes (``agent``: a callable in place of ``spec.agent``, from
    Python); AgentError for an agent, or an own engine, that does not start, with what was
    opened closed."""
    async with contextlib.AsyncExitStack() as exits:
        llm_url = spec.llm.url
        if spec.llm.own_engine:
            try:
                llm_url = await exits.enter_async_context(
                    own_engine(spec.llm.model_path, spec.concurrency)
                )
            except RollfleetError as exc:
                raise AgentError(f"own engine: {exc}") from exc
        env = None
        if spec.env is not None:
            from rollfleet.envs import build_env_source

            source = build_env_source(spec.env, spec.concurrency)
            if source is not None:
                exits.push_async_callback(source.close)
            env = source
        store = connect(spec.store, token=tokens.store)
        exits.push_async_callback(store.close)
        factory = None
        if llm_url:
            from rollfleet.engines.gateway.client import SharedPool

            http = SharedPool()
            exits.push_async_callback(http.shut)
            factory = llm_factory(llm_url, tokens.llm, http, mint=spec.llm.mint)
        yield Runner(
            store,
            agent or spec.agent,
            worker_id=spec.worker_id,
            concurrency=spec.concurrency,
            grace_s=spec.grace_s,
            on_event=on_event,
            env=env,
            llm_factory=factory,
        )


def llm_factory(
    url: str, token: str | None, http: Any, mint: bool = False
) -> Callable[[Rollout], Any]:
    """``ctx.llm`` for each rollout: an OpenAI client for ``url`` tagged with its ids, all of
    them on the one connection pool ``http``, with ``token`` as its API key; with ``mint``,
    ``token`` is the rollfleet gateway's and the client holds an attempt capability made from
    it instead (:mod:`rollfleet.web.capability`)."""
    from rollfleet.engines.gateway.client import llm_client
    from rollfleet.web import capability

    def make(rollout: Rollout) -> Any:
        assert rollout.attempt is not None
        attempt_id = rollout.attempt.attempt_id
        key = token
        if mint and token is not None:
            ttl = capability.attempt_ttl(rollout.config.timeout_s)
            key = capability.mint(token, rollout.rollout_id, attempt_id, ttl)
        return llm_client(url, rollout.rollout_id, attempt_id, token=key, http_client=http)

    return make


@contextlib.asynccontextmanager
async def own_engine(model: str | None, slots: int) -> AsyncIterator[str]:
    """A private llama.cpp engine and gateway in this process; yields the gateway URL."""
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(
        model, slots=max(1, slots), threads=max(1, len(os.sched_getaffinity(0)) - 1)
    )
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine)
    try:
        async with running_gateway(gateway) as url:
            yield url
    finally:
        await gateway.close()
