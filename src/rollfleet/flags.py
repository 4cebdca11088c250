"""Command-line flags declared once, on the fields of the options types they fill: a field's
flag name, help and environment variable live in its metadata (:func:`flag`), and the CLI builds
its options from them (rollfleet.cli.flags), so a flag, its default and its field never drift."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING
from typing import Any


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field appears on a command line."""

    help: str
    name: str | None = None  # default: --field-name
    envvar: str | None = None

    def names(self, field_name: str) -> list[str]:
        """The flag's spelling on the command line."""
        return [self.name or "--" + field_name.replace("_", "-")]


def flag(
    default: Any = MISSING,
    help: str = "",
    *,
    name: str | None = None,
    envvar: str | None = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag (no default: a required flag)."""
    metadata = {"flag": Flag(help, name, envvar)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flags_of(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of the dataclass ``cls`` that are flags, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]
