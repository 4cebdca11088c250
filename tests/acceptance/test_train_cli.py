"""``rollfleet train`` refuses bad input at start-up with one line naming what is wrong (exit 2),
before anything is written: no output directory appears."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


ONE_TASK = '{"question": "1+1?", "answer": 2}\n'


def one_task(data: Path) -> None:
    """A valid data file of one task."""
    data.write_text(ONE_TASK)


def model_dir(data: Path, *files: str) -> None:
    """One task, and beside it a directory ``model`` holding ``files``: a transformers
    config.json of a Llama, the others empty."""
    one_task(data)
    model = data.with_name("model")
    model.mkdir()
    for name in files:
        text = '{"model_type": "llama"}' if name == "config.json" else ""
        (model / name).write_text(text)


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (
            one_task,
            ["--mode", "nope"],
            "unknown mode 'nope'; the modes are",
        ),
        (lambda d: d.write_text(""), ["--mode", "math"], "no tasks in the file"),
        (
            lambda d: d.write_text(ONE_TASK + '{"answer": 3}\n'),
            ["--mode", "math"],
            ":2",
        ),
        (
            one_task,
            ["--mode", "math", "--group-size", "0"],
            "--group-size must be at least 1",
        ),
        (
            one_task,
            ["--mode", "math", "--max-staleness", "-1"],
            "--max-staleness must be 0 to 1000",
        ),
        (
            one_task,
            ["--mode", "math", "--engine", "http://127.0.0.1:9/v1"],
            "a remote OpenAI-compatible server cannot take weights",
        ),
        (
            one_task,
            ["--mode", "math", "--engine", "vllm"],
            "--engine 'vllm': choose one of llamacpp, hf",
        ),
        (
            lambda d: (
                one_task(d),
                d.with_name("eval.jsonl").write_text('{"question": "2+2?"}\n'),
            ),
            ["--mode", "math", "--eval-data", "EVAL"],
            "eval.jsonl:1",
        ),
        (
            one_task,
            ["--mode", "math", "--estimator", "ppo"],
            "unknown advantage estimator 'ppo'",
        ),
        (
            one_task,
            ["--mode", "math", "--max-turns", "0"],
            "--max-turns must be at least 1",
        ),
        (
            lambda d: d.write_text('{"question": "Who?", "answers": ["Ada"]}\n'),
            ["--mode", "rag", "--max-turns", "1"],
            "--mode rag gives the model tools",
        ),
        (
            one_task,
            ["--mode", "math", "--report-to", "wandb"],
            "--report-to 'wandb': the one choice is tensorboard",
        ),
        (
            one_task,
            ["--mode", "math", "--trainer", "ppo"],
            "--trainer 'ppo': choose builtin or trl",
        ),
        (
            one_task,
            ["--mode", "math", "--trainer", "trl", "--max-staleness", "1"],
            "--max-staleness must be 0",
        ),
        (
            one_task,
            ["--mode", "math", "--lora-rank", "-1"],
            "--lora-rank must be 0",
        ),
        (
            one_task,
            ["--mode", "math", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
            "--model HuggingFaceTB/SmolLM2-135M-Instruct: no such local file or directory",
        ),
        (
            one_task,
            ["--mode", "math", "--model", "MODEL"],
            "model: no such local file or directory (train downloads nothing",
        ),
        (
            lambda d: model_dir(d, "model.safetensors"),
            ["--mode", "math", "--model", "MODEL"],
            "model: a directory without config.json",
        ),
        (
            lambda d: model_dir(d, "config.json"),
            ["--mode", "math", "--model", "MODEL", "--engine", "hf"],
            "model: no weights beside config.json",
        ),
        (
            lambda d: model_dir(d, "config.json", "model.safetensors"),
            ["--mode", "math", "--model", "MODEL"],
            "the llama.cpp engine serves GGUF files only",
        ),
        (
            lambda d: model_dir(d, "config.json", "model.safetensors"),
            ["--mode", "math", "--model", "MODEL", "--engine", "hf"],
            "model: its tokenizer has no chat template",
        ),
        (
            lambda d: (one_task(d), d.with_name("model").write_text("not a GGUF\n")),
            ["--mode", "math", "--model", "MODEL", "--engine", "hf"],
            "model: not a GGUF file",
        ),
        (
            lambda d: (one_task(d), d.with_name("model").write_bytes(b"GGUF")),
            ["--mode", "math", "--model", "MODEL", "--trainer", "trl"],
            "--model: --trainer trl trains the bundled model only",
        ),
    ],
)
def test_bad_input_is_one_clear_line_and_writes_nothing(
    tmp_path: Path, make, args, message
) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "tasks.jsonl"
    make(data)
    out = tmp_path / "out"
    paths = {"EVAL": str(tmp_path / "eval.jsonl"), "MODEL": str(tmp_path / "model")}
    args = [paths.get(a, a) for a in args]
    done = train("--data", str(data), "--output-dir", str(out), *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not out.exists()
