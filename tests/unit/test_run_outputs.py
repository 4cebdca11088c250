"""Summary statistics, pass@k, deterministic rollout ids and the data-file checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollfleet.envs import get_mode
from rollfleet.envs.tasks import TaskLine, load_tasks
from rollfleet.errors import InvalidInput
from rollfleet.run.outputs import summarize
from rollfleet.run.tasks import build_specs, rollout_id, run_key
from rollfleet.stats import pass_at_k, percentile


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(2, 1, 2) == 1.0


def test_percentile() -> None:
    with pytest.raises(ValueError):
        percentile([], 0.5)
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.95) == pytest.approx(9.5)


def _record(line: int, reward: float | None, correct: bool, status: str = "succeeded") -> dict:
    return {
        "line": line,
        "status": status,
        "reward": reward,
        "correct": correct,
        "tokens": {"prompt": 10, "completion": 5},
        "timings": {"latency_s": float(line)},
        "rollout_id": f"r{line}",
    }


def test_summarize_counts_rewards_and_pass_at_k() -> None:
    records = [
        _record(1, 1.0, True),
        _record(1, 0.0, False),
        _record(2, 0.0, False),
        _record(2, 0.0, False),
        _record(3, None, False, "failed"),
        _record(3, 1.0, True),
    ]
    summary = summarize(records, samples=2, wall_s=10.0, ran_now=4, completion_tokens_now=20)
    assert summary["counts"] == {"succeeded": 5, "failed": 1}
    assert summary["reward"]["mean"] == pytest.approx(0.4) and summary["reward"]["n"] == 5
    assert summary["tokens"] == {"prompt": 60, "completion": 30}
    assert summary["tokens_per_s"] == 2.0 and summary["kept_from_before"] == 2
    # task 3 has only one succeeded sample, so pass@2 cannot be estimated for every task
    assert summary["pass_at_k"] == {"pass@1": pytest.approx((0.5 + 0.0 + 1.0) / 3)}
    assert "pass_at_k" not in summarize(
        records, samples=1, wall_s=1.0, ran_now=0, completion_tokens_now=0
    )


def test_rollout_ids_are_stable_and_distinct(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    key = run_key(path, "math")
    assert key == run_key(tmp_path / "." / "d.jsonl", "math") != run_key(path, "rag")
    line = TaskLine(3, {"question": "q", "answer": 1})
    assert rollout_id(key, line, 0) == rollout_id(
        key, TaskLine(3, {"answer": 1, "question": "q"}), 0
    )
    assert rollout_id(key, line, 0) != rollout_id(key, line, 1)
    assert rollout_id(key, line, 0) != rollout_id(
        key, TaskLine(3, {"question": "q", "answer": 2}), 0
    )
    specs = build_specs(
        [line, TaskLine(4, {"question": "r", "answer": 2})],
        path=path,
        mode="math",
        samples=3,
        settings={"max_turns": 1},
    )
    assert len({s.rollout_id for s in specs}) == 6
    assert {s.group_id for s in specs} == {key}
    assert specs[0].metadata == {"run": {"max_turns": 1}, "data": str(path), "line": 3, "sample": 0}


def test_load_tasks_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"question": "q", "answer": 1}) + "\n\n" + json.dumps({"question": "q"}) + "\n"
    )
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:3: field 'answer' is missing"):
        load_tasks(path, get_mode("math"))
    path.write_text('{"question": "q", "answer": 1}\n{"question": \n')
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:2: not valid JSON"):
        load_tasks(path, get_mode("math"))
    with pytest.raises(InvalidInput, match="no such file"):
        load_tasks(tmp_path / "missing.jsonl", get_mode("math"))
    with pytest.raises(InvalidInput, match="must be .json or .jsonl"):
        load_tasks(tmp_path / "tasks.csv", get_mode("math"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"question": "a", "answer": 1}, {"question": "b", "answer": 2}]))
    assert [t.lineno for t in load_tasks(good, get_mode("math"), limit=1)] == [1]


def test_bundled_examples_are_valid() -> None:
    from importlib import resources

    root = Path(str(resources.files("rollfleet.examples")))
    sizes = {
        mode: len(load_tasks(root / f"{name}.jsonl", get_mode(mode)))
        for mode, name in [
            ("math", "math"),
            ("py", "py"),
            ("rag", "rag"),
            ("web", "web"),
            ("osworld", "osworld_standin"),
        ]
    }
    assert sizes["math"] >= 50 and sizes["py"] >= 30 and sizes["rag"] >= 10 and sizes["web"] >= 10


def test_failures_are_counted_by_kind_and_never_scored() -> None:
    from rollfleet.errors import failure_kind

    infra = {
        **_record(4, None, False, "failed"),
        "failure": failure_kind("failed", "infrastructure: SandboxError: x"),
    }
    agent = {
        **_record(5, None, False, "failed"),
        "failure": failure_kind("failed", "ValueError: bad"),
    }
    lost = {
        **_record(6, None, False, "failed"),
        "failure": failure_kind("failed", "lease expired: no heartbeat"),
    }
    summary = summarize(
        [_record(1, 1.0, True), _record(2, 0.0, False), infra, agent, lost],
        samples=1,
        wall_s=1.0,
        ran_now=5,
        completion_tokens_now=5,
    )
    assert summary["failures"] == {"infrastructure": 2, "agent": 1}
    assert summary["accuracy"] == 0.5  # of the two scored rollouts; a failure is not a wrong answer
    assert summary["reward"]["n"] == 2
