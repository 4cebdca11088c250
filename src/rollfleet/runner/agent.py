"""Agents: how they are referenced, checked at start-up, and how their return values are read.

An agent is ``async def agent(input, ctx) -> float | RolloutResult | dict | None`` or a class with
``async def rollout(self, input, ctx)``. It is referenced as ``package.module:function`` (or
``package.module``, meaning its ``agent`` attribute), or ``path/to/file.py:function``
(:mod:`rollfleet.refs`).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from rollfleet import refs
from rollfleet.errors import AgentError, InvalidInput
from rollfleet.model import RolloutConfig, RolloutResult
from rollfleet.runner.context import RolloutContext

Agent = Callable[[Any, RolloutContext], Awaitable[Any]]  # (input, ctx) -> reward or result
F = TypeVar("F", bound=Callable[..., Any])


def agent(fn: F | None = None, **defaults: Any) -> Any:
    """Mark an async function as an agent; ``timeout_s`` applies to rollouts that set none."""

    def mark(f: F) -> F:
        try:
            RolloutConfig(**defaults)
        except ValidationError as exc:
            raise AgentError(f"@agent defaults for {f.__qualname__}: {exc}") from None
        f.__rollfleet_defaults__ = defaults  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def agent_defaults(fn: Any) -> dict[str, Any]:
    """The RolloutConfig defaults set by ``@agent`` (empty when none)."""
    return dict(getattr(fn, "__rollfleet_defaults__", {}))


def _import(ref: str) -> Any:
    try:
        return refs.resolve(ref, default_attribute="agent")
    except InvalidInput as exc:
        raise AgentError(f"agent {ref!r}: {exc.message}") from None


def load_agent(ref: str | Callable[..., Any]) -> Agent:
    """Resolve and check an agent; a bad reference or signature fails here, not per rollout."""
    target: Any = _import(ref) if isinstance(ref, str) else ref
    label = ref if isinstance(ref, str) else getattr(ref, "__qualname__", repr(ref))
    if inspect.isclass(target):
        try:
            instance: Any = target()
            target = instance.rollout
        except Exception as exc:
            raise AgentError(
                f"agent {label!r}: cannot construct {target.__name__}(): {exc}"
            ) from exc
    if not callable(target):
        raise AgentError(f"agent {label!r} is not callable")
    call = type(target).__call__ if not inspect.isfunction(target) else None
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)):
        raise AgentError(f"agent {label!r} must be an async function: async def agent(input, ctx)")
    try:
        inspect.signature(target).bind(None, None)
    except TypeError:
        raise AgentError(f"agent {label!r} must take two arguments: (input, ctx)") from None
    fn: Agent = target
    return fn


def to_result(value: Any) -> RolloutResult:
    """Read what an agent returned: a number is the reward; a dict carries reward/metrics/output."""
    if value is None:
        return RolloutResult()
    if isinstance(value, RolloutResult):
        return value
    if isinstance(value, bool):
        return RolloutResult(reward=float(value))
    if isinstance(value, (int, float)):
        return RolloutResult(reward=float(value))
    if isinstance(value, dict) and set(value) <= {"reward", "metrics", "output"}:
        try:
            return RolloutResult.model_validate(value)
        except ValidationError as exc:
            raise AgentError(f"agent returned a result that is not valid: {exc}") from None
    return RolloutResult(output=value)
