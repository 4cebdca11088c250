"""Fleet construction: one frozen record of options, one function building a local or Ray fleet."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollfleet.envs import EnvSpec
from rollfleet.runner.spec import LlmAccess

Backend = Literal["local", "ray"]
BACKENDS: tuple[Backend, ...] = ("local", "ray")


@dataclass(frozen=True)
class FleetOptions:
    """What a fleet of runner processes needs: where the store is, which agent, how many, where."""

    store_url: str
    agent: str
    n: int = 4
    concurrency: int = 1
    backend: Backend = "local"
    token: str | None = None
    ray_address: str | None = None
    cpus_per_runner: float = 1.0
    grace_s: float = 30.0
    prefix: str = "worker"
    llm: LlmAccess | None = None  # ctx.llm for the rollouts (none: the agent brings its own)
    llm_token: str | None = None  # its API key, or with llm.mint the gateway's token
    env: EnvSpec | None = None  # ctx.env for the rollouts


class RunnerFleet(Protocol):
    """What a fleet offers: ``run()`` until stopped, ``stop()`` to drain, an agent start error."""

    agent_error: str | None

    async def run(self) -> None:
        """Run the runners until stopped."""

    def stop(self, *, drain: bool = True) -> None:
        """Stop every runner: running rollouts finish (``drain``) or go back to the queue now."""


def make_fleet(
    options: FleetOptions, on_event: Callable[[dict[str, Any]], None] | None = None
) -> RunnerFleet:
    """A local (processes) or Ray (actors) fleet for ``options``, reporting to ``on_event``."""
    if options.backend == "ray":
        from rollfleet.runner.ray_fleet import RayFleet

        return RayFleet(
            options.store_url,
            options.agent,
            n=options.n,
            concurrency=options.concurrency,
            token=options.token,
            address=options.ray_address,
            cpus_per_runner=options.cpus_per_runner,
            prefix=options.prefix,
            grace_s=options.grace_s,
            on_event=on_event,
            llm=options.llm,
            llm_token=options.llm_token,
            env=options.env,
        )
    from rollfleet.runner.local import LocalFleet

    return LocalFleet(
        options.store_url,
        options.agent,
        n=options.n,
        concurrency=options.concurrency,
        token=options.token,
        grace_s=options.grace_s,
        prefix=options.prefix,
        on_event=on_event,
        llm=options.llm,
        llm_token=options.llm_token,
        env=options.env,
    )
