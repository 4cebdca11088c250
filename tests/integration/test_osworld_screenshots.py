"""OSWorld agents that see, through the real Runner, store and desktop pool, on the desktop stand-in
(the accepted stand-in for a VM; its screenshots are real PNGs). A scripted engine plays the model
(no vision model runs here) and keeps every request, so the tests read what the model was shown."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from PIL import Image

from rollfleet.envs import EnvSpec, build_env_source
from rollfleet.model import RolloutSpec, RolloutStatus
from rollfleet.runner.runner import Runner
from rollfleet.store import SqlStore, open_sql_store

pytestmark = pytest.mark.timeout(120)
TASK = {"id": "type-hello", "instruction": "Type hello into the editor.", "expected": "hello"}


class Engine:
    """Answers turn N with ``calls[N]`` (native tool calls), or a final DONE past the end."""

    def __init__(self, calls: list[tuple[str, dict[str, Any]]]) -> None:
        self.calls, self.requests = calls, []  # type: ignore[var-annotated]
        self.chat = self.completions = self

    async def create(self, **request: Any) -> ChatCompletion:
        self.requests.append(json.loads(json.dumps(request["messages"])))
        turn = len(self.requests) - 1
        message: dict[str, Any] = {"role": "assistant", "content": "DONE"}
        if turn < len(self.calls):
            name, args = self.calls[turn]
            call = {
                "id": f"c{turn}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return ChatCompletion.model_validate(
            {
                "id": f"r{turn}",
                "object": "chat.completion",
                "created": 0,
                "model": "scripted",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


@pytest.fixture
async def store(tmp_path: Path) -> SqlStore:
    s = open_sql_store(f"sqlite:///{tmp_path}/s.db")
    yield s
    await s.close()


async def rollout(
    store: SqlStore, engine: Engine, space: str, observation: str | None = None
) -> Any:
    """One osworld rollout of TASK on a stand-in desktop through a real Runner."""
    run = {
        "max_turns": 8,
        "max_retries": 0,
        **({"observation": observation} if observation else {}),
    }
    [made] = await store.enqueue_many(
        [RolloutSpec(input=TASK, mode="osworld", metadata={"run": run}, config={"max_attempts": 1})]
    )
    env = build_env_source(
        EnvSpec(
            mode="osworld",
            standin=True,
            desktop={"action_space": space, "screen_width": 640, "screen_height": 360},
        )
    )
    runner = Runner(
        store,
        "rollfleet.agents.loop:agent",
        worker_id="w",
        concurrency=1,
        llm_factory=lambda r: engine,
        env=env,
    )
    task = asyncio.create_task(runner.run())
    [done] = await store.wait_for_rollouts([made.rollout_id], 60)
    runner.stop()
    await asyncio.wait_for(task, 30)
    await env.close()  # type: ignore[union-attr]
    assert done.status is RolloutStatus.SUCCEEDED, done.error
    return done


def images_in(message: dict[str, Any]) -> list[Image.Image]:
    """The PNGs of a message's image parts, decoded."""
    parts = message["content"] if isinstance(message["content"], list) else []
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    return [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]


def digest(image: Image.Image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


async def test_the_model_sees_the_reset_screenshot_then_one_new_screenshot_after_each_tool_result(
    store: SqlStore,
) -> None:
    engine = Engine([("click", {"x": 320, "y": 180}), ("typing", {"text": "hello"}), ("done", {})])
    done = await rollout(store, engine, "computer_13")
    assert done.result.reward == 1.0 and done.result.output["score"]["ended"] == "DONE"
    assert len(engine.requests) == 3  # the done tool ended the episode: no fourth model call
    first = engine.requests[0][1]
    assert first["role"] == "user" and first["content"][0] == {
        "type": "text",
        "text": "Type hello into the editor.\n\nthe screen changed; its screenshot follows",
    }
    [reset_shot] = images_in(first)
    assert reset_shot.format == "PNG" and reset_shot.size == (640, 360)
    seen = [digest(reset_shot)]
    for turn in (1, 2):
        *_, call, result, shot = engine.requests[turn]
        assert call["role"] == "assistant" and call["tool_calls"][0]["id"] == f"c{turn - 1}"
        assert result == {
            "role": "tool",
            "tool_call_id": f"c{turn - 1}",
            "content": "the screen changed; its screenshot follows",
        }
        assert shot["role"] == "user" and shot["content"][0]["text"].startswith("Screenshot after ")
        [image] = images_in(shot)
        seen.append(digest(image))
    assert len(set(seen)) == 3  # a new image each step: the click ring, then the typed text
    turns = [
        s.payload for s in (await store.query_steps(done.rollout_id)).items if s.kind == "turn"
    ]
    assert [t["tool_calls"][0]["images"] for t in turns] == [1, 1, 1]
    assert "base64" not in json.dumps(turns)  # Steps name how many images, never carry them


async def test_a11y_tree_observation_is_text_only_for_engines_that_cannot_see(
    store: SqlStore,
) -> None:
    engine = Engine([("typing", {"text": "hello"})])
    done = await rollout(store, engine, "computer_13", observation="a11y_tree")
    assert done.result.reward == 1.0
    sent = json.dumps(engine.requests)
    assert "image_url" not in sent and all(
        isinstance(m["content"], (str, type(None))) for r in engine.requests for m in r
    )
    assert (
        '<text-editor name="editor" focused="true"></text-editor>'
        in engine.requests[0][1]["content"]
    )
    assert (
        '<text-editor name="editor" focused="true">hello</text-editor>'
        in engine.requests[1][-1]["content"]
    )


async def test_pyautogui_code_runs_on_the_desktop_and_a_disallowed_snippet_is_refused(
    store: SqlStore,
) -> None:
    engine = Engine(
        [
            ("execute", {"code": "import os\nos.system('touch /tmp/pwned')"}),
            ("execute", {"code": "__import__('os')"}),
            ("execute", {"code": "pyautogui.write('hello')"}),
        ]
    )
    done = await rollout(store, engine, "pyautogui")
    refused = [engine.requests[1][-1], engine.requests[2][-1]]
    assert all(
        m["role"] == "tool" and m["content"].startswith("error: refused, not sent to the desktop")
        for m in refused
    )
    assert "`import os` is not allowed" in refused[0]["content"]
    assert "a call to __import__ is not allowed" in refused[1]["content"]
    assert not Path("/tmp/pwned").exists()
    assert done.result.reward == 1.0  # the allowed snippet typed hello on the desktop
    assert [m["role"] for m in engine.requests[3][-2:]] == [
        "tool",
        "user",
    ]  # its screenshot follows
