"""``osworld``: OSWorld desktop tasks through the pool's ``desktop`` provider.

Task: OSWorld's own format, ``{"id": str, "instruction": str, "config": [...], "evaluator": {...}}``
(any extra fields pass through to ``DesktopEnv.reset(task_config=...)``). Tools follow the
action space: ``pyautogui`` → ``execute`` (a pyautogui snippet); ``computer_13`` →
``type_text``, ``press_key``, ``click_at``. The reward is ``DesktopEnv.evaluate()`` after the
agent's final answer, run on the VM; blocking DesktopEnv calls run in threads.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollfleet.envs.base import Score, Tool, handle_of, require_fields
from rollfleet.errors import InvalidInput, PoolError

OBSERVATION_LIMIT = 2000
_COMPUTER_13 = [
    Tool("type_text", "type text with the keyboard", {"text": "what to type"}),
    Tool("press_key", "press one key", {"key": "a key name such as enter"}),
    Tool(
        "click_at",
        "click at screen coordinates",
        {"x": "pixels from the left", "y": "pixels from the top"},
    ),
]
_PYAUTOGUI = [
    Tool("execute", "run a pyautogui snippet on the desktop", {"code": "python using pyautogui"})
]


def action_space_of(desktop: Any) -> str:
    """The DesktopEnv's action space (``pyautogui`` or ``computer_13``)."""
    space = getattr(desktop, "action_space", None) or getattr(desktop, "kwargs", {}).get(
        "action_space"
    )
    return str(space or "pyautogui")


def to_action(name: str, args: dict[str, Any]) -> Any:
    """A tool call as a DesktopEnv action; InvalidInput for an unknown tool."""
    if name == "execute":
        return str(args.get("code", ""))
    if name == "type_text":
        return {
            "action_type": "TYPING",
            "parameters": {"text": str(args.get("text", ""))},
            "text": str(args.get("text", "")),
        }
    if name == "press_key":
        return {"action_type": "PRESS", "parameters": {"key": str(args.get("key", ""))}}
    if name == "click_at":
        return {
            "action_type": "CLICK",
            "parameters": {"x": int(args.get("x", 0)), "y": int(args.get("y", 0))},
        }
    raise InvalidInput(f"unknown desktop tool {name!r}")


def describe(obs: Any) -> str:
    """An observation as text: the accessibility tree when there is one."""
    if isinstance(obs, dict):
        tree = obs.get("accessibility_tree")
        if tree:
            return str(tree)[:OBSERVATION_LIMIT]
        return (
            "the screen changed" if obs.get("screenshot") else "no screenshot (is the VM running?)"
        )
    return str(obs)[:OBSERVATION_LIMIT]


class OSWorldSession:
    """Drives one leased desktop."""

    def __init__(self, task: dict[str, Any], desktop: Any) -> None:
        """Act on ``desktop`` for ``task`` (already reset to it)."""
        self.task, self.desktop = task, desktop
        self.tools = _PYAUTOGUI if action_space_of(desktop) == "pyautogui" else _COMPUTER_13

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Apply one action on the desktop."""
        if name not in {t.name for t in self.tools}:
            known = ", ".join(t.name for t in self.tools)
            return f"error: unknown tool {name!r}; the tools are {known}"
        try:
            action = to_action(name, args)
        except (ValueError, InvalidInput) as exc:
            return f"error: {exc}"
        obs, _reward, done, _info = await asyncio.to_thread(self.desktop.step, action)
        return describe(obs) + ("\n(the episode is over)" if done else "")

    async def score(self, answer: str) -> Score:
        """Run the task's evaluator on the VM."""
        await asyncio.to_thread(self.desktop.step, "DONE")
        reward = float(await asyncio.to_thread(self.desktop.evaluate))
        return Score(
            reward=reward, correct=reward >= 1.0, details={"evaluator": "DesktopEnv.evaluate"}
        )


class OSWorldMode:
    """OSWorld tasks on VMs leased from the desktop pool."""

    name = "osworld"

    def check(self, task: Any, where: str) -> None:
        """OSWorld's ``id`` and ``instruction``; ``config`` a list and ``evaluator`` an object if
        given."""
        require_fields(task, where, {"id": str, "instruction": str})
        if not isinstance(task.get("config", []), list):
            raise InvalidInput(f"{where}: field 'config' must be a list")
        if not isinstance(task.get("evaluator", {}), dict):
            raise InvalidInput(f"{where}: field 'evaluator' must be an object")

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Explain the desktop."""
        return (
            "You operate an Ubuntu desktop to complete the user's task. Act with the tools, one "
            "action per turn; when the task is complete, reply DONE."
        )

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The instruction."""
        return str(task["instruction"])

    async def open(self, task: dict[str, Any], env: Any) -> OSWorldSession:
        """Reset the leased VM to the task and wrap it."""
        desktop = handle_of(env)
        if desktop is None or not hasattr(desktop, "step"):
            raise PoolError("osworld mode needs a desktop leased from the pool as ctx.env")
        await asyncio.to_thread(desktop.reset, task_config=task)
        return OSWorldSession(task, desktop)
