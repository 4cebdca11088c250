"""``osworld``: OSWorld desktop tasks through the pool's ``desktop`` provider.

Task: OSWorld's own format, ``{"id": str, "instruction": str, "config": [...], "evaluator": {...}}``
(any extra fields pass through to ``DesktopEnv.reset(task_config=...)``).

What the model sees (the ``observation`` run option, OSWorld's observation types):
``screenshot`` (default) sends the reset screenshot with the task and each step's screenshot
after the tool result, as image parts; ``a11y_tree`` sends the accessibility tree as text only
(for engines that cannot see); ``screenshot_a11y_tree`` both.

Tools follow the action space: ``computer_13`` → one tool per OSWorld action (see
:mod:`rollfleet.envs.computer13`, arguments validated); ``pyautogui`` → ``execute`` with a
snippet that is parsed and refused unless it is only ``pyautogui.<fn>(literal args)`` calls and
``time.sleep`` (:mod:`rollfleet.pool.providers.pyautogui_code`); it is never run here, only sent
to the VM through ``DesktopEnv.step``. Both spaces have ``wait``, ``fail`` and ``done``. The
reward is ``DesktopEnv.evaluate()`` after the episode ends (the agent's ``done``/``fail``, or a
final reply, which counts as DONE, or FAIL when it says FAIL), run on the VM; blocking
DesktopEnv calls run in threads.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollfleet.envs.base import (
    EnvSpec,
    Observation,
    Score,
    Tool,
    Transcript,
    handle_of,
    require_fields,
)
from rollfleet.envs.computer13 import COMPUTER_13_TOOLS, CONTROL, CONTROL_TOOLS, to_action
from rollfleet.errors import InvalidInput, PoolError
from rollfleet.pool.base import EnvSource
from rollfleet.pool.providers.pyautogui_code import RefusedCode, parse

OBSERVATION_LIMIT = 4000
OBSERVATIONS = ("screenshot", "a11y_tree", "screenshot_a11y_tree")
_PYAUTOGUI = [
    Tool(
        "execute",
        "run a pyautogui snippet on the desktop: only pyautogui.<function>(literal arguments) "
        "calls and time.sleep(seconds)",
        {"code": "python using pyautogui"},
    )
]


def action_space_of(desktop: Any) -> str:
    """The DesktopEnv's action space (``pyautogui`` or ``computer_13``)."""
    space = getattr(desktop, "action_space", None) or getattr(desktop, "kwargs", {}).get(
        "action_space"
    )
    return str(space or "pyautogui")


def screen_of(desktop: Any) -> tuple[int, int]:
    """The desktop's screen size in pixels (OSWorld's 1920×1080 when it does not say)."""
    size = getattr(desktop, "screen_size", None) or getattr(desktop, "kwargs", {}).get(
        "screen_size"
    )
    return (int(size[0]), int(size[1])) if size else (1920, 1080)


def to_desktop_action(name: str, args: dict[str, Any], screen: tuple[int, int]) -> Any:
    """A tool call as a DesktopEnv action: checked pyautogui code, a computer_13 dict, or
    WAIT/FAIL/DONE; InvalidInput (or RefusedCode) when it cannot be sent."""
    if name == "execute":
        code = args.get("code")
        if not isinstance(code, str) or not code.strip():
            raise InvalidInput("execute: argument 'code' must be a non-empty string")
        parse(code)  # refuses anything but pyautogui calls with literal arguments
        return code
    return to_action(name, args, screen)


class View:
    """Turns DesktopEnv observations into what the model is shown, per observation type."""

    def __init__(self, observation: str) -> None:
        """Show ``observation`` (one of OBSERVATIONS)."""
        if observation not in OBSERVATIONS:
            raise InvalidInput(
                f"osworld: observation {observation!r}; the observations are "
                + ", ".join(OBSERVATIONS)
            )
        self.observation = observation

    def __call__(self, obs: Any, done: bool = False) -> Observation:
        """The Observation for one DesktopEnv observation."""
        obs = obs if isinstance(obs, dict) else {}
        parts, images = [], []
        if "a11y_tree" in self.observation:
            tree = obs.get("accessibility_tree")
            parts.append(
                str(tree)[:OBSERVATION_LIMIT] if tree else "no accessibility tree came back"
            )
        if "screenshot" in self.observation:
            shot = obs.get("screenshot")
            if isinstance(shot, (bytes, bytearray)) and shot:
                images.append(bytes(shot))
                parts.append("the screen changed; its screenshot follows")
            else:
                parts.append("no screenshot (is the VM running?)")
        if done:
            parts.append("(the episode is over)")
        return Observation("\n".join(parts), tuple(images), done)


class OSWorldSession:
    """Drives one leased desktop."""

    def __init__(self, task: dict[str, Any], desktop: Any, view: View, first: Any = None) -> None:
        """Act on ``desktop`` for ``task`` (already reset to it; ``first`` is the reset's
        observation)."""
        self.task, self.desktop, self.view = task, desktop, view
        space = _PYAUTOGUI if action_space_of(desktop) == "pyautogui" else COMPUTER_13_TOOLS
        self.tools: list[Tool] = [*space, *CONTROL_TOOLS]
        self.first = view(first) if first is not None else None
        self.ended: str | None = None

    async def call(self, name: str, args: dict[str, Any]) -> str | Observation:
        """Apply one action on the desktop."""
        if name not in {t.name for t in self.tools}:
            known = ", ".join(t.name for t in self.tools)
            return f"error: unknown tool {name!r}; the tools are {known}"
        try:
            action = to_desktop_action(name, args, screen_of(self.desktop))
        except RefusedCode as exc:
            return f"error: refused, not sent to the desktop: {exc}"
        except InvalidInput as exc:
            return f"error: {exc}"
        obs, _reward, done, _info = await asyncio.to_thread(self.desktop.step, action)
        if action in CONTROL and action != "WAIT":
            self.ended, done = str(action), True
        return self.view(obs, bool(done))

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """End the episode (DONE, or FAIL when the answer says so) unless the agent did, then
        run the task's evaluator on the VM."""
        if self.ended is None:
            self.ended = "FAIL" if answer.strip().upper() == "FAIL" else "DONE"
            await asyncio.to_thread(self.desktop.step, self.ended)
        reward = float(await asyncio.to_thread(self.desktop.evaluate))
        return Score(
            reward=reward,
            correct=reward >= 1.0,
            details={"evaluator": "DesktopEnv.evaluate", "ended": self.ended},
        )


def desktop_options(desktop: dict[str, Any]) -> Any:
    """The OSWorld options (``DesktopOptions``) from ``--provider-name`` and the others;
    InvalidInput naming the flag and what it takes, never a validation traceback."""
    from pydantic import ValidationError

    from rollfleet.pool import DesktopOptions

    try:
        return DesktopOptions(**desktop)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "desktop"
        said = first["msg"].replace("Input should be", "must be")
        flag = f"--{name.replace('_', '-')}"
        raise InvalidInput(f"{flag} {desktop.get(name, '')!r}: {said}") from None


def desktop_provider(spec: EnvSpec) -> Any:
    """The desktop provider for ``spec`` (the stand-in, for tests, when ``spec.standin``)."""
    from rollfleet.pool import DesktopEnvStandIn, DesktopProvider

    options = desktop_options(spec.desktop)
    if spec.standin:
        return DesktopProvider(
            options, env_class=DesktopEnvStandIn, which=lambda tool: f"/standin/{tool}"
        )
    return DesktopProvider(options)


class OSWorldMode:
    """OSWorld tasks on VMs leased from the desktop pool."""

    name = "osworld"
    uses_tools = True
    observations = OBSERVATIONS
    pools_instances = True  # --use-vm-pool shares num_instances among one process's rollouts
    shares_process = False  # one runner process per rollout, unless a pool shares the VMs

    def __init__(self, observation: str | None = None) -> None:
        """Show the model ``observation`` (default ``screenshot``)."""
        self.view = View(observation or "screenshot")

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
        seen = {
            "screenshot": "You see the screen as a screenshot after each action.",
            "a11y_tree": "You see the screen as its accessibility tree after each action.",
            "screenshot_a11y_tree": "You see a screenshot and the accessibility tree after "
            "each action.",
        }[self.view.observation]
        return (
            "You operate an Ubuntu desktop to complete the user's task. "
            f"{seen} Act with the tools, one action per turn; when the task is complete, call "
            "done (or reply DONE); if it cannot be done, call fail."
        )

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The instruction."""
        return str(task["instruction"])

    async def open(self, task: dict[str, Any], env: Any) -> OSWorldSession:
        """Reset the leased VM to the task and wrap it, keeping the reset's observation."""
        desktop = handle_of(env)
        if desktop is None or not hasattr(desktop, "step"):
            raise PoolError("osworld mode needs a desktop leased from the pool as ctx.env")
        first = await asyncio.to_thread(desktop.reset, task_config=task)
        return OSWorldSession(task, desktop, self.view, first)

    def env_source(self, spec: EnvSpec, concurrency: int) -> EnvSource:
        """VMs from the desktop provider, one per rollout or a pool of ``num_instances``."""
        from rollfleet.pool import env_source

        return env_source(
            desktop_provider(spec),
            use_pool=spec.use_pool,
            num_instances=spec.num_instances,
            concurrency=concurrency,
            pool_name="osworld",
        )

    def preflight(self, spec: EnvSpec, local: bool) -> None:
        """Without a remote control plane, a hypervisor (or the stand-in) must be here."""
        if local:
            desktop_provider(spec).preflight()
