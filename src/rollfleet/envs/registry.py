"""Where modes come from: one registry, the built-in modes and a user's alike.

A mode is named two ways on the command line (``--mode``) and in a rollout's ``mode`` field:
- a **registered name**: an entry point of the group ``rollfleet.modes`` (rollfleet's own
  pyproject registers ``math``, ``py``, ``rag``, ``web``, ``osworld``, ``lookup`` and
  ``reasoning-gym`` this way,
  and any installed package can add its own);
- a registered name with an argument, ``NAME:ARGUMENT`` (``openenv:http://host:8000``): that
  mode's factory called with the argument;
- a **reference** ``package.module:factory`` or ``path/to/file.py:factory``: loaded from the
  user's code, with no install and no edit to rollfleet.

An entry point or reference names a *factory*: a callable returning a
:class:`~rollfleet.envs.base.Mode` (a class is one). A factory that takes an ``observation``
keyword gets ``--observation``. Everything that goes wrong while loading one is an
:class:`InvalidInput` naming the mode and what is wrong, never a traceback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from rollfleet import refs
from rollfleet.envs.base import Mode
from rollfleet.errors import InvalidInput
from rollfleet.refs import MAX_REF

GROUP = "rollfleet.modes"
REQUIRED = ("name", "uses_tools", "check", "system_prompt", "user_prompt", "open")


@functools.cache
def registered() -> dict[str, str]:
    """The registered modes: name -> ``module:attribute`` of its factory."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def factory_of(ref: str) -> Callable[..., Any]:
    """The factory ``ref`` names; InvalidInput naming what is wrong. ``NAME:ARGUMENT`` with a
    registered NAME is that mode's factory given ARGUMENT (``openenv:http://host:8000``)."""
    name, _, argument = ref.partition(":")
    value = registered().get(ref) or (registered().get(name) if argument else None)
    if value is None and ":" not in ref:
        known = ", ".join(sorted(registered())) or "none registered"
        raise InvalidInput(
            f"unknown mode {ref[:MAX_REF]!r}; the modes are {known}, or module:factory for your own"
        )
    try:
        found = refs.resolve(value or ref)
    except InvalidInput as exc:
        raise InvalidInput(f"--mode {ref[:MAX_REF]}: {exc.message}") from None
    if not callable(found):
        raise InvalidInput(f"--mode {ref}: {found!r} is not callable")
    if value is not None and ref not in registered():  # a registered mode with its argument
        return functools.partial(found, argument)
    return found


def load_mode(ref: str, observation: str | None = None) -> Mode:
    """The mode ``ref`` names (a registered name or ``module:factory``), made by its factory with
    ``observation`` where it takes one; InvalidInput when it cannot be loaded or is not a Mode."""
    factory = factory_of(ref)
    takes_observation = _accepts(factory, "observation")
    if observation is not None and not takes_observation:
        raise InvalidInput(f"--observation is not an option of mode {ref!r}")
    try:
        mode = factory(observation=observation) if takes_observation else factory()
    except InvalidInput:
        raise
    except Exception as exc:
        raise InvalidInput(
            f"--mode {ref}: its factory raised {type(exc).__name__}: {exc}"
        ) from None
    missing = [name for name in REQUIRED if not hasattr(mode, name)]
    if missing:
        raise InvalidInput(
            f"--mode {ref}: the factory returned {type(mode).__name__}, not a mode "
            f"(it lacks {', '.join(missing)}; see docs/environments.md)"
        )
    return mode  # type: ignore[no-any-return]


def _accepts(factory: Callable[..., Any], keyword: str) -> bool:
    """Whether ``factory`` takes ``keyword`` (or any keyword)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in parameters)
