"""``rollfleet batches …`` commands on an embedded SQLite store (typer's runner, a real store)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from rollfleet.client import connect_sync
from rollfleet.coordinator.cli import register
from rollfleet.errors import InvalidInput, NotFound
from rollfleet.model import AttemptStatus, RolloutResult


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """rollfleet."""

    register(app)
    return app


def test_submit_finalize_list_and_experiences(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rf.db"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"q": i}) for i in range(3)) + "\n")
    cli, app = CliRunner(), _app()
    env = {"ROLLFLEET_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    out = cli.invoke(
        app,
        ["batches", "submit", str(tasks), "--batch", "s1", "--repeat", "2", "--store", url],
        env=env,
    )
    assert out.exit_code == 0, out.output
    assert "submitted batch s1" in out.output
    with connect_sync(url) as store:
        for r in store.claim("w", max_n=10):
            store.complete(
                r.attempt.attempt_id,
                AttemptStatus.SUCCEEDED,
                RolloutResult(reward=float(r.input["q"])),
            )
    out = cli.invoke(app, ["batches", "finalize", "s1", "--store", url], env=env)
    assert out.exit_code == 0, out.output
    assert '"finished_task_count": 3' in out.output and "reward/mean" in out.output
    out = cli.invoke(app, ["batches", "list", "--store", url], env=env)
    assert out.exit_code == 0 and "s1" in out.output and "finalized" in out.output
    out = cli.invoke(app, ["batches", "experiences", "s1", "--store", url], env=env)
    assert out.exit_code == 0, out.output
    assert (tmp_path / "home" / "experiences" / "s1.parquet").exists()


def test_errors_reach_the_caller_as_rollfleet_errors(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rf.db"
    cli, app = CliRunner(), _app()
    out = cli.invoke(app, ["batches", "finalize", "nope", "--store", url])
    assert isinstance(out.exception, NotFound)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n[1]\n')
    out = cli.invoke(app, ["batches", "submit", str(bad), "--batch", "b", "--store", url])
    assert isinstance(out.exception, InvalidInput) and "bad.jsonl:2" in out.exception.message
