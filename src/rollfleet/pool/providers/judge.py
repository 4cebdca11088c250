"""The test judge that runs inside a sandbox: scores a solution so that it cannot forge a pass.

Run as ``python -I -S -B -c <this source>`` with ``{"tests": [...], "module": ..., "test_s": ...}``
on stdin; it writes a line-by-line JSON report on stdout (:func:`main`). It imports only the
standard library, and it never imports the solution. A test is an expression of a small grammar
(:func:`check_test`, also applied when a task file is read): literals, arithmetic, comparisons,
``and``/``or``/``not``, subscripts, a few builtins and ``math`` functions, and calls of the
solution's functions with *literal* arguments. Only those calls reach the solution: a separate
*evaluator* process imports it, makes the call and sends back plain data (None, bool, int, float,
str, bytes, list, tuple, set, dict). Everything around the calls (``abs(f(3.5) - 0.5) < 1e-6``,
``f(10) == 2**10``) is computed here, on those plain values. So:

- the expected values never enter a process the solution runs in, and the judge's memory cannot
  be read from one (it is not dumpable; under bubblewrap it is PID 1 of the sandbox);
- whatever the solution prints, patches (``builtins.abs``), wherever it exits, and whatever its
  return values claim (an object whose ``__eq__`` or ``__sub__`` lies) moves no reward: only
  plain values are used, here; an evaluator that answers every line (its descriptor taken over)
  answers only for the solution's own calls, which is what the solution is scored on anyway;
- a test that hangs or crashes its evaluator fails alone; the next test gets a fresh evaluator;
- the judge ignores every signal it can, and any malformed answer fails the test: a solution
  that stops the judge anyway fails the tests left, it never makes the run unscored.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
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

_COMPARE: dict[type[ast.cmpop], Any] = {
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
_ARITHMETIC: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
}
_UNARY: dict[type[ast.unaryop], Any] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
    ast.Not: operator.not_,
    ast.Invert: operator.invert,
}
# Functions a test may apply to answers: computed here, on plain data, never by the solution.
BUILTINS: dict[str, Any] = {
    f.__name__: f
    for f in (abs, all, any, bool, dict, float, frozenset, int, len, list, max, min, round)
    + (set, sorted, str, sum, tuple)
}
MATH_FUNCTIONS = frozenset({"ceil", "exp", "fabs", "floor", "isclose", "isfinite", "isinf"})
MATH_FUNCTIONS |= {"isnan", "log", "sqrt", "trunc"}
MATH_CONSTANTS = frozenset({"e", "inf", "nan", "pi", "tau"})
LITERALS = (int, float, str, bytes, bool, type(None))
MAX_ITEMS = 1_000_000  # items a sequence product may make
MAX_BITS = 1_000_000  # bits a power or a shift may make


class Failed(Exception):
    """A test that failed for a reason the report names."""


def check_test(expr: str) -> ast.expr:
    """A test expression's tree, when it is of the grammar the judge computes: literals,
    arithmetic, comparisons, ``and``/``or``/``not``, subscripts, a few builtins and ``math``
    functions over them, and calls of the solution's functions *with literal arguments*, the
    only part the solution answers. ValueError naming the first part outside it."""
    tree = ast.parse(expr, mode="eval").body
    _check(tree)
    return tree


def _check(node: ast.AST) -> None:
    """Raise ValueError at the first part of ``node`` outside the test grammar."""
    if isinstance(node, ast.Call):
        _check_call(node)
        return
    if isinstance(node, ast.Attribute):
        if not (_is_math(node.value) and node.attr in MATH_CONSTANTS):
            raise ValueError(f"{ast.unparse(node)!r}: only math's constants can be read")
        return
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, LITERALS):
            raise ValueError(f"{ast.unparse(node)!r}: a {type(node.value).__name__} literal")
        return
    if isinstance(node, ast.Dict) and any(k is None for k in node.keys):
        raise ValueError(f"{ast.unparse(node)!r}: ** unpacking")
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and not (
        type(node.op) in _ARITHMETIC or type(node.op) in _UNARY
    ):
        raise ValueError(f"{ast.unparse(node)!r}: operator {type(node.op).__name__}")
    if not isinstance(node, _COMPOUND):
        raise ValueError(f"{ast.unparse(node)!r}: a {type(node).__name__} is not computed here")
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.expr):
            _check(child)


_COMPOUND = (
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.List,
    ast.Tuple,
    ast.Set,
    ast.Dict,
    ast.Subscript,
    ast.Slice,
)


def _check_call(node: ast.Call) -> None:
    """A builtin or math function of computed arguments, or a call of the solution's function
    with literal arguments."""
    where = ast.unparse(node)
    if any(isinstance(a, ast.Starred) for a in node.args) or any(
        k.arg is None for k in node.keywords
    ):
        raise ValueError(f"{where!r}: * or ** arguments")
    arguments = [*node.args, *(k.value for k in node.keywords)]
    if _computed_function(node.func):
        for arg in arguments:
            _check(arg)
        return
    if not isinstance(node.func, ast.Name):
        raise ValueError(f"{where!r}: only a function of the solution's, by name, is called")
    for arg in arguments:
        try:
            ast.literal_eval(arg)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise ValueError(
                f"{where!r}: the solution's function takes literal arguments only,"
                f" not {ast.unparse(arg)!r}"
            ) from None


def _is_math(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "math"


def _computed_function(func: ast.expr) -> bool:
    """Whether a call of ``func`` is computed by the judge (a builtin or a math function)."""
    if isinstance(func, ast.Name):
        return func.id in BUILTINS
    return isinstance(func, ast.Attribute) and _is_math(func.value) and func.attr in MATH_FUNCTIONS


def _same(a: Any, b: Any) -> bool:
    """``is`` on decoded data: identity for the singletons, equal value and type otherwise."""
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b


def _arithmetic(op: type[ast.operator], a: Any, b: Any) -> Any:
    """``a op b``, refused where the result would be too large to make."""
    if op is ast.Pow and isinstance(a, int) and isinstance(b, int) and b > 0:
        if max(a.bit_length(), 1) * b > MAX_BITS:
            raise Failed(f"{a!r} ** {b!r} is too large to compute")
    if op is ast.LShift and isinstance(b, int) and b > MAX_BITS:
        raise Failed(f"<< {b!r} is too large to compute")
    if op is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                if len(seq) * n > MAX_ITEMS:
                    raise Failed(f"a sequence of {len(seq)} times {n} is too large to make")
    return _ARITHMETIC[op](a, b)


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
        except (ValueError, RecursionError, MemoryError):  # garbled, or nested to break a parser
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


class Judge:
    """Scores one solution against a list of test expressions."""

    def __init__(self, module: str, test_s: float) -> None:
        """Evaluators import ``module``; each test may take ``test_s`` seconds."""
        self.module, self.test_s = module, test_s
        self.evaluator: Evaluator | None = None
        self.import_error: str | None = None
        self.answers: list[Any] = []  # the solution's answers in the test being computed

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

    def ask(self, call: ast.Call, deadline: float) -> Any:
        """The solution's answer to one call of its function, as plain data (Failed if none)."""
        source = ast.unparse(call)
        evaluator = self._ready(deadline)
        if evaluator is None:
            raise Failed(f"the solution did not import: {self.import_error}")
        answer = evaluator.ask(source, deadline)
        if answer is None:  # died, hung or garbled: the next test gets a fresh one
            evaluator.close()
            self.evaluator = None
            raise Failed(f"{source}: no answer within {self.test_s}s (crashed or hung)")
        if "value" not in answer:
            raise Failed(f"{source}: {str(answer.get('error', 'no value'))[:500]}")
        try:
            value = decode(answer["value"])
        except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
            raise Failed(f"{source}: unreadable value ({exc})") from None
        self.answers.append(value)
        return value

    def compute(self, node: ast.expr, deadline: float) -> Any:
        """A checked test's value: every part computed here, but the solution's answers."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Call):
            return self._call(node, deadline)
        if isinstance(node, ast.Attribute):
            return getattr(math, node.attr)
        if isinstance(node, ast.BoolOp):
            value = None
            for part in node.values:
                value = self.compute(part, deadline)
                if bool(value) != isinstance(node.op, ast.And):
                    return value
            return value
        if isinstance(node, ast.Compare):
            left = self.compute(node.left, deadline)
            for op, part in zip(node.ops, node.comparators, strict=True):
                right = self.compute(part, deadline)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BinOp):
            left, right = self.compute(node.left, deadline), self.compute(node.right, deadline)
            return _arithmetic(type(node.op), left, right)
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self.compute(node.operand, deadline))
        if isinstance(node, ast.Subscript):
            return self.compute(node.value, deadline)[self.compute(node.slice, deadline)]
        if isinstance(node, ast.Slice):
            parts = (node.lower, node.upper, node.step)
            return slice(*(None if p is None else self.compute(p, deadline) for p in parts))
        if isinstance(node, ast.Dict):
            pairs = zip(node.keys, node.values, strict=True)
            return {self.compute(k, deadline): self.compute(v, deadline) for k, v in pairs if k}
        items = [self.compute(item, deadline) for item in getattr(node, "elts", ())]
        kinds: dict[type[ast.expr], Any] = {ast.List: list, ast.Tuple: tuple, ast.Set: set}
        return kinds[type(node)](items)

    def _call(self, node: ast.Call, deadline: float) -> Any:
        """A builtin or math function applied here, or the solution asked."""
        if not _computed_function(node.func):
            return self.ask(node, deadline)
        func = (
            BUILTINS[node.func.id]
            if isinstance(node.func, ast.Name)
            else getattr(math, getattr(node.func, "attr", ""))
        )
        args = [self.compute(a, deadline) for a in node.args]
        kwargs = {str(k.arg): self.compute(k.value, deadline) for k in node.keywords}
        return func(*args, **kwargs)

    def test(self, expr: str) -> dict[str, Any]:
        """One test: ``{"ok": bool, "why": str}``; anything wrong fails it, never the judge."""
        deadline = time.monotonic() + self.test_s
        self.answers = []
        try:
            tree = check_test(expr)
            result = bool(self.compute(tree, deadline))
        except Failed as exc:
            return {"ok": False, "why": str(exc)}
        except (SyntaxError, ValueError) as exc:
            return {"ok": False, "why": f"not a test the judge computes: {exc}"[:500]}
        except Exception as exc:  # noqa: BLE001  any error of the computation fails the test
            return {"ok": False, "why": f"{expr}: {type(exc).__name__}: {exc}"[:500]}
        if result:
            return {"ok": True, "why": ""}
        return {"ok": False, "why": f"{expr}: false (the solution answered {_short(self.answers)})"}

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


def _deaf() -> None:
    """Ignore every signal that can be caught: only the sandbox's own SIGKILL stops the judge
    (a solution's ``os.kill(1, SIGINT)`` used to turn its failed tests into an unscored run)."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_IGN)


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Read the request on stdin; write ``{"started": n}`` before the solution runs, then one
    ``{"test": i, "ok", "why"}`` line per test as it ends, then ``{"import_error": ...}``. A
    report cut short after ``started`` is the solution's doing (the rest of its tests fail); one
    without ``started`` is the infrastructure's."""
    _deaf()
    _not_dumpable()
    request = json.loads(sys.stdin.read())
    judge = Judge(str(request["module"]), float(request["test_s"]))
    _emit({"started": len(request["tests"])})
    try:
        for i, expr in enumerate(request["tests"]):
            _emit({"test": i, **judge.test(str(expr))})
    finally:
        judge.close()
    _emit({"import_error": judge.import_error})


if __name__ == "__main__":
    main()
