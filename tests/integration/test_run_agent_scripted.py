"""The agent loop end to end on real environments, driven by a scripted model.

The bundled 135M model almost never calls tools, so these tests script the model's replies
(a stand-in for a tool-using LLM, which cannot run on this machine) to exercise every tool,
both call formats, retries, and the osworld mode against the desktop provider's stand-in.
Stores, pools, sandboxes, the web server and the search index are all real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from support import bubblewrap

from rollfleet.envs import EnvSpec, build_env_source
from rollfleet.errors import failure_kind
from rollfleet.model import RolloutSpec, RolloutStatus
from rollfleet.runner.runner import Runner
from rollfleet.store import SqlStore, open_sql_store

pytestmark = pytest.mark.timeout(120)
Script = Callable[[list[dict[str, Any]]], dict[str, Any]]


class ScriptedLLM:
    """An ``openai.AsyncOpenAI`` look-alike whose replies come from a script of the conversation."""

    def __init__(self, script: Script, fail_first: int = 0) -> None:
        self.script, self.fail_first, self.requests = script, fail_first, []  # type: ignore[var-annotated]
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> ChatCompletion:
        self.requests.append(kwargs)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise openai.APIConnectionError(
                request=httpx.Request("POST", "http://engine/v1/chat/completions")
            )
        reply = self.script(kwargs["messages"])
        message = {
            "role": "assistant",
            "content": reply.get("content"),
            "tool_calls": reply.get("tool_calls"),
        }
        return ChatCompletion.model_validate(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "scripted",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            }
        )


def turn_of(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if m["role"] == "assistant")


@pytest.fixture
async def store(tmp_path: Path) -> SqlStore:
    s = open_sql_store(f"sqlite:///{tmp_path}/s.db")
    yield s
    await s.close()


async def run_all(
    store: SqlStore,
    specs: list[RolloutSpec],
    llm: Callable[[Any], Any],
    env: Any,
    concurrency: int = 2,
) -> list[Any]:
    made = await store.enqueue_many(specs)
    runner = Runner(
        store,
        "rollfleet.agents.loop:agent",
        worker_id="w",
        concurrency=concurrency,
        llm_factory=llm,
        env=env,
    )
    task = asyncio.create_task(runner.run())
    done = await store.wait_for_rollouts([r.rollout_id for r in made], 60)
    runner.stop()
    await asyncio.wait_for(task, 30)
    if env is not None:
        await env.close()
    return done


def spec(mode: str, task: dict[str, Any], **run: Any) -> RolloutSpec:
    return RolloutSpec(
        input=task,
        mode=mode,
        metadata={"run": {"max_turns": 6, "max_retries": 2, **run}},
        config={"max_attempts": 1},
    )


def browse_script(messages: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [
        'CALL open_url {"url": "/index.html"}',
        'CALL click {"link": "About us"}',
        'CALL find {"text": "cat"}',
        "CALL back {}",
        "The cat is in the page above.\nANSWER: Binnacle",
    ]
    return {"content": steps[turn_of(messages)]}


async def test_web_tools_plain_text(store: SqlStore) -> None:
    task = {"question": "What is the name of the shop cat?", "answer": "Binnacle"}
    llm = ScriptedLLM(browse_script)
    [done] = await run_all(
        store, [spec("web", task)], lambda r: llm, build_env_source(EnvSpec(mode="web"))
    )
    assert done.status is RolloutStatus.SUCCEEDED, done.error
    assert done.result.reward == 1.0 and done.result.output["answer"] == "Binnacle"
    observations = [m["content"] for m in done.result.output["messages"] if m["role"] == "user"][1:]
    assert "Harbourside Books" in observations[0] and "[3] About us" in observations[0]
    assert "Finn Alder" in observations[1]
    assert observations[2] == "Observation from find:\nThe shop cat is called Binnacle."
    assert "An independent bookshop" in observations[3]  # back to the home page
    steps = (await store.query_steps(done.rollout_id)).items
    assert [s.kind for s in steps] == ["env"] + ["turn"] * 5 + ["reward"]
    assert steps[0].payload["pool"] == "web" and steps[0].payload["endpoint"].startswith(
        "http://127.0.0.1:"
    )
    assert steps[-1].payload["reward"] == 1.0 and done.result.metrics["tool_calls"] == 4.0
    # the bundled model gets its tools as text only: `tools=` would add the gateway's own section
    assert (
        "tools" not in llm.requests[0] and "open_url" in llm.requests[0]["messages"][0]["content"]
    )
    assert all(r["stop"] == ["\nUser:"] for r in llm.requests)  # a reply ends at a made-up turn


def native_rag_script(messages: list[dict[str, Any]]) -> dict[str, Any]:
    turn = turn_of(messages)
    if turn == 0:
        return {
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "search",
                        "arguments": json.dumps({"query": "last keeper lighthouse"}),
                    },
                }
            ],
        }
    if turn == 1:
        assert messages[-1]["role"] == "tool" and "[varrow-lighthouse]" in messages[-1]["content"]
        return {
            "content": None,
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {
                        "name": "read",
                        "arguments": json.dumps({"doc_id": "varrow-lighthouse"}),
                    },
                }
            ],
        }
    assert "Agnes Moor" in messages[-1]["content"]
    return {"content": "ANSWER: Agnes Moor"}


async def test_rag_tools_native_calls(store: SqlStore) -> None:
    task = {
        "question": "Who was the last keeper of Stennick Lighthouse?",
        "answers": ["Agnes Moor"],
    }
    llm = ScriptedLLM(native_rag_script)
    [done] = await run_all(  # a served model (--engine URL): its tools go as OpenAI `tools=` too
        store,
        [spec("rag", task, model="served-model")],
        lambda r: llm,
        build_env_source(EnvSpec(mode="rag")),
    )
    assert done.status is RolloutStatus.SUCCEEDED, done.error
    assert done.result.reward == 1.0 and done.result.metrics["turns"] == 3.0
    assert done.result.output["messages"][2]["tool_calls"][0]["function"]["name"] == "search"
    assert llm.requests[0]["tools"][0]["function"]["name"] == "search"
    assert llm.requests[0]["model"] == "served-model"


async def test_retries_on_engine_errors_and_unreadable_calls(store: SqlStore) -> None:
    def garbled(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"content": 'CALL search {"query": '}  # never readable

    task = {"question": "q?", "answers": ["x"]}
    flaky, bad = ScriptedLLM(native_rag_script, fail_first=2), ScriptedLLM(garbled)
    clients = iter([flaky, bad])
    done = await run_all(
        store,
        [spec("rag", {**task, "answers": ["Agnes Moor"]}), spec("rag", task, max_retries=1)],
        lambda r: next(clients),
        build_env_source(EnvSpec(mode="rag")),
        concurrency=1,
    )
    assert done[0].result.reward == 1.0 and done[0].result.metrics["retries"] == 2.0
    assert len(flaky.requests) == 5  # two failures, then three turns
    assert done[1].status is RolloutStatus.SUCCEEDED and done[1].result.metrics["turns"] == 1.0
    assert (
        len(bad.requests) == 2 and done[1].result.reward == 0.0
    )  # gave up: the reply became the answer


async def test_engine_that_keeps_failing_fails_the_rollout(store: SqlStore) -> None:
    llm = ScriptedLLM(browse_script, fail_first=10)
    [done] = await run_all(
        store, [spec("math", {"question": "1+1?", "answer": 2}, max_retries=1)], lambda r: llm, None
    )
    assert done.status is RolloutStatus.FAILED and "the engine failed 2 times" in done.error
    assert (
        failure_kind(done.status.value, done.error) == "infrastructure"
    )  # an engine down is no wrong answer


def code_script(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": "```python\ndef add(a, b):\n    return a + b\n```"}


async def test_py_solution_is_scored_by_the_judge(store: SqlStore) -> None:
    bubblewrap()
    task = {"prompt": "Add.", "entry_point": "add", "tests": ["add(2, 3) == 5", "add(-1, 1) == 0"]}
    [done] = await run_all(
        store,
        [spec("py", task)],
        lambda r: ScriptedLLM(code_script),
        build_env_source(EnvSpec(mode="py")),
    )
    assert done.status is RolloutStatus.SUCCEEDED, done.error
    assert done.result.reward == 1.0 and done.result.output["score"]["passed"] == 2


async def test_a_broken_sandbox_is_an_infrastructure_failure_not_a_zero(store: SqlStore) -> None:
    bubblewrap()
    task = {"prompt": "Add.", "entry_point": "add", "tests": ["add(2, 3) == 5"]}
    # a real sandbox with a broken interpreter: it runs, and says nothing
    env = build_env_source(EnvSpec(mode="py", sandbox={"python": "/usr/bin/true"}))
    made = RolloutSpec(
        input=task, mode="py", metadata={"run": {"max_turns": 2}}, config={"max_attempts": 2}
    )
    [done] = await run_all(store, [made], lambda r: ScriptedLLM(code_script), env)
    assert done.status is RolloutStatus.FAILED and done.result is None and done.num_attempts == 2
    assert done.error.startswith("infrastructure: PoolError") and "check failed" in done.error
    assert failure_kind(done.status.value, done.error) == "infrastructure"


def desktop_script(messages: list[dict[str, Any]]) -> dict[str, Any]:
    task = messages[1]["content"][0]["text"]  # the task, then the reset screenshot
    text = "hello" if "hello" in task else "2024-06-01"
    if turn_of(messages) == 0:
        return {
            "content": json.dumps(
                {"name": "execute", "arguments": {"code": f"pyautogui.write('{text}')"}}
            ).join(["<tool_call>", "</tool_call>"])
        }
    return {"content": "DONE"}


async def test_osworld_standin_n_rollouts_share_m_desktops(store: SqlStore) -> None:
    path = Path(str(resources.files("rollfleet.examples").joinpath("osworld_standin.jsonl")))
    tasks = [json.loads(line) for line in path.read_text().splitlines()] * 3
    env = build_env_source(
        EnvSpec(
            mode="osworld",
            use_pool=True,
            num_instances=2,
            standin=True,
            desktop={"action_space": "pyautogui"},
        ),
        concurrency=3,
    )
    done = await run_all(
        store,
        [spec("osworld", t) for t in tasks],
        lambda r: ScriptedLLM(desktop_script),
        env,
        concurrency=3,
    )
    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 6, [r.error for r in done]
    assert [r.result.reward for r in done] == [1.0] * 6
    stats = env.stats()  # type: ignore[union-attr]
    assert stats.size == 2 and stats.acquired == 6


async def test_osworld_standin_wrong_text_scores_zero(store: SqlStore) -> None:
    def typo(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"content": 'CALL typing {"text": "helo"}' if turn_of(messages) == 0 else "DONE"}

    env = build_env_source(
        EnvSpec(mode="osworld", standin=True, desktop={"action_space": "computer_13"})
    )
    task = {"id": "t", "instruction": "Type hello", "expected": "hello"}
    [done] = await run_all(store, [spec("osworld", task)], lambda r: ScriptedLLM(typo), env)
    assert done.status is RolloutStatus.SUCCEEDED and done.result.reward == 0.0
    assert (
        done.result.metrics["tool_calls"] == 1.0
        and "screen changed" in done.result.output["messages"][3]["content"]
    )
