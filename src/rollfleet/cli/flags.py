"""Typer commands whose options are the flags declared on options dataclasses
(:func:`rollfleet.flags.flag`): the flag, its default, help and type are written once."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

import typer

from rollfleet.flags import flags_of


def options_command(
    body: Callable[[dict[str, Any]], None], *sources: type, **extra: tuple[type, Any]
) -> Callable[..., None]:
    """A command taking every flag of the dataclasses ``sources`` (and ``extra``: name →
    ``(type, typer.Option(...))``), calling ``body`` with the values by field name."""
    parameters = []
    for source in sources:
        hints = typing.get_type_hints(source)
        for field, meta in flags_of(source):
            required = field.default is dataclasses.MISSING
            default = ... if required else field.default
            option = typer.Option(
                default, *meta.names(field.name), help=meta.help, envvar=meta.envvar
            )
            parameters.append(_parameter(field.name, hints[field.name], option))
    for name, (kind, option) in extra.items():
        parameters.append(_parameter(name, kind, option))

    def command(**values: Any) -> None:
        body(values)

    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    command.__doc__ = body.__doc__
    command.__name__ = body.__name__
    return command


def _parameter(name: str, kind: Any, option: Any) -> inspect.Parameter:
    """One keyword parameter as typer reads it: ``X | None`` taken as ``X`` (None the default)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
