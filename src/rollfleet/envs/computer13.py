"""OSWorld's ``computer_13`` action space as tools with validated parameters.

The 13 actions of OSWorld's ``desktop_env/actions.py`` (MOVE_TO, CLICK, MOUSE_DOWN, MOUSE_UP,
RIGHT_CLICK, DOUBLE_CLICK, DRAG_TO, SCROLL, TYPING, PRESS, KEY_DOWN, KEY_UP, HOTKEY) are tools
named by the action type in lower case; the control actions WAIT, FAIL and DONE are tools in
both action spaces. :func:`to_action` checks a call's arguments (names, types, ranges, key
names, x and y together) and returns what ``DesktopEnv.step`` takes:
``{"action_type": "CLICK", "parameters": {"x": 10.0, "y": 20.0}}``, or ``"WAIT"``/``"FAIL"``/
``"DONE"``. A bad call raises InvalidInput, which the session returns to the model as an error.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollfleet.envs.base import Tool
from rollfleet.errors import InvalidInput

_NAMED_KEYS = (
    "accept add alt altleft altright apps backspace browserback browserfavorites browserforward "
    "browserhome browserrefresh browsersearch browserstop capslock clear convert ctrl ctrlleft "
    "ctrlright decimal del delete divide down end enter esc escape execute final fn hanguel "
    "hangul hanja help home insert junja kana kanji launchapp1 launchapp2 launchmail "
    "launchmediaselect left modechange multiply nexttrack nonconvert numlock pagedown pageup "
    "pause pgdn pgup playpause prevtrack print printscreen prntscrn prtsc prtscr return right "
    "scrolllock select separator shift shiftleft shiftright sleep space stop subtract tab up "
    "volumedown volumemute volumeup win winleft winright yen command option optionleft optionright"
)
KEYS = frozenset(
    [*_NAMED_KEYS.split(), *(f"f{n}" for n in range(1, 25)), *(f"num{n}" for n in range(10))]
    + [c for c in string.printable if c not in "\x0b\x0cABCDEFGHIJKLMNOPQRSTUVWXYZ"]
)
BUTTONS = ("left", "right", "middle")
CONTROL = ("WAIT", "FAIL", "DONE")


@dataclass(frozen=True)
class Param:
    """One parameter: its kind (``x``, ``y``, ``int``, ``button``, ``clicks``, ``text``, ``key``,
    ``keys``), what it means, whether it may be left out."""

    kind: str
    description: str
    optional: bool = False


_XY = {"x": Param("x", "pixels from the left"), "y": Param("y", "pixels from the top")}
_AT = {
    "x": Param("x", "pixels from the left (default: where the cursor is)", True),
    "y": Param("y", "pixels from the top (default: where the cursor is)", True),
}
_BUTTON = {"button": Param("button", "left, right or middle (default left)", True)}
_KEY = {"key": Param("key", "a key name such as enter, ctrl, a, f5")}
ACTIONS: dict[str, tuple[str, Mapping[str, Param]]] = {
    "MOVE_TO": ("move the cursor to a position", _XY),
    "CLICK": (
        "click a button (default left) at a position (default: where the cursor is)",
        {**_BUTTON, **_AT, "num_clicks": Param("clicks", "1, 2 or 3 (default 1)", True)},
    ),
    "MOUSE_DOWN": ("press a mouse button and hold it", _BUTTON),
    "MOUSE_UP": ("release a mouse button", _BUTTON),
    "RIGHT_CLICK": ("right click at a position (default: where the cursor is)", _AT),
    "DOUBLE_CLICK": ("double click at a position (default: where the cursor is)", _AT),
    "DRAG_TO": ("drag the cursor to a position with the left button pressed", _XY),
    "SCROLL": (
        "scroll the mouse wheel",
        {
            "dx": Param("int", "columns to scroll, right is positive"),
            "dy": Param("int", "lines to scroll, up is positive"),
        },
    ),
    "TYPING": ("type text with the keyboard", {"text": Param("text", "what to type")}),
    "PRESS": ("press a key and release it", _KEY),
    "KEY_DOWN": ("press a key and hold it", _KEY),
    "KEY_UP": ("release a held key", _KEY),
    "HOTKEY": (
        "press a key combination",
        {"keys": Param("keys", 'key names pressed together, such as ["ctrl", "c"]')},
    ),
}
_CONTROL_NOTES = {
    "WAIT": "wait a moment for the screen to settle",
    "FAIL": "give up: the task cannot be done",
    "DONE": "the task is done",
}
_SCHEMA: dict[str, dict[str, Any]] = {
    "x": {"type": "number", "minimum": 0},
    "y": {"type": "number", "minimum": 0},
    "int": {"type": "integer"},
    "button": {"type": "string", "enum": list(BUTTONS)},
    "clicks": {"type": "integer", "enum": [1, 2, 3]},
    "text": {"type": "string"},
    "key": {"type": "string"},
    "keys": {"type": "array", "items": {"type": "string"}, "minItems": 1},
}


def _tool(action_type: str, note: str, params: Mapping[str, Param]) -> Tool:
    return Tool(
        action_type.lower(),
        note,
        {k: p.description for k, p in params.items()},
        schema={k: _SCHEMA[p.kind] for k, p in params.items()},
        optional=frozenset(k for k, p in params.items() if p.optional),
    )


COMPUTER_13_TOOLS = [_tool(name, note, params) for name, (note, params) in ACTIONS.items()]
CONTROL_TOOLS = [_tool(name, note, {}) for name, note in _CONTROL_NOTES.items()]


def _number(value: Any, name: str, high: float) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidInput(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"{name} must be a number, got {value!r}")
    if not 0 <= value <= high:
        raise InvalidInput(f"{name} must be between 0 and {high:g}, got {value:g}")
    return float(value)


def _integer(value: Any, name: str) -> int:
    try:
        whole = int(value)
        ok = not isinstance(value, bool) and float(value) == whole
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidInput(f"{name} must be a whole number, got {value!r}")
    return whole


def _key(value: Any, name: str) -> str:
    if not isinstance(value, str) or value.lower() not in KEYS and value not in KEYS:
        raise InvalidInput(f"{name} {value!r} is not a key name (such as enter, ctrl, a, f5)")
    return value if value in KEYS else value.lower()


def _value(param: Param, value: Any, name: str, screen: tuple[int, int]) -> Any:
    if param.kind in ("x", "y"):
        return _number(value, name, screen[0] if param.kind == "x" else screen[1])
    if param.kind == "int":
        return _integer(value, name)
    if param.kind == "clicks":
        if _integer(value, name) not in (1, 2, 3):
            raise InvalidInput(f"{name} must be 1, 2 or 3, got {value!r}")
        return int(value)
    if param.kind == "button":
        if value not in BUTTONS:
            raise InvalidInput(f"{name} must be left, right or middle, got {value!r}")
        return value
    if param.kind == "text":
        if not isinstance(value, str):
            raise InvalidInput(f"{name} must be a string, got {value!r}")
        return value
    if param.kind == "keys":
        if not isinstance(value, list) or not value:
            raise InvalidInput(f"{name} must be a non-empty list of key names, got {value!r}")
        return [_key(k, name) for k in value]
    return _key(value, name)


def to_action(
    name: str, args: Mapping[str, Any], screen: tuple[int, int] = (1920, 1080)
) -> dict[str, Any] | str:
    """A computer_13 (or control) tool call as a DesktopEnv action; InvalidInput when it is
    unknown or its arguments are wrong."""
    action_type = name.upper()
    if action_type in CONTROL:
        return action_type
    if action_type not in ACTIONS:
        raise InvalidInput(f"unknown computer_13 action {name!r}")
    params = ACTIONS[action_type][1]
    unknown = sorted(set(args) - set(params))
    if unknown:
        known = ", ".join(params) or "none"
        raise InvalidInput(f"{name}: unknown argument {unknown[0]!r}; the arguments are {known}")
    missing = [k for k, p in params.items() if not p.optional and args.get(k) is None]
    if missing:
        raise InvalidInput(f"{name}: argument {missing[0]!r} is missing")
    if "x" in params and (args.get("x") is None) != (args.get("y") is None):
        raise InvalidInput(f"{name}: give x and y together, or neither")
    values = {
        k: _value(params[k], v, f"{name}: {k}", screen) for k, v in args.items() if v is not None
    }
    return {"action_type": action_type, "parameters": values}
