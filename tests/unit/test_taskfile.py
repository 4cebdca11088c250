"""Task files: every line checked first; errors name file:line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollfleet.errors import InvalidInput
from rollfleet.taskfile import read_specs


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_plain_objects_are_inputs_and_specs_are_specs(tmp_path: Path) -> None:
    path = write(
        tmp_path, "t.jsonl", '{"q": 1}\n\n{"input": {"q": 2}, "mode": "py", "priority": 3}\n'
    )
    specs = read_specs(path, mode="math")
    assert [(s.input, s.mode, s.priority) for s in specs] == [
        ({"q": 1}, "math", 0),
        ({"q": 2}, "py", 3),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"q": 1}\n{"q": \n', r"t.jsonl:2: not valid JSON"),
        ('{"q": 1}\n[1, 2]\n', r"t.jsonl:2: expected a JSON object, got list"),
        ('{"input": 1, "priority": "high"}\n', r"t.jsonl:1: field 'priority'"),
        ('{"input": 1, "config": {"timeout_s": -1}}\n', r"t.jsonl:1: field 'config.timeout_s'"),
        (
            '{"input": 1, "rollout_id": "a"}\n{"input": 2, "rollout_id": "a"}\n',
            r"t.jsonl:2: field 'rollout_id'",
        ),
        ("\n", r"no tasks"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        read_specs(write(tmp_path, "t.jsonl", text))


def test_json_list_files(tmp_path: Path) -> None:
    assert len(read_specs(write(tmp_path, "t.json", '[{"a": 1}, {"a": 2}]'))) == 2
    with pytest.raises(InvalidInput, match="list of objects"):
        read_specs(write(tmp_path, "u.json", '{"a": 1}'))


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read"):
        read_specs(tmp_path / "missing.jsonl")
