"""``rollfleet serve --engine``: cancelling a running rollout also ends its generation in the gateway.

The control plane is built the way ``rollfleet serve --engine hf`` builds it (``control_plane``
with ``EngineOptions``), served over HTTP, with the transformers engine on a tiny random model
(no download). Asked for 100,000 tokens it would run for many minutes (750 tokens/s at best here,
slower as the text grows), so a generation that ends within a minute was stopped. A test client
plays the runner: it claims the rollout and streams a
generation through the gateway as that rollout's attempt, and the batch is then aborted (or its
straggler cancelled by the ``cancel`` policy) through the coordinator's HTTP API.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.client import HttpStore
from rollfleet.compose import EngineOptions, control_plane_parts
from rollfleet.coordinator import CoordinatorClient
from rollfleet.engines.gateway.client import llm_client
from rollfleet.model import AttemptStatus, Rollout, RolloutResult, RolloutStatus
from rollfleet.server.embedded import ServerThread

pytestmark = pytest.mark.timeout(240)
HAVE_HF = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"))
MAX_TOKENS = 100_000
GENERATION_BOUND_S = 60.0  # far less than the whole generation takes; far more than an abort


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    require(HAVE_HF, "transformers and torch (rollfleet[hf])")
    monkeypatch.setenv("ROLLFLEET_HOME", str(tmp_path / "home"))  # the coordinator's experiences
    parts = control_plane_parts(engine=EngineOptions("hf"))
    server = ServerThread(f"sqlite:///{tmp_path}/serve.db", parts=parts)
    await asyncio.to_thread(server.start, 120)
    try:
        yield server.url
    finally:
        await asyncio.to_thread(server.stop)


async def generate_while(
    url: str, rollout: Rollout, stop: Callable[[], Awaitable[Any]]
) -> tuple[str | None, int, Any]:
    """Stream a long generation as ``rollout``'s attempt; after its first tokens, run ``stop()``
    (concurrently: the stream is read meanwhile). Returns the finish reason, the number of
    tokens streamed and what ``stop()`` returned."""
    assert rollout.attempt is not None
    stopping: asyncio.Task[Any] | None = None
    tokens, reason = 0, None
    async with llm_client(url, rollout.rollout_id, rollout.attempt.attempt_id) as llm:
        stream = await llm.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "count forever"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len((choice.model_extra or {}).get("token_ids") or [])
                reason = choice.finish_reason or reason
            if stopping is None and tokens > 0:
                stopping = asyncio.create_task(stop())
    assert stopping is not None, "the generation produced no token"
    return reason, tokens, await stopping


async def stopped_generation(
    url: str, rollout: Rollout, stop: Awaitable[Any]
) -> tuple[str | None, int, Any]:
    """:func:`generate_while`, failing the test if the generation is still running after a minute."""
    try:
        return await asyncio.wait_for(
            generate_while(url, rollout, lambda: stop), GENERATION_BOUND_S
        )
    except TimeoutError:
        pytest.fail(
            f"the generation ran on for {GENERATION_BOUND_S:.0f}s: cancelling its rollout did not abort it"
        )


async def test_aborting_a_batch_ends_its_rollouts_generation_with_partial_tokens(
    served: str,
) -> None:
    coordinator, store = CoordinatorClient(served), HttpStore(served)
    try:
        await coordinator.submit_batch("abort-me", [{"q": 1}])
        (rollout,) = await store.claim("test-runner")
        aborted = coordinator.abort_batch("abort-me", reason="trainer moved on")
        reason, tokens, result = await stopped_generation(served, rollout, aborted)
        assert reason == "abort" and 1 <= tokens < MAX_TOKENS
        assert result.batch_id == "abort-me"
        assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.CANCELLED
    finally:
        await coordinator.close()
        await store.close()


async def test_the_cancel_policy_ends_a_stragglers_generation_with_partial_tokens(
    served: str,
) -> None:
    coordinator, store = CoordinatorClient(served), HttpStore(served)
    try:
        await coordinator.submit_batch(
            "train-0", [{"q": 1}, {"q": 2}], min_wait_num=1, policy="cancel"
        )
        done, straggler = sorted(
            await store.claim("test-runner", max_n=2), key=lambda r: r.input["q"]
        )
        assert done.attempt is not None
        await store.complete(
            done.attempt.attempt_id, AttemptStatus.SUCCEEDED, RolloutResult(reward=1.0)
        )
        finalized = coordinator.finalize_train_batch("train-0", timeout=120)
        reason, tokens, result = await stopped_generation(served, straggler, finalized)
        assert reason == "abort" and 1 <= tokens < MAX_TOKENS
        assert result.finished_task_count == 1
        assert (await store.get_rollout(straggler.rollout_id)).status is RolloutStatus.CANCELLED
    finally:
        await coordinator.close()
        await store.close()
