"""Files a user (or an attacker with write access to them) hands rollfleet: a checkpoint pointer
that names something else, corrupt checkpoints, hostile task files and an output directory that
holds someone else's files. Each is one line naming the file and what is wrong, and nothing is
changed: no silent restart, no checkpoint deleted, no tables added to a foreign database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.errors import InvalidInput
from rollfleet.run.outputs import OWNER, claim_output_dir
from rollfleet.taskfile import read_records

HAVE_TORCH = True
try:
    import torch
except ImportError:  # pragma: no cover - the train extra is installed for the suite
    HAVE_TORCH = False


def saved(root: Path, step: int = 3):  # type: ignore[no-untyped-def]
    """A real checkpoint of a small model under ``root``; returns (model, optimizer)."""
    require(HAVE_TORCH, "torch (rollfleet[train])")
    from rollfleet.train import checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    checkpoint.save(root, step, model, optimizer, [{"step": step}], {"lr": 0.1})
    return model, optimizer


def resume(root: Path, model: Any, optimizer: Any) -> None:
    """What ``rollfleet train`` does on start: find the checkpoint to resume, then load it."""
    from rollfleet.train import checkpoint

    where = checkpoint.find(root, {"lr": 0.1})
    assert where is not None
    checkpoint.load(where, model, optimizer)


@pytest.mark.parametrize(
    ("pointer", "message"),
    [
        ("step-9", "names step-9, which is not a complete checkpoint"),
        ("../../etc", "must name a checkpoint as step-N inside"),
        ("step-3/../step-3", "must name a checkpoint as step-N inside"),
        (None, "latest: missing, but"),
    ],
)
def test_a_latest_pointer_to_anything_but_a_checkpoint_is_refused_and_nothing_deleted(
    tmp_path: Path, pointer: str | None, message: str
) -> None:
    model, optimizer = saved(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    if pointer is None:
        (tmp_path / "latest").unlink()
        before.remove("latest")
    else:
        (tmp_path / "latest").write_text(pointer)
    with pytest.raises(InvalidInput, match=message):
        resume(tmp_path, model, optimizer)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # step-3 is still there


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("meta.json", b"{not json", r"meta.json: not valid JSON"),
        ("meta.json", b'{"step": "3", "fingerprint": {}, "records": []}', "field 'step' must"),
        ("meta.json", b"[" * 100_000, "nested too deep"),
        ("policy.pt", b"PK\x03\x04 truncated", "policy.pt: not a readable checkpoint file"),
        ("optimizer.pt", b"", "optimizer.pt: not a readable checkpoint file"),
    ],
)
def test_a_corrupt_checkpoint_is_one_line_naming_the_file(
    tmp_path: Path, file: str, content: bytes, message: str
) -> None:
    model, optimizer = saved(tmp_path)
    weights = model.weight.detach().clone()
    (tmp_path / "step-3" / file).write_bytes(content)
    with pytest.raises(InvalidInput, match=message):
        resume(tmp_path, model, optimizer)
    if file != "optimizer.pt":
        assert torch.equal(model.weight, weights)


def test_a_checkpoint_of_another_model_is_refused_before_any_weight_changes(
    tmp_path: Path,
) -> None:
    saved(tmp_path)
    other = torch.nn.Linear(4, 2)
    weights = other.weight.detach().clone()
    with pytest.raises(InvalidInput, match="policy.pt: tensors that are not this model's"):
        resume(tmp_path, other, torch.optim.Adam(other.parameters()))
    assert torch.equal(other.weight, weights)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
        ('{"answer": ' + "9" * 5000 + "}", "Exceeds the limit"),
        ('{"answer": NaN}', "NaN is not a JSON number"),
        ('{"answer": 1e999}', "1e999 is beyond a float's range"),
        ('{"question": "\\ud800"}', "a string holds a lone surrogate"),
    ],
)
def test_a_hostile_task_line_is_one_line_naming_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "1+1?", "answer": 2}\n' + line + "\n")
    with pytest.raises(InvalidInput, match=message) as caught:
        list(read_records(data))
    assert str(caught.value).startswith(f"{data}:2: ")


def test_an_output_dir_holding_a_foreign_database_is_refused_unchanged(tmp_path: Path) -> None:
    out = tmp_path / "theirs"
    out.mkdir()
    foreign = out / "store.db"
    foreign.write_bytes(b"SQLite format 3\x00 someone else's rows")
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "1+1?", "answer": 2}\n')
    done = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "train", "--mode", "math", "--data", str(data)]
        + ["--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "holds store.db, which rollfleet did not write" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["store.db"]
    assert foreign.read_bytes() == b"SQLite format 3\x00 someone else's rows"


def test_an_output_dir_is_taken_again_by_its_command_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    claim_output_dir(out, "train")
    (out / "metrics.jsonl").write_text("{}\n")
    claim_output_dir(out, "train")  # a resume
    with pytest.raises(InvalidInput, match="holds the outputs of rollfleet 'train', not of"):
        claim_output_dir(out, "run")
    assert (out / OWNER).read_text() == "train\n"


def test_an_output_dir_of_an_older_rollfleet_is_taken_a_foreign_one_is_not(tmp_path: Path) -> None:
    """Without the owner marker, a directory holding only what the command writes, its store.db
    one of rollfleet's, is an older rollfleet's output and is resumed; anything else is refused."""
    import sqlite3

    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text("{}\n")
    with sqlite3.connect(old / "store.db") as db:
        db.execute("CREATE TABLE rollouts (x)")
        db.execute("CREATE TABLE steps (x)")
    claim_output_dir(old, "train")
    assert (old / OWNER).read_text() == "train\n"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / "store.db") as db:
        db.execute("CREATE TABLE accounts (x)")
    with pytest.raises(InvalidInput, match="holds store.db, which rollfleet did not write"):
        claim_output_dir(foreign, "train")
    assert not (foreign / OWNER).exists()
