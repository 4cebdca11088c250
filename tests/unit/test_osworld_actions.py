"""OSWorld mode's actions against the desktop stand-in: all of computer_13, checked pyautogui code,
the observation types, the options' errors. The stand-in is the accepted stand-in for a VM."""

from __future__ import annotations

import io
from typing import Any

import pytest
from PIL import Image

from rollfleet.envs import check_observation, get_mode
from rollfleet.envs.base import Observation
from rollfleet.envs.osworld import OSWorldMode, OSWorldSession, desktop_options
from rollfleet.errors import InvalidInput
from rollfleet.pool.providers.desktop import DesktopEnvStandIn
from rollfleet.pool.providers.pyautogui_code import RefusedCode, parse

TASK = {"id": "t", "instruction": "Type hello", "expected": "hello"}


async def session(space: str = "computer_13", observation: str = "screenshot") -> OSWorldSession:
    """A session on a fresh stand-in desktop (1280×720), reset to TASK."""
    desktop = DesktopEnvStandIn(action_space=space, screen_size=(1280, 720))
    return await OSWorldMode(observation).open(TASK, desktop)


# (tool, arguments, the action DesktopEnv.step must get)
COMPUTER_13 = [
    (
        "move_to",
        {"x": 10, "y": 20},
        {"action_type": "MOVE_TO", "parameters": {"x": 10.0, "y": 20.0}},
    ),
    ("click", {}, {"action_type": "CLICK", "parameters": {}}),
    (
        "click",
        {"x": 5, "y": 6, "button": "right", "num_clicks": 2},
        {
            "action_type": "CLICK",
            "parameters": {"x": 5.0, "y": 6.0, "button": "right", "num_clicks": 2},
        },
    ),
    (
        "mouse_down",
        {"button": "left"},
        {"action_type": "MOUSE_DOWN", "parameters": {"button": "left"}},
    ),
    ("mouse_up", {}, {"action_type": "MOUSE_UP", "parameters": {}}),
    (
        "right_click",
        {"x": 7, "y": 8},
        {"action_type": "RIGHT_CLICK", "parameters": {"x": 7.0, "y": 8.0}},
    ),
    ("double_click", {}, {"action_type": "DOUBLE_CLICK", "parameters": {}}),
    (
        "drag_to",
        {"x": "300", "y": 400.5},
        {"action_type": "DRAG_TO", "parameters": {"x": 300.0, "y": 400.5}},
    ),
    ("scroll", {"dx": 0, "dy": -3}, {"action_type": "SCROLL", "parameters": {"dx": 0, "dy": -3}}),
    ("typing", {"text": "hello"}, {"action_type": "TYPING", "parameters": {"text": "hello"}}),
    ("press", {"key": "Enter"}, {"action_type": "PRESS", "parameters": {"key": "enter"}}),
    ("key_down", {"key": "shift"}, {"action_type": "KEY_DOWN", "parameters": {"key": "shift"}}),
    ("key_up", {"key": "shift"}, {"action_type": "KEY_UP", "parameters": {"key": "shift"}}),
    (
        "hotkey",
        {"keys": ["ctrl", "s"]},
        {"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "s"]}},
    ),
    ("wait", {}, "WAIT"),
]


async def test_every_computer_13_action_reaches_desktop_step_as_osworld_spells_it() -> None:
    s = await session()
    names = {t.name for t in s.tools}
    assert names == {
        "move_to",
        "click",
        "mouse_down",
        "mouse_up",
        "right_click",
        "double_click",
        "drag_to",
        "scroll",
        "typing",
        "press",
        "key_down",
        "key_up",
        "hotkey",
        "wait",
        "fail",
        "done",
    }
    for name, args, action in COMPUTER_13:
        result = await s.call(name, args)
        assert isinstance(result, Observation) and not result.done, (name, result)
        assert s.desktop.actions[-1] == action, name
    state = s.desktop.state
    assert state.text == "hello\n" and state.cursor == (300.0, 400.5) and state.scrolled == (0, -3)
    assert state.clicks[1] == (5.0, 6.0, "right", 2) and state.hotkeys == [["ctrl", "s"]]
    assert state.held == set()  # shift went down and up again; the left button too


async def test_fail_ends_the_episode_and_is_not_overwritten_by_done() -> None:
    s = await session()
    result = await s.call("fail", {})
    assert isinstance(result, Observation) and result.done and "episode is over" in result.text
    score = await s.score("fail")
    assert (
        s.desktop.actions == ["FAIL"] and score.details["ended"] == "FAIL" and score.reward == 0.0
    )


async def test_a_final_reply_ends_with_done_and_is_scored() -> None:
    s = await session()
    await s.call("typing", {"text": "hello"})
    score = await s.score("DONE")
    assert s.desktop.actions[-1] == "DONE" and score.reward == 1.0 and score.correct


@pytest.mark.parametrize(
    ("name", "args", "error"),
    [
        ("move_to", {"x": 10}, "argument 'y' is missing"),
        ("click", {"x": 10}, "give x and y together"),
        ("move_to", {"x": 5000, "y": 1}, "x must be between 0 and 1280"),
        ("move_to", {"x": "left", "y": 1}, "x must be a number"),
        ("click", {"button": "thumb"}, "button must be left, right or middle"),
        ("click", {"num_clicks": 4}, "num_clicks must be 1, 2 or 3"),
        ("scroll", {"dx": 1.5, "dy": 0}, "dx must be a whole number"),
        ("press", {"key": "hyper"}, "'hyper' is not a key name"),
        ("hotkey", {"keys": []}, "non-empty list of key names"),
        ("typing", {"text": "a", "speed": 2}, "unknown argument 'speed'"),
        ("execute", {"code": "pyautogui.click()"}, "unknown tool 'execute'"),
    ],
)
async def test_bad_computer_13_arguments_are_refused_before_the_desktop(
    name: str, args: dict[str, Any], error: str
) -> None:
    s = await session()
    result = await s.call(name, args)
    assert isinstance(result, str) and result.startswith("error:") and error in result, result
    assert s.desktop.actions == []


async def test_pyautogui_snippets_are_sent_to_the_desktop_and_performed_there() -> None:
    s = await session("pyautogui")
    assert [t.name for t in s.tools] == ["execute", "wait", "fail", "done"]
    code = (
        "import pyautogui\nimport time\npyautogui.moveTo(100, 200)\npyautogui.click(button='right')\n"
        "time.sleep(0.5)\npyautogui.write('hello')\npyautogui.hotkey('ctrl', 's')\npyautogui.scroll(-2)"
    )
    result = await s.call("execute", {"code": code})
    assert isinstance(result, Observation) and s.desktop.actions == [code]
    state = s.desktop.state
    assert state.text == "hello" and state.clicks == [(100.0, 200.0, "right", 1)]
    assert state.hotkeys == [["ctrl", "s"]] and state.scrolled == (0, -2)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("import os\nos.system('rm -rf /')", "`import os` is not allowed"),
        ("__import__('os').system('id')", "a call to __import__('os').system is not allowed"),
        (
            "pyautogui.click()\nopen('/etc/passwd').read()",
            "line 2: a call to open('/etc/passwd').read",
        ),
        ("subprocess.run(['id'])", "subprocess.run is not allowed"),
        ("pyautogui.screenshot('/tmp/x.png')", "pyautogui.screenshot is not allowed"),
        ("pyautogui.click(x=len('ab'), y=1)", "argument 'x' of pyautogui.click is not a literal"),
        ("pyautogui.FAILSAFE = False", "a Assign statement is not allowed"),
        ("from pyautogui import click", "`from pyautogui import …` is not allowed"),
        ("import pyautogui as os", "`import pyautogui` is not allowed"),
        ("for i in range(3): pyautogui.press('a')", "a For statement is not allowed"),
        ("pyautogui.write(*['a'])", "argument 1 of pyautogui.write is not a literal"),
        ("time.sleep(3600)", "outside 0 to 60 seconds"),
        ("pyautogui.click(", "not valid Python"),
    ],
)
async def test_disallowed_pyautogui_code_is_refused_and_never_sent(code: str, error: str) -> None:
    with pytest.raises(RefusedCode, match="allowed|literal|seconds|Python") as refused:
        parse(code)
    assert error in str(refused.value)
    s = await session("pyautogui")
    result = await s.call("execute", {"code": code})
    assert isinstance(result, str) and result.startswith("error: refused, not sent to the desktop")
    assert error in result and s.desktop.actions == []


def test_parse_keeps_literal_arguments() -> None:
    [click, sleep] = parse("pyautogui.click(10, -5, clicks=2)\ntime.sleep(1)")
    assert (click.fn, click.args, click.kwargs) == ("click", (10, -5), {"clicks": 2})
    assert click.arg(2, "clicks") == 2 and (sleep.module, sleep.args) == ("time", (1,))


def png_of(observation: Observation) -> Image.Image:
    [png] = observation.images
    return Image.open(io.BytesIO(png))


async def test_standin_screenshots_are_real_pngs_that_change_with_the_actions() -> None:
    s = await session()
    assert s.first is not None and "its screenshot follows" in s.first.text
    first = png_of(s.first)
    assert first.format == "PNG" and first.size == (1280, 720)
    typed = await s.call("typing", {"text": "hello"})
    clicked = await s.call("click", {"x": 640, "y": 360})
    assert isinstance(typed, Observation) and isinstance(clicked, Observation)
    shots = [first, png_of(typed), png_of(clicked)]
    assert len({im.tobytes() for im in shots}) == 3  # each action shows on the screen
    # the click drew a ring around (640, 360): pixels there differ from the typed-only screen
    before, after = shots[1].crop((620, 340, 660, 380)), shots[2].crop((620, 340, 660, 380))
    assert before.tobytes() != after.tobytes()


@pytest.mark.parametrize(
    ("observation", "tree", "images"),
    [("screenshot", False, 1), ("a11y_tree", True, 0), ("screenshot_a11y_tree", True, 1)],
)
async def test_observation_types(observation: str, tree: bool, images: int) -> None:
    s = await session(observation=observation)
    result = await s.call("typing", {"text": "hi"})
    assert isinstance(result, Observation) and len(result.images) == images
    assert ('<text-editor name="editor" focused="true">hi</text-editor>' in result.text) is tree
    assert s.first is not None and len(s.first.images) == images


def test_observation_option_is_checked_per_mode() -> None:
    assert check_observation("osworld", None) is None
    assert check_observation("web", "both") == "both"
    with pytest.raises(
        InvalidInput, match="osworld takes screenshot, a11y_tree, screenshot_a11y_tree"
    ):
        get_mode("osworld", "som")
    with pytest.raises(InvalidInput, match="web takes text, screenshot, both"):
        check_observation("web", "a11y_tree")
    with pytest.raises(
        InvalidInput, match="--observation is for the osworld and web modes, not 'math'"
    ):
        get_mode("math", "screenshot")


def test_an_unknown_provider_name_lists_the_valid_ones() -> None:
    with pytest.raises(InvalidInput) as bad:
        desktop_options({"provider_name": "qemu"})
    assert (
        str(bad.value)
        == "--provider-name 'qemu': must be 'vmware', 'virtualbox', 'docker' or 'aws'"
    )
    assert desktop_options({"provider_name": "docker"}).provider_name == "docker"


def test_history_counts_an_image_by_a_fixed_budget_not_its_base64() -> None:
    from rollfleet.agents.loop import IMAGE_CHARS, fit_history, message_size, task_message

    shot = Observation("the screen", (b"\x89PNG" + b"x" * 50_000,))
    first = task_message("Type hello", shot)
    assert first["content"][0] == {"type": "text", "text": "Type hello\n\nthe screen"}
    assert message_size(first) == len("Type hello\n\nthe screen") + IMAGE_CHARS
    turns = [{"role": "assistant", "content": f"turn {i}"} for i in range(8)]
    screens = [{"role": "user", "content": first["content"][1:]} for _ in range(8)]
    history = [
        {"role": "system", "content": "s"},
        first,
        *[m for pair in zip(turns, screens, strict=True) for m in pair],
    ]
    kept = fit_history(history)
    assert kept[:2] == history[:2] and kept[-1] is history[-1]
    assert len(kept) == 2 + 6  # the 3 last turns and their screenshots fit 4,500 characters
