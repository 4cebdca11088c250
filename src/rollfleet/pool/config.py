"""Pools declared in a config file (TOML, or JSON by extension); errors name file and field.

Example (``pools.toml``)::

    [pools.py]                 # a pool called "py"
    provider = "sandbox"       # sandbox | desktop | command
    size = 3                   # M instances
    lease_s = 60               # default lease length for remote holders

    [pools.py.options]         # the provider's options (SandboxLimits, DesktopOptions, CommandSpec)
    cpu_s = 10
    memory_mb = 1024

    [pools.py.policy]          # timeouts, health checks, replacement budget (PoolPolicy)
    reset_timeout_s = 120
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollfleet.errors import InvalidInput
from rollfleet.pool.base import Provider
from rollfleet.pool.leases import PoolRegistry
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.command import CommandProvider, CommandSpec
from rollfleet.pool.providers.desktop import DesktopOptions, DesktopProvider
from rollfleet.pool.providers.sandbox import SandboxProvider
from rollfleet.pool.providers.sandbox_records import SandboxLimits


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PolicySpec(_Strict):
    """The ``policy`` table: the fields of :class:`~rollfleet.pool.pool.PoolPolicy`."""

    start_timeout_s: float | None = Field(default=900.0, gt=0)
    reset_timeout_s: float | None = Field(default=600.0, gt=0)
    check_timeout_s: float | None = Field(default=60.0, gt=0)
    check_after_reset: bool = True
    check_interval_s: float | None = Field(default=None, gt=0)
    max_start_attempts: int = Field(default=3, ge=1)
    backoff_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)


class PoolSpec(_Strict):
    """One ``[pools.NAME]`` table."""

    provider: Literal["sandbox", "desktop", "command"]
    size: int = Field(ge=1, le=10_000)
    lease_s: float = Field(default=60.0, gt=0, le=24 * 3600)
    options: dict[str, Any] = Field(default_factory=dict)
    policy: PolicySpec = Field(default_factory=PolicySpec)


class PoolsFile(_Strict):
    """The whole file: at least one pool."""

    pools: dict[str, PoolSpec] = Field(min_length=1)


OPTIONS: dict[str, type[BaseModel]] = {
    "sandbox": SandboxLimits,
    "desktop": DesktopOptions,
    "command": CommandSpec,
}


def _field_errors(source: str, prefix: str, exc: ValidationError) -> InvalidInput:
    """One InvalidInput listing every bad field as ``file: dotted.field: message``."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in (prefix, *err["loc"]) if part != "")
        lines.append(f"{source}: {where or '(top level)'}: {err['msg']}")
    return InvalidInput("\n".join(lines))


def _decode(text: str, source: str) -> Any:
    if source.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{source}: line {exc.lineno}: not valid JSON: {exc.msg}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInput(f"{source}: not valid TOML: {exc}") from exc


def parse_config(text: str, source: str = "<pools config>") -> PoolsFile:
    """Parse and validate a pools config's text; ``source`` names it in errors."""
    raw = _decode(text, source)
    try:
        parsed = PoolsFile.model_validate(raw)
    except ValidationError as exc:
        raise _field_errors(source, "", exc) from exc
    for name, spec in parsed.pools.items():
        try:
            OPTIONS[spec.provider].model_validate(spec.options)
        except ValidationError as exc:
            raise _field_errors(source, f"pools.{name}.options", exc) from exc
    return parsed


def load_config(path: str | Path) -> PoolsFile:
    """Read and validate a pools config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read pools config: {exc.strerror}") from exc
    return parse_config(text, str(path))


def make_provider(spec: PoolSpec) -> Provider:
    """The provider a pool spec asks for, built from its (already validated) options."""
    if spec.provider == "sandbox":
        return SandboxProvider(SandboxLimits.model_validate(spec.options))
    if spec.provider == "desktop":
        return DesktopProvider(DesktopOptions.model_validate(spec.options))
    return CommandProvider(CommandSpec.model_validate(spec.options))


def build_pool(name: str, spec: PoolSpec) -> Pool:
    """A (not yet started) pool for one spec."""
    return Pool(
        make_provider(spec), spec.size, name=name, policy=PoolPolicy(**spec.policy.model_dump())
    )


def load_registry(path: str | Path) -> PoolRegistry:
    """Every pool of a config file in a registry (not yet started), for serving."""
    config = load_config(path)
    return PoolRegistry(
        (build_pool(name, spec), spec.lease_s) for name, spec in config.pools.items()
    )
