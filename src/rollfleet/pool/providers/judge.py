"""The test judge that runs inside a sandbox: scores a solution so that it cannot forge a pass.

Run as ``python -I -S -B -c <this source>`` with ``{"tests": [...], "module": ..., "test_s": ...}``
on stdin; it writes one JSON report on stdout and exits 0. It imports only the standard library,
and it never imports the solution: for each test expression it starts (or reuses) a separate
*evaluator* process that imports the solution and evaluates only the operands that are not literals
(``add(2, 3)`` of ``add(2, 3) == 5``). The evaluator sends back plain data (None, bool, int, float,
str, bytes, list, tuple, set, dict); the judge applies the comparison itself. So:

- the expected values never enter a process the solution runs in, and the judge's memory cannot
  be read from one (it is not dumpable; under bubblewrap it is PID 1 of the sandbox, which no
  process inside can kill);
- whatever the solution prints, wherever it exits (``os._exit(0)`` at import), and whatever its
  return values claim (an object whose ``__eq__`` is always true) moves no reward: only values
  converted to plain data are compared, here;
- a test that hangs or crashes its evaluator fails alone; the next test gets a fresh evaluator.

The report says per test ``ok`` and, when not, ``why``. An exit status other than 0, or a
missing report, is the infrastructure's failure, never the solution's.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

MAX_ANSWER = 1 << 20  # bytes of one evaluator answer
MAX_DEPTH = 32

EVALUATOR = r"""
import importlib, json, os, sys
_out = os.fdopen(int(sys.argv[1]), "w")
_isinstance, _type, _repr, _len = isinstance, type, repr, len

def _plain(v, depth=0):
    if depth > 32:
        raise ValueError("value nested deeper than 32")
    if v is None:
        return None
    if _isinstance(v, bool):
        return bool(v)
    if _isinstance(v, str):
        return str(v)
    if _isinstance(v, int):
        return {"int": str(int(v))}
    if _isinstance(v, float):
        return {"float": float.__repr__(float(v))}
    if _isinstance(v, (bytes, bytearray)):
        return {"bytes": bytes(v).hex()}
    if _isinstance(v, dict):
        return {"dict": [[_plain(k, depth + 1), _plain(x, depth + 1)] for k, x in dict(v).items()]}
    for kind in (list, tuple, set, frozenset):
        if _isinstance(v, kind):
            return {kind.__name__: [_plain(x, depth + 1) for x in kind(v)]}
    raise TypeError(f"a {_type(v).__name__} is not plain data")

def _send(obj):
    _out.write(json.dumps(obj) + "\n")
    _out.flush()

sys.path.insert(0, os.getcwd())
try:
    _ns = dict(vars(importlib.import_module(sys.argv[2])))
except BaseException as exc:
    _send({"import_error": f"{_type(exc).__name__}: {exc}"[:500]})
    raise SystemExit(0)
_send({"ready": True})
for _line in sys.stdin:
    try:
        _answer = {"value": _plain(eval(json.loads(_line), _ns))}
    except BaseException as exc:
        _answer = {"error": f"{_type(exc).__name__}: {exc}"[:500]}
    _send(_answer)
"""

_OPS: dict[type[ast.cmpop], Any] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: lambda a, b: _same(a, b),
    ast.IsNot: lambda a, b: not _same(a, b),
}


def _same(a: Any, b: Any) -> bool:
    """``is`` on decoded data: identity for the singletons, equal value and type otherwise."""
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b


def decode(value: Any, depth: int = 0) -> Any:
    """Plain data back from the evaluator's tagged JSON (nothing of the solution's runs here)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = value.items()
    if tag == "int":
        return int(body)
    if tag == "float":
        return float(body)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "dict":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
    if tag in kinds:
        return kinds[tag](decode(x, depth + 1) for x in body)
    raise ValueError(f"unknown tag {tag!r}")


class Evaluator:
    """One process that imports the solution and evaluates expressions on request."""

    def __init__(self, module: str) -> None:
        """Start it; it answers ``ready`` or ``import_error`` first."""
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-c", EVALUATOR, str(write_fd), module],
            stdin=subprocess.PIPE,
            stdout=2,  # the solution's prints go to stderr, never into this judge's report
            stderr=2,
            pass_fds=(write_fd,),
            start_new_session=True,
            text=True,
        )
        os.close(write_fd)
        self.answers = read_fd
        self.buffer = b""

    def answer(self, deadline: float) -> dict[str, Any] | None:
        """The next answer line, or None when the evaluator died, hung or sent garbage."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.answers], [], [], left)[0]:
                return None
            chunk = os.read(self.answers, 65536)
            if not chunk or len(self.buffer) + len(chunk) > MAX_ANSWER:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def ask(self, source: str, deadline: float) -> dict[str, Any] | None:
        """Evaluate ``source`` in the solution's namespace."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(source) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        return self.answer(deadline)

    def close(self) -> None:
        """Kill it and everything it started."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self.answers)


def plan(expr: str) -> tuple[list[tuple[str, Any]], list[type[ast.cmpop]], bool]:
    """(operands, comparison operators, negate): literals are kept as values, the rest as
    expressions to ask for. A bare expression is one operand that must come back truthy."""
    node = ast.parse(expr, mode="eval").body
    negate = False
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node, negate = node.operand, not negate
    parts = [node.left, *node.comparators] if isinstance(node, ast.Compare) else [node]
    ops = [type(op) for op in node.ops] if isinstance(node, ast.Compare) else []
    operands: list[tuple[str, Any]] = []
    for part in parts:
        try:
            operands.append(("literal", ast.literal_eval(part)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            operands.append(("ask", ast.unparse(part)))
    return operands, ops, negate


class Judge:
    """Scores one solution against a list of test expressions."""

    def __init__(self, module: str, test_s: float) -> None:
        """Evaluators import ``module``; each test may take ``test_s`` seconds."""
        self.module, self.test_s = module, test_s
        self.evaluator: Evaluator | None = None
        self.import_error: str | None = None

    def _ready(self, deadline: float) -> Evaluator | None:
        if self.evaluator is None and self.import_error is None:
            evaluator = Evaluator(self.module)
            first = evaluator.answer(deadline)
            if first is None or "ready" not in first:
                evaluator.close()
                self.import_error = str((first or {}).get("import_error") or "no answer at import")
                return None
            self.evaluator = evaluator
        return self.evaluator

    def _value(self, source: str, deadline: float) -> tuple[bool, Any]:
        evaluator = self._ready(deadline)
        if evaluator is None:
            return False, f"the solution did not import: {self.import_error}"
        answer = evaluator.ask(source, deadline)
        if answer is None:  # died, hung or garbled: the next test gets a fresh one
            evaluator.close()
            self.evaluator = None
            return False, f"{source}: no answer within {self.test_s}s (crashed or hung)"
        if "value" not in answer:
            return False, f"{source}: {answer.get('error', 'no value')}"
        try:
            return True, decode(answer["value"])
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            return False, f"{source}: unreadable value ({exc})"

    def test(self, expr: str) -> dict[str, Any]:
        """One test: ``{"ok": bool, "why": str}``."""
        deadline = time.monotonic() + self.test_s
        try:
            operands, ops, negate = plan(expr)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            return {"ok": False, "why": f"not an expression: {exc}"}
        values = []
        for kind, item in operands:
            if kind == "literal":
                values.append(item)
                continue
            ok, value = self._value(item, deadline)
            if not ok:
                return {"ok": False, "why": value}
            values.append(value)
        try:
            if ops:
                pairs = zip(ops, values, values[1:], strict=False)
                result = all(_OPS[op](a, b) for op, a, b in pairs)
            else:
                result = bool(values[0])
        except (TypeError, ValueError, RecursionError) as exc:
            return {"ok": False, "why": f"{expr}: {type(exc).__name__}: {exc}"}
        if result != negate:
            return {"ok": True, "why": ""}
        return {"ok": False, "why": f"{expr}: false (values {_short(values)})"}

    def close(self) -> None:
        """Stop the evaluator."""
        if self.evaluator is not None:
            self.evaluator.close()


def _short(values: list[Any]) -> str:
    text = repr(values)
    return text if len(text) <= 200 else text[:197] + "..."


def _not_dumpable() -> None:
    """No process of the same user may read this one's memory or open its descriptors."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def main() -> None:
    """Read the request on stdin, write the report on stdout."""
    _not_dumpable()
    request = json.loads(sys.stdin.read())
    judge = Judge(str(request["module"]), float(request["test_s"]))
    try:
        results = [judge.test(str(expr)) for expr in request["tests"]]
    finally:
        judge.close()
    report = {"results": results, "import_error": judge.import_error}
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
