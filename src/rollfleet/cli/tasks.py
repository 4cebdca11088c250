"""``rollfleet tasks``: write task files for a mode from a generator.

``rollfleet tasks reasoning-gym NAME --size 64 --seed 0`` writes entries 0 to size-1 of
reasoning-gym's dataset NAME as JSONL, one ``reasoning-gym`` task a line (stdout, or
``--output FILE``, written whole or not at all); ``--list`` shows the dataset names.
``rollfleet tasks verifiers module:factory`` writes a verifiers taskset's tasks by position,
one ``verifiers:module:factory`` task a line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import typer

from rollfleet.cli.common import stderr_bar
from rollfleet.errors import InvalidInput

PROGRESS_AFTER_S = 1.0  # a bar appears once generating has taken this long

app = typer.Typer(help="Write task files for a mode from a generator.", no_args_is_help=True)


@app.command("reasoning-gym")
def reasoning_gym(
    name: str | None = typer.Argument(None, help="the dataset, e.g. leg_counting"),
    size: int = typer.Option(64, "--size", help="how many tasks (entries 0 to size-1)"),
    seed: int = typer.Option(0, "--seed", help="the generator's seed"),
    output: Path | None = typer.Option(None, "--output", "-o", help="JSONL file (default: stdout)"),
    list_names: bool = typer.Option(False, "--list", help="show the dataset names and exit"),
) -> None:
    """Tasks for ``--mode reasoning-gym``: reasoning-gym's dataset NAME, entry by entry."""
    from rollfleet.envs import reasoning_gym as rg

    if list_names:
        _list(rg.dataset_names())
        return
    if name is None:
        raise InvalidInput("name a dataset, e.g. leg_counting; --list shows them")
    rg.check_source(name, seed, size)
    lines = (
        json.dumps(rg.task_line(name, seed, size, index), ensure_ascii=False, allow_nan=False)
        for index in range(size)
    )
    with _sink(output) as out:
        for line in _with_progress(lines, size, f"{name} seed {seed}"):
            out.write(line + "\n")


@app.command("verifiers")
def verifiers(
    ref: str = typer.Argument(..., help="the taskset's factory: module:factory or file.py:factory"),
    limit: int | None = typer.Option(None, "--limit", help="at most this many tasks (from 0)"),
    output: Path | None = typer.Option(None, "--output", "-o", help="JSONL file (default: stdout)"),
) -> None:
    """Tasks for ``--mode verifiers:REF``: the taskset's tasks by position."""
    from rollfleet.envs import verifiers_env as vf
    from rollfleet.refs import absolute

    ref = absolute(ref)
    count = vf.tasks_of(ref).count()
    if limit is not None and limit < 1:
        raise InvalidInput(f"--limit must be at least 1, got {limit}")
    size = count if limit is None else min(limit, count)
    lines = (
        json.dumps(vf.task_line(ref, index), ensure_ascii=False, allow_nan=False)
        for index in range(size)
    )
    with _sink(output) as out:
        for line in _with_progress(lines, size, f"verifiers {ref}"):
            out.write(line + "\n")


def _list(names: tuple[str, ...]) -> None:
    from rollfleet.envs import reasoning_gym as rg

    print("\n".join(names))
    left_out = sorted(set(rg.known_names()) - set(names))
    if left_out:
        print(
            f"(not usable here: {', '.join(left_out)}; see docs/environments.md)", file=sys.stderr
        )


@contextlib.contextmanager
def _sink(output: Path | None) -> Iterator[IO[str]]:
    """stdout, or a temporary file beside ``output`` that replaces it once complete."""
    if output is None:
        yield sys.stdout
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    except OSError as exc:
        raise InvalidInput(f"--output {output}: cannot write there: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            yield file
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as an ordinary new file, not mkstemp's 0600
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _with_progress(lines: Iterator[str], total: int, label: str) -> Iterator[str]:
    """``lines`` as they come, with a bar on stderr once it has taken a moment."""
    started, bar = time.monotonic(), stderr_bar()
    task = bar.add_task(label, total=total)
    try:
        for done, line in enumerate(lines, start=1):
            yield line
            bar.update(task, completed=done)
            if not bar.live.is_started and time.monotonic() - started > PROGRESS_AFTER_S:
                bar.start()
    finally:
        bar.stop()


def register(root: typer.Typer) -> None:
    """Add the ``tasks`` group to the app."""
    root.add_typer(app, name="tasks")
