"""Environments for ``rollfleet run`` and ``train``: one module per built-in mode (math, py,
rag, web, osworld, lookup, reasoning-gym), each registered like a user's
(:mod:`rollfleet.envs.registry`).

:func:`get_mode` returns a :class:`~rollfleet.envs.base.Mode`; :class:`EnvSpec` says what
``ctx.env`` a runner process gives its rollouts, and :func:`build_env_source` builds it with the
mode's own ``env_source``.
"""

from __future__ import annotations

from rollfleet.envs.base import (
    EnvSpec,
    Mode,
    Score,
    Session,
    StaticEnv,
    Tool,
    env_source_of,
    preflight_of,
    shares_process,
)
from rollfleet.envs.registry import factory_of, load_mode, registered
from rollfleet.errors import InvalidInput
from rollfleet.pool.base import EnvSource


def modes() -> tuple[str, ...]:
    """The registered modes' names (the built-in ones and any an installed package adds)."""
    return tuple(sorted(registered()))


def check_observation(mode: str | None, observation: str | None) -> str | None:
    """``observation`` if ``mode`` offers it (None: the mode's default); InvalidInput naming the
    valid ones otherwise."""
    if observation is None:
        return None
    valid = getattr(factory_of(mode), "observations", None) if mode else None
    if not valid:
        offered = " and ".join(
            name for name in modes() if getattr(factory_of(name), "observations", None)
        )
        raise InvalidInput(f"--observation is for the {offered} modes, not {mode!r}")
    if observation not in valid:
        raise InvalidInput(
            f"--observation {observation!r}: {mode} takes {', '.join(valid)} (default {valid[0]})"
        )
    return observation


def get_mode(name: str | None, observation: str | None = None) -> Mode:
    """The mode ``name`` names (a registered mode or ``module:factory``, showing the model
    ``observation`` where the mode has a choice); InvalidInput naming the known ones otherwise."""
    if not name:
        raise InvalidInput(f"no mode given; the modes are {', '.join(modes())}")
    check_observation(name, observation)
    return load_mode(name, observation)


def build_env_source(spec: EnvSpec, concurrency: int = 1) -> EnvSource | None:
    """The EnvSource for ``spec``: its mode's (None for modes that need no environment)."""
    return env_source_of(get_mode(spec.mode), spec, concurrency)


__all__ = [
    "EnvSpec",
    "Mode",
    "Score",
    "Session",
    "StaticEnv",
    "Tool",
    "build_env_source",
    "check_observation",
    "get_mode",
    "modes",
    "preflight_of",
    "shares_process",
]
