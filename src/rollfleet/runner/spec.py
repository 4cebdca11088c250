"""What one runner process runs: a typed spec, handed to ``python -m rollfleet.runner.child`` as
JSON. Secrets never travel in it: the store's and the LLM's tokens are the child's environment
(``ROLLFLEET_TOKEN``, ``ROLLFLEET_LLM_TOKEN``), since a command line is world-readable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.envs import EnvSpec

MAX_CONCURRENCY = 4096  # rollouts one runner process runs at once


class LlmAccess(BaseModel):
    """How a runner's rollouts reach ``ctx.llm``: a gateway URL, or an engine of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = Field(default=None, description="OpenAI-compatible base URL")
    mint: bool = Field(
        default=False,
        description="the LLM token is a rollfleet gateway's: each attempt gets a capability "
        "made from it (recording to that attempt only), never the token",
    )
    own_engine: bool = Field(
        default=False, description="a private llama.cpp engine in the runner process"
    )
    model_path: str | None = Field(
        default=None, description="GGUF for own_engine (default: the bundled model)"
    )

    @property
    def enabled(self) -> bool:
        """Whether rollouts get a ``ctx.llm`` at all."""
        return self.url is not None or self.own_engine


class RunnerSpec(BaseModel):
    """One runner process: its store, agent, identity, concurrency, LLM and environment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str = Field(description="the store's URL")
    agent: str = Field(description="module:function or file.py:function")
    worker_id: str = Field(min_length=1, max_length=200)
    concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY)
    grace_s: float = Field(default=30.0, ge=0.0, description="a drain's time to finish")
    llm: LlmAccess = LlmAccess()
    env: EnvSpec | None = Field(default=None, description="what ctx.env gives rollouts")
    exit_with_parent: bool = Field(
        default=False, description="stop when the process that started it dies"
    )
    supervised: bool = Field(default=False, description="SIGINT is left to the supervisor")
