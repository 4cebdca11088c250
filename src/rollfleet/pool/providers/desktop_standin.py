"""A stand-in for OSWorld's ``DesktopEnv`` on machines with no VM: same calls, real screenshots.

:class:`DesktopEnvStandIn` keeps a small desktop state (the text typed into an editor, the
cursor, clicks, drags, scrolling, held keys and buttons) and applies every ``computer_13``
action to it, and every ``pyautogui`` snippet too (parsed by
:mod:`~rollfleet.pool.providers.pyautogui_code`, never run). Its screenshots are PNGs drawn
with Pillow from that state (a step counter and the last action included, so each step's
screenshot differs); its accessibility tree is a small XML text. ``evaluate`` scores 1.0 when
the editor holds the task's ``expected`` text.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from rollfleet.errors import PoolError
from rollfleet.pool.providers.pyautogui_code import Call, RefusedCode, parse


def _at(call: Call) -> dict[str, Any]:
    x, y = call.arg(0, "x"), call.arg(1, "y")
    return {"x": x, "y": y} if x is not None and y is not None else {}


def _keys(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(k) for k in value or []]


def computer13_of(call: Call, cursor: tuple[float, float]) -> list[dict[str, Any]]:
    """The computer_13 actions a parsed pyautogui call amounts to (none for ``time.sleep``)."""
    fn, x0, y0 = call.fn, cursor[0], cursor[1]
    if call.module == "time":
        return []
    if fn in ("moveTo", "dragTo"):
        return [
            {"action_type": "MOVE_TO" if fn == "moveTo" else "DRAG_TO", "parameters": _at(call)}
        ]
    if fn in ("moveRel", "move", "dragRel", "drag"):
        to = {"x": x0 + (call.arg(0, "xOffset") or 0), "y": y0 + (call.arg(1, "yOffset") or 0)}
        return [
            {"action_type": "MOVE_TO" if fn.startswith("move") else "DRAG_TO", "parameters": to}
        ]
    clicks = {"click": "CLICK", "rightClick": "RIGHT_CLICK", "doubleClick": "DOUBLE_CLICK"}
    if fn in clicks:
        params = _at(call)
        if fn == "click":
            params |= {
                "num_clicks": call.arg(2, "clicks", 1),
                "button": call.arg(4, "button", "left"),
            }
        return [{"action_type": clicks[fn], "parameters": params}]
    if fn in ("tripleClick", "middleClick"):
        extra = {"num_clicks": 3} if fn == "tripleClick" else {"button": "middle"}
        return [{"action_type": "CLICK", "parameters": _at(call) | extra}]
    if fn in ("mouseDown", "mouseUp"):
        button = {"button": call.arg(2, "button", "left")}
        moved = [{"action_type": "MOVE_TO", "parameters": _at(call)}] if _at(call) else []
        return [
            *moved,
            {"action_type": fn.replace("mouse", "MOUSE_").upper(), "parameters": button},
        ]
    if fn in ("scroll", "vscroll", "hscroll"):
        amount = int(call.arg(0, "clicks", 0))
        delta = {"dx": amount, "dy": 0} if fn == "hscroll" else {"dx": 0, "dy": amount}
        return [{"action_type": "SCROLL", "parameters": delta}]
    if fn in ("write", "typewrite"):
        message = call.arg(0, "message", "")
        if isinstance(message, str):
            return [{"action_type": "TYPING", "parameters": {"text": message}}]
        return [{"action_type": "PRESS", "parameters": {"key": k}} for k in _keys(message)]
    if fn == "press":
        keys = _keys(call.arg(0, "keys")) * int(call.arg(1, "presses", 1))
        return [{"action_type": "PRESS", "parameters": {"key": k}} for k in keys]
    if fn in ("keyDown", "keyUp"):
        kind = "KEY_DOWN" if fn == "keyDown" else "KEY_UP"
        return [{"action_type": kind, "parameters": {"key": call.arg(0, "key")}}]
    return [{"action_type": "HOTKEY", "parameters": {"keys": [str(k) for k in call.args]}}]


@dataclass
class Screen:
    """What the stand-in desktop shows."""

    text: str = ""
    cursor: tuple[float, float] = (0.0, 0.0)
    clicks: list[tuple[float, float, str, int]] = field(default_factory=list)
    drags: list[tuple[tuple[float, float], tuple[float, float]]] = field(default_factory=list)
    scrolled: tuple[int, int] = (0, 0)
    held: set[str] = field(default_factory=set)
    hotkeys: list[list[str]] = field(default_factory=list)
    last: str = "reset"

    def apply(self, action_type: str, p: dict[str, Any]) -> None:
        """Apply one computer_13 action."""
        if "x" in p and "y" in p and action_type != "DRAG_TO":
            self.cursor = (float(p["x"]), float(p["y"]))
        if action_type in ("CLICK", "RIGHT_CLICK", "DOUBLE_CLICK"):
            button = "right" if action_type == "RIGHT_CLICK" else str(p.get("button") or "left")
            count = 2 if action_type == "DOUBLE_CLICK" else int(p.get("num_clicks") or 1)
            self.clicks.append((*self.cursor, button, count))
        elif action_type == "DRAG_TO":
            to = (float(p["x"]), float(p["y"]))
            self.drags.append((self.cursor, to))
            self.cursor = to
        elif action_type in ("MOUSE_DOWN", "KEY_DOWN"):
            self.held.add(str(p.get("button") or p.get("key") or "left"))
        elif action_type in ("MOUSE_UP", "KEY_UP"):
            self.held.discard(str(p.get("button") or p.get("key") or "left"))
        elif action_type == "SCROLL":
            self.scrolled = (self.scrolled[0] + int(p["dx"]), self.scrolled[1] + int(p["dy"]))
        elif action_type == "TYPING":
            self.text += str(p["text"])
        elif action_type == "PRESS":
            key = str(p["key"])
            self.text = self.text[:-1] if key == "backspace" else self.text + _typed(key)
        elif action_type == "HOTKEY":
            self.hotkeys.append([str(k) for k in p["keys"]])
        self.last = f"{action_type} {p}" if p else action_type

    def png(self, size: tuple[int, int], step: int) -> bytes:
        """The screen as a PNG of ``size`` pixels."""
        try:
            from PIL import Image, ImageDraw
        except ImportError as exc:
            raise PoolError(
                "the desktop stand-in draws screenshots with Pillow: pip install pillow"
            ) from exc
        image = Image.new("RGB", size, (222, 226, 230))
        draw = ImageDraw.Draw(image)
        w, h = size
        draw.rectangle((w // 10, h // 10, w * 9 // 10, h * 7 // 10), fill="white", outline="gray")
        draw.multiline_text((w // 10 + 12, h // 10 + 12), self.text or " ", fill="black")
        for x, y, button, count in self.clicks[-20:]:
            r = 4 + 3 * count
            draw.ellipse(
                (x - r, y - r, x + r, y + r), outline="blue" if button == "left" else "red"
            )
        for a, b in self.drags[-10:]:
            draw.line((a, b), fill="green", width=3)
        x, y = self.cursor
        draw.line((x - 10, y, x + 10, y), fill="black", width=2)
        draw.line((x, y - 10, x, y + 10), fill="black", width=2)
        status = f"step {step} | {self.last} | held {sorted(self.held)} | scrolled {self.scrolled}"
        draw.text((8, h - 20), status[:200], fill="black")
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()

    def a11y_tree(self) -> str:
        """A small accessibility tree as XML text."""
        x, y = self.cursor
        return (
            '<desktop-frame name="stand-in desktop">\n'
            f'  <text-editor name="editor" focused="true">{escape(self.text)}</text-editor>\n'
            f'  <pointer x="{x:g}" y="{y:g}" held={quoteattr(",".join(sorted(self.held)))}/>\n'
            "</desktop-frame>"
        )


def _typed(key: str) -> str:
    if key in ("enter", "return", "\n", "\r"):
        return "\n"
    if key in ("space", " "):
        return " "
    if key in ("tab", "\t"):
        return "\t"
    return key if len(key) == 1 else ""


class _StandInController:
    def __init__(self, env: DesktopEnvStandIn) -> None:
        self._env = env

    def get_screenshot(self) -> bytes | None:
        """A PNG of the screen, or None when the VM is down."""
        if self._env.closed or self._env.crashed:
            return None
        return self._env.state.png(self._env.size, self._env.steps)


class DesktopEnvStandIn:
    """Behaves like OSWorld's DesktopEnv (reset/step/evaluate/close) with no VM behind it.

    ``actions`` records every action ``step`` got (computer_13 dicts, pyautogui code, WAIT,
    FAIL, DONE); ``screen`` is the editor's text, which ``evaluate`` compares with the task's
    ``expected`` text.
    """

    def __init__(self, **kwargs: Any) -> None:
        """Accept DesktopEnv's keyword arguments."""
        self.kwargs = kwargs
        self.vm_ip, self.server_port = "127.0.0.1", 5000
        size = kwargs.get("screen_size") or (1920, 1080)
        self.size = (int(size[0]), int(size[1]))
        self.state = Screen()
        self.task_config: dict[str, Any] | None = None
        self.closed = self.crashed = False
        self.resets = self.steps = 0
        self.actions: list[Any] = []
        self.errors: list[str] = []
        self.controller = _StandInController(self)

    @property
    def screen(self) -> str:
        """The text typed into the editor."""
        return self.state.text

    def _obs(self) -> dict[str, Any]:
        task = self.task_config or {}
        tree = self.state.a11y_tree() if self.kwargs.get("require_a11y_tree", True) else None
        return {
            "screenshot": self.controller.get_screenshot(),
            "accessibility_tree": tree,
            "instruction": task.get("instruction"),
        }

    def reset(
        self, task_config: dict[str, Any] | None = None, seed: Any = None, options: Any = None
    ) -> dict[str, Any]:
        """Revert to the snapshot (an empty editor); remember the task."""
        if self.closed:
            raise RuntimeError("DesktopEnv is closed")
        self.state, self.task_config, self.crashed = Screen(), task_config, False
        self.resets += 1
        return self._obs()

    def step(
        self, action: Any, pause: float = 0
    ) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        """Apply one action; returns (obs, reward, done, info) like DesktopEnv."""
        if self.closed or self.crashed:
            raise RuntimeError("the VM is not running")
        self.steps += 1
        self.actions.append(action)
        if action in ("WAIT", "DONE", "FAIL"):
            self.state.last = str(action)
            return self._obs(), 0.0, action != "WAIT", {"done": action}
        if isinstance(action, dict):
            params = action.get("parameters")
            if params is None:
                params = {k: v for k, v in action.items() if k != "action_type"}
            self.state.apply(str(action.get("action_type")), dict(params))
        elif isinstance(action, str):
            self._run(action)
        return self._obs(), 0.0, False, {}

    def _run(self, code: str) -> None:
        try:
            calls = parse(code)
        except RefusedCode as exc:  # a VM would fail to run it; the stand-in refuses it
            self.errors.append(str(exc))
            return
        for call in calls:
            for action in computer13_of(call, self.state.cursor):
                self.state.apply(action["action_type"], action["parameters"])

    def evaluate(self) -> float:
        """1.0 when the editor shows the task's ``expected`` text, else 0.0."""
        expected = (self.task_config or {}).get("expected")
        return 1.0 if expected is not None and self.screen == expected else 0.0

    def close(self) -> None:
        """Stop the 'VM'."""
        self.closed = True
