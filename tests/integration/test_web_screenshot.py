"""Web agents on pixels: the bundled site rendered in the machine's real headless Chromium (Debian's,
driven by Playwright; nothing is downloaded), through the real Runner and store. A scripted engine
plays the model (no vision model runs here) and keeps what it was shown."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from PIL import Image
from support import chromium_path, require

from rollfleet.envs import EnvSpec, build_env_source
from rollfleet.envs.web import WebMode, WebSite
from rollfleet.envs.web_render import find_chromium
from rollfleet.errors import PoolError
from rollfleet.model import RolloutSpec, RolloutStatus
from rollfleet.run.options import RunOptions
from rollfleet.run.orchestrate import preflight
from rollfleet.runner.runner import Runner
from rollfleet.store import open_sql_store

pytestmark = pytest.mark.timeout(120)
TASK = {"question": "What is the name of the shop cat?", "answer": "Binnacle"}
REPLIES = [
    'CALL open_url {"url": "/index.html"}',
    'CALL click {"link": "About us"}',
    "ANSWER: Binnacle",
]


def chromium() -> None:
    """Skip (fail under ROLLFLEET_REQUIRE_ALL=1) without Chromium and Playwright."""
    chromium_path()
    try:
        find_chromium()
    except PoolError as exc:
        require(False, str(exc))


class PlainTextModel:
    """Replies REPLIES in turn in the plain-text protocol; keeps every request's messages."""

    def __init__(self) -> None:
        self.seen: list[list[dict[str, Any]]] = []
        self.chat = self.completions = self

    async def create(self, **request: Any) -> ChatCompletion:
        self.seen.append(request["messages"])
        reply = REPLIES[len(self.seen) - 1]
        choice = {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": reply},
        }
        return ChatCompletion(
            id="x", object="chat.completion", created=0, model="m", choices=[choice]
        )  # type: ignore[list-item]


async def browse(tmp_path: Path, observation: str) -> tuple[Any, PlainTextModel]:
    """One web rollout of TASK showing ``observation``, through a real Runner."""
    store = open_sql_store(f"sqlite:///{tmp_path}/s.db")
    model, env = PlainTextModel(), build_env_source(EnvSpec(mode="web"))
    try:
        [made] = await store.enqueue_many(
            [
                RolloutSpec(
                    input=TASK,
                    mode="web",
                    metadata={"run": {"max_turns": 5, "observation": observation}},
                )
            ]
        )
        runner = Runner(
            store,
            "rollfleet.agents.loop:agent",
            worker_id="w",
            llm_factory=lambda r: model,
            env=env,
        )
        running = asyncio.create_task(runner.run())
        [done] = await store.wait_for_rollouts([made.rollout_id], 60)
        runner.stop()
        await asyncio.wait_for(running, 30)
    finally:
        await env.close()  # type: ignore[union-attr]
        await store.close()
    assert done.status is RolloutStatus.SUCCEEDED, done.error
    return done, model


def screenshot(message: dict[str, Any]) -> Image.Image:
    """The one PNG in a user message of screenshots."""
    assert message["role"] == "user" and message["content"][0]["type"] == "text"
    [url] = [p["image_url"]["url"] for p in message["content"] if p["type"] == "image_url"]
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


async def test_web_screenshot_observation_shows_each_page_rendered_by_chromium(
    tmp_path: Path,
) -> None:
    chromium()
    done, model = await browse(tmp_path, "screenshot")
    assert done.result.reward == 1.0 and len(model.seen) == 3
    home_text, home_shot = model.seen[1][-2:]
    about_text, about_shot = model.seen[2][-2:]
    assert (
        home_text["content"]
        == "Observation from open_url:\nHarbourside Books (/index.html); its screenshot follows"
    )
    assert (
        about_text["content"]
        == "Observation from click:\nAbout us (/about.html); its screenshot follows"
    )
    home, about = screenshot(home_shot), screenshot(about_shot)
    assert home.size == about.size == (1024, 768) and home.format == "PNG"
    assert home.tobytes() != about.tobytes()  # a new page, a new picture
    assert len(home.convert("L").getcolors(1 << 16) or []) > 8  # rendered text, not a blank page
    assert isinstance(model.seen[0][1]["content"], str)  # web shows nothing before the first action


async def test_web_both_observation_keeps_the_text_and_adds_the_screenshot(tmp_path: Path) -> None:
    chromium()
    done, model = await browse(tmp_path, "both")
    text, shot = model.seen[2][-2:]
    assert "Finn Alder" in text["content"] and "Links:" in text["content"]
    assert screenshot(shot).size == (1024, 768)


async def test_web_text_observation_starts_no_chromium(tmp_path: Path) -> None:
    site = WebSite().start()
    try:
        session = await WebMode().open(TASK, site)
        assert isinstance(await session.call("open_url", {"url": "/index.html"}), str)
        assert site._renderer._renderer is None  # text (the default) never starts a browser
    finally:
        site.close()


async def test_missing_chromium_with_the_screenshot_observation_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLFLEET_CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(
        PoolError, match="web screenshots need Chromium, and there is none at .*no-chromium"
    ):
        preflight(RunOptions(mode="web", data=tmp_path / "t.jsonl", observation="screenshot"))
    preflight(RunOptions(mode="web", data=tmp_path / "t.jsonl"))  # text needs no Chromium
    site = WebSite().start()
    try:
        session = await WebMode("screenshot").open(TASK, site)
        with pytest.raises(PoolError, match="apt-get install chromium"):
            await session.call("open_url", {"url": "/index.html"})
    finally:
        site.close()
