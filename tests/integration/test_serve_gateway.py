"""The control plane serving the llama.cpp engine at /v1: an agent's LLM calls become Steps of its attempt."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import require

from rollfleet.client import HttpStore
from rollfleet.compose import EngineOptions, control_plane_parts
from rollfleet.engines.gateway.client import llm_client
from rollfleet.model import AttemptStatus
from rollfleet.server.embedded import ServerThread

pytestmark = [pytest.mark.timeout(180), pytest.mark.llamacpp]


def llama_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        from rollfleet.engines.llamacpp.model import bundled_gguf

        return bundled_gguf().exists()
    except Exception:
        return False


async def test_llm_calls_are_recorded_as_steps(tmp_path: Path) -> None:
    require(
        llama_available(), "llama-cpp-python and the bundled SmolLM2 model (rollfleet[llamacpp])"
    )
    server = ServerThread(
        f"sqlite:///{tmp_path}/g.db", parts=control_plane_parts(engine=EngineOptions("llamacpp"))
    ).start(timeout=120)
    try:
        store = HttpStore(server.url)
        await store.enqueue_rollout({"question": "2+2"}, "math")
        rollout = (await store.claim("w1"))[0]
        async with llm_client(server.url, rollout.rollout_id, rollout.attempt.attempt_id) as llm:
            reply = await llm.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "What is 2+2?"}],
                max_tokens=8,
                temperature=0,
            )
        assert reply.choices[0].message.content
        steps = (await store.query_steps(rollout.rollout_id)).items
        assert [s.kind for s in steps] == ["llm"]
        payload = steps[0].payload
        assert payload["completion_token_ids"] and payload["prompt_token_ids"]
        assert len(payload["completion_token_ids"]) == reply.usage.completion_tokens
        await store.complete(rollout.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        await store.close()
    finally:
        server.stop()


def test_status_shows_each_engine_and_its_weights_version(tmp_path: Path) -> None:
    require(
        llama_available(), "llama-cpp-python and the bundled SmolLM2 model (rollfleet[llamacpp])"
    )
    import subprocess
    import sys

    server = ServerThread(
        f"sqlite:///{tmp_path}/s.db", parts=control_plane_parts(engine=EngineOptions("llamacpp"))
    ).start(timeout=120)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rollfleet.cli", "status", "--store", server.url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**__import__("os").environ, "COLUMNS": "200"},
        )
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    assert "Engines (1)" in done.stdout and "weights version" in done.stdout
    row = next(
        line for line in done.stdout.splitlines() if "llamacpp" in line and "SmolLM2" in line
    )
    assert "│ 0 " in row and "0/" in row


async def test_a_push_shows_its_version_in_the_dashboard_models_and_status(tmp_path: Path) -> None:
    """After a trainer's push, every view of the engines says the new version: the dashboard's
    engine panel data, /v1/models, and ``rollfleet status``."""
    import asyncio
    import importlib.util
    import os
    import subprocess
    import sys

    import httpx

    require(
        bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch")),
        "transformers and torch",
    )
    from rollfleet.engines.tiny import tiny_hf_model
    from rollfleet.engines.weights.push import push_weights

    server = ServerThread(
        f"sqlite:///{tmp_path}/s.db", parts=control_plane_parts(engine=EngineOptions("hf"))
    )
    await asyncio.to_thread(server.start, 120)
    try:
        answer = await push_weights(
            server.url, tiny_hf_model(seed=3)[0].state_dict().items(), version=4
        )
        assert answer["version"] == 4
        async with httpx.AsyncClient(base_url=server.url) as client:
            panel = (await client.get("/dashboard/api/extras/engines")).json()
            models = (await client.get("/v1/models")).json()
        assert [e["weights_version"] for e in panel["items"]] == [4]
        assert [m["weights_version"] for m in models["data"]] == [4]
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "rollfleet.cli", "status", "--store", server.url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "COLUMNS": "200"},
        )
    finally:
        await asyncio.to_thread(server.stop)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if "hf-0" in line or " hf " in line)
    assert " 4 " in row, done.stdout
