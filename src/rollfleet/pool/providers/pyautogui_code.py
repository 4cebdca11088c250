"""The pyautogui snippets a desktop accepts: read with ``ast``, never run here.

An agent in OSWorld's ``pyautogui`` action space writes Python that the VM runs. rollfleet
sends only code made of ``pyautogui.<function>(literal arguments)`` calls, ``time.sleep(seconds)``
and the lines ``import pyautogui`` / ``import time``; anything else (other imports, other names,
attribute access outside ``pyautogui``, assignments, loops, computed arguments) is refused with a
:class:`RefusedCode` naming the line. :func:`parse` returns the calls, which the VM (or
:class:`~rollfleet.pool.providers.desktop_standin.DesktopEnvStandIn`) performs.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

MAX_CODE_CHARS = 10_000
MAX_CALLS = 100
MAX_SLEEP_S = 60.0
MOUSE = (
    "moveTo moveRel move click doubleClick tripleClick rightClick middleClick mouseDown mouseUp "
    "dragTo dragRel drag scroll hscroll vscroll"
)
KEYBOARD = "write typewrite press keyDown keyUp hotkey"
ALLOWED = {
    "pyautogui": frozenset(f"{MOUSE} {KEYBOARD}".split()),
    "time": frozenset({"sleep"}),
}
_RULE = (
    "only pyautogui.<function>(literal arguments) calls, time.sleep(seconds), "
    "`import pyautogui` and `import time` are allowed"
)


class RefusedCode(ValueError):
    """The snippet holds something other than allowed pyautogui calls; says which line and why."""


@dataclass(frozen=True)
class Call:
    """One allowed call: ``module.fn(*args, **kwargs)`` with literal arguments."""

    module: str
    fn: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """The argument at position ``index`` or keyword ``name``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


def _refuse(node: ast.AST, what: str) -> RefusedCode:
    return RefusedCode(f"line {getattr(node, 'lineno', '?')}: {what}; {_RULE}")


def _literal(node: ast.AST, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _refuse(node, f"{where} is not a literal ({ast.unparse(node)[:60]})") from None


def _import(node: ast.Import | ast.ImportFrom) -> None:
    if isinstance(node, ast.ImportFrom):
        raise _refuse(node, f"`from {node.module} import …` is not allowed")
    for alias in node.names:
        if alias.name not in ALLOWED or alias.asname not in (None, alias.name):
            raise _refuse(node, f"`import {alias.name}` is not allowed")


def _call(node: ast.stmt) -> Call:
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
        raise _refuse(node, f"a {type(node).__name__} statement is not allowed")
    call, func = node.value, node.value.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        raise _refuse(node, f"a call to {ast.unparse(func)[:60]} is not allowed")
    module, fn = func.value.id, func.attr
    if fn not in ALLOWED.get(module, frozenset()):
        raise _refuse(node, f"{module}.{fn} is not allowed")
    args = tuple(_literal(a, f"argument {i + 1} of {module}.{fn}") for i, a in enumerate(call.args))
    kwargs = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise _refuse(node, f"**arguments to {module}.{fn} are not allowed")
        kwargs[kw.arg] = _literal(kw.value, f"argument {kw.arg!r} of {module}.{fn}")
    if module == "time":
        seconds = args[0] if args else kwargs.get("secs")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise _refuse(node, "time.sleep needs a number of seconds")
        if not 0 <= seconds <= MAX_SLEEP_S:
            raise _refuse(node, f"time.sleep({seconds}) is outside 0 to {MAX_SLEEP_S:g} seconds")
    return Call(module, fn, args, kwargs)


def parse(code: str) -> list[Call]:
    """The calls of a pyautogui snippet; RefusedCode for anything else."""
    if len(code) > MAX_CODE_CHARS:
        raise RefusedCode(f"the code is {len(code)} characters; at most {MAX_CODE_CHARS}")
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise RefusedCode(f"line {exc.lineno}: not valid Python: {exc.msg}") from None
    calls = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _import(node)
        else:
            calls.append(_call(node))
    if len(calls) > MAX_CALLS:
        raise RefusedCode(f"{len(calls)} calls; at most {MAX_CALLS} in one snippet")
    return calls
