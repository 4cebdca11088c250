"""The ``rollfleet`` command line: one typer app, commands registered by their modules."""

from __future__ import annotations

import logging
import sys

import typer

from rollfleet.errors import RollfleetError

app = typer.Typer(
    name="rollfleet",
    help="Durable, fast rollouts for LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    from rollfleet.cli import demo, store_cmds, tasks, workers

    for module in (store_cmds, workers, demo, tasks):
        module.register(app)
    for optional in ("gateway", "pool", "run", "batches", "train", "env", "replay"):
        try:
            module = __import__(f"rollfleet.cli.{optional}", fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != f"rollfleet.cli.{optional}":
                raise
            continue
        module.register(app)


def main() -> None:
    """Run the rollfleet command line; a user mistake is one line on stderr, not a traceback."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _register()
    try:
        app()
    except RollfleetError as exc:
        print(f"rollfleet: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
