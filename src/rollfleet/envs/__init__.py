"""Environments for ``rollfleet run``: one module per mode (math, py, rag, web, osworld, lookup).

:func:`get_mode` returns a :class:`~rollfleet.envs.base.Mode`; :class:`EnvSpec` says what
``ctx.env`` a runner process gives its rollouts, and :func:`build_env_source` builds it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.envs.base import Mode, Score, Session, StaticEnv, Tool
from rollfleet.errors import InvalidInput
from rollfleet.pool.base import EnvSource

MODES = ("math", "py", "rag", "web", "osworld", "lookup")
# What the model is shown, per mode that has a choice (the first is the default).
OBSERVATIONS = {
    "web": ("text", "screenshot", "both"),
    "osworld": ("screenshot", "a11y_tree", "screenshot_a11y_tree"),
}


def check_observation(mode: str | None, observation: str | None) -> str | None:
    """``observation`` if ``mode`` offers it (None: the mode's default); InvalidInput naming the
    valid ones otherwise."""
    if observation is None:
        return None
    valid = OBSERVATIONS.get(mode or "")
    if valid is None:
        offered = " and ".join(OBSERVATIONS)
        raise InvalidInput(f"--observation is for the {offered} modes, not {mode!r}")
    if observation not in valid:
        raise InvalidInput(
            f"--observation {observation!r}: {mode} takes {', '.join(valid)} (default {valid[0]})"
        )
    return observation


def get_mode(name: str | None, observation: str | None = None) -> Mode:
    """The mode called ``name`` (showing the model ``observation`` where the mode has a
    choice); InvalidInput naming the known ones otherwise."""
    observation = check_observation(name, observation)
    if name == "math":
        from rollfleet.envs.math import MathMode

        return MathMode()
    if name == "py":
        from rollfleet.envs.py import PyMode

        return PyMode()
    if name == "rag":
        from rollfleet.envs.rag import RagMode

        return RagMode()
    if name == "web":
        from rollfleet.envs.web import WebMode

        return WebMode(observation)
    if name == "osworld":
        from rollfleet.envs.osworld import OSWorldMode

        return OSWorldMode(observation)
    if name == "lookup":
        from rollfleet.envs.lookup import LookupMode

        return LookupMode()
    raise InvalidInput(f"unknown mode {name!r}; the modes are {', '.join(MODES)}")


class EnvSpec(BaseModel):
    """What environment a runner process provides (sent to it as JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: str
    use_pool: bool = Field(
        default=False, description="share num_instances among the process's rollouts"
    )
    num_instances: int = Field(default=3, ge=1)
    corpus: str | None = None
    site: str | None = None
    sandbox: dict[str, Any] = Field(default_factory=dict, description="SandboxLimits fields")
    desktop: dict[str, Any] = Field(default_factory=dict, description="DesktopOptions fields")
    standin: bool = Field(
        default=False, description="desktop: DesktopEnvStandIn instead of OSWorld (tests)"
    )


def build_env_source(spec: EnvSpec, concurrency: int = 1) -> EnvSource | None:
    """The EnvSource for ``spec`` (None for math and lookup, which need no environment)."""
    from rollfleet.pool import env_source

    if spec.mode in ("math", "lookup"):
        return None
    if spec.mode == "rag":
        from rollfleet.envs.rag import RagIndex

        index = RagIndex(spec.corpus)
        return StaticEnv(index, "rag", on_close=index.close)
    if spec.mode == "web":
        from rollfleet.envs.web import WebSite

        site = WebSite(spec.site).start()
        return StaticEnv(site, "web", endpoint=site.url, on_close=site.close)
    if spec.mode == "py":
        from rollfleet.pool import SandboxLimits, SandboxProvider

        provider = SandboxProvider(SandboxLimits(**spec.sandbox))
        return env_source(
            provider,
            use_pool=spec.use_pool,
            num_instances=spec.num_instances,
            concurrency=concurrency,
            pool_name="py",
        )
    if spec.mode == "osworld":
        return env_source(
            desktop_provider(spec),
            use_pool=spec.use_pool,
            num_instances=spec.num_instances,
            concurrency=concurrency,
            pool_name="osworld",
        )
    raise InvalidInput(f"unknown mode {spec.mode!r}; the modes are {', '.join(MODES)}")


def desktop_options(desktop: dict[str, Any]) -> Any:
    """The OSWorld options (``DesktopOptions``) from ``--provider-name`` and the others;
    InvalidInput naming the flag and what it takes, never a validation traceback."""
    from pydantic import ValidationError

    from rollfleet.pool import DesktopOptions

    try:
        return DesktopOptions(**desktop)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "desktop"
        said = first["msg"].replace("Input should be", "must be")
        flag = f"--{name.replace('_', '-')}"
        raise InvalidInput(f"{flag} {desktop.get(name, '')!r}: {said}") from None


def desktop_provider(spec: EnvSpec) -> Any:
    """The desktop provider for ``spec`` (the stand-in, for tests, when ``spec.standin``)."""
    from rollfleet.pool import DesktopEnvStandIn, DesktopProvider

    options = desktop_options(spec.desktop)
    if spec.standin:
        return DesktopProvider(
            options, env_class=DesktopEnvStandIn, which=lambda tool: f"/standin/{tool}"
        )
    return DesktopProvider(options)


__all__ = [
    "MODES",
    "OBSERVATIONS",
    "EnvSpec",
    "Mode",
    "Score",
    "Session",
    "StaticEnv",
    "Tool",
    "build_env_source",
    "check_observation",
    "desktop_options",
    "desktop_provider",
    "get_mode",
]
