"""Helpers shared by CLI commands: store options, running coroutines, tables."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollfleet.client import connect, default_store_url
from rollfleet.store.base import Store

T = TypeVar("T")
console = Console()

StoreOpt = typer.Option(
    None,
    "--store",
    help="store URL: http(s)://server (replicas: http://a,http://b, failed over between), "
    "sqlite:///file.db or postgresql://… (default: ROLLFLEET_STORE, else the embedded store)",
)
TokenOpt = typer.Option(None, "--token", help="bearer token (default: ROLLFLEET_TOKEN)")


def store_url(url: str | None) -> str:
    """The store URL a command uses."""
    return url or default_store_url()


def token_of(token: str | None) -> str | None:
    """The bearer token a command uses."""
    return token or os.environ.get("ROLLFLEET_TOKEN") or None


def run(coro: Awaitable[T]) -> T:
    """Run a coroutine to completion."""
    return asyncio.run(coro)  # type: ignore[arg-type]


async def with_store(url: str | None, token: str | None, fn: Any) -> Any:
    """Open the store, run ``fn(store)``, close it."""
    store: Store = connect(store_url(url), token=token_of(token))
    try:
        return await fn(store)
    finally:
        await store.close()


def stderr_bar() -> Progress:
    """A progress bar on stderr that leaves nothing behind (stdout stays the command's output)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def fmt_age(seconds: float | None) -> str:
    """Seconds as a short human duration."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def job_start(mode: str, verbose: bool) -> str:
    """What a job command (``run``, ``train``) checks and sets first: a ``--mode`` that loads
    (returned with a file path made absolute, as runner processes need it), and lifecycle logs
    only with ``--verbose``."""
    from rollfleet.envs.registry import factory_of, registered
    from rollfleet.refs import absolute

    if not verbose:
        for name in ("rollfleet", "gguf", "matplotlib"):  # gguf: a line per weights export
            logging.getLogger(name).setLevel(logging.WARNING)
    factory_of(mode)  # InvalidInput naming the known modes, or why a module:factory fails
    name, _, argument = mode.partition(":")
    if argument and name in registered():  # verifiers:file.py:make: the argument is the file
        return f"{name}:{absolute(argument)}"
    return absolute(mode)
