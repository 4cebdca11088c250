"""``reasoning-gym``: reasoning-gym's procedural tasks, scored by reasoning-gym's own scorers.

Task: entry ``index`` of ``reasoning_gym.create_dataset(dataset, seed=seed, size=size)`` and
where it came from, as ``rollfleet tasks reasoning-gym NAME`` writes it::

    {"dataset": "leg_counting", "seed": 0, "size": 64, "index": 3,
     "question": "...", "answer": "292" or null, "metadata": {...}}

``metadata`` may be left out. The task file is input, not truth: :meth:`ReasoningGymMode.check`
rebuilds the entry from (dataset, seed, size, index) and refuses a line whose ``question``,
``answer`` or ``metadata`` is not what the generator makes; a session rebuilds it again in its
runner process (refusing to start when the question differs there, e.g. another reasoning-gym
version) and scores with ``dataset.score_answer(answer, rebuilt_entry)``. The file's own
``answer`` never reaches a scorer.

The answer scored is the text inside the last ``<answer>…</answer>`` of the final answer
(reasoning-gym's own convention and ``extract_answer``), else the final answer as given. Reward:
the scorer's float clamped to [0, 1], ``correct`` when it is 1.0; a scorer that returns no finite
number is refused (InvalidInput); one that raises on the answer (``prime_factorization`` on a
non-number) scores 0.0, with ``scorer_error`` in the details.

Answers that are code: nine scorers evaluate the answer as Python, and the policy writes the
answer, so it could run code in the runner process. ``string_insertion``, ``spiral_matrix``,
``binary_matrix`` and ``n_queens`` call ``eval`` (for partial credit on a Python list): in their
modules ``eval`` is made ``ast.literal_eval`` when the dataset is built, so a literal scores as
before and anything else fails as unreadable. ``countdown``, ``puzzle24``,
``simple_integration``, ``intermediate_integration`` and ``polynomial_multiplication`` call
``sympy.parse_expr`` (an ``eval`` with Python's builtins in reach): an answer reaches it only when
it is an ASCII arithmetic expression of numbers, symbols and elementary functions whose numbers
and powers stay small; any other answer is scored as an empty one, with ``not_scored`` saying
why. Only on such answers does the reward differ from reasoning-gym's.

Datasets that cannot be rebuilt elsewhere are refused: ``composite`` (it needs a config of
datasets), ``list_functions`` (it draws from Python's global random generator), and, unless
``PYTHONHASHSEED`` is set to a number in every process that generates, checks or runs them,
the five whose entries depend on Python's string hash seed (:data:`HASH_SEEDED`).
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import copy
import difflib
import functools
import json
import keyword
import math
import os
import re
import sys
import threading
from importlib import metadata as package_metadata
from typing import Any

from rollfleet.envs.base import Score, Tool, Transcript, require_fields
from rollfleet.errors import InvalidInput

MAX_SIZE = 100_000  # entries of one generated dataset
MAX_SEED = 2**32 - 1
MAX_TEXT_CHARS = 100_000  # a task's question or answer
DETAIL_CHARS = 500  # of an answer shown in a score's details
INSTALL = "the reasoning-gym mode needs the reasoning-gym package: pip install 'rollfleet[envs]'"

UNBUILDABLE = {
    "composite": "it is built from a config of other datasets, not from a seed and size",
    "list_functions": "its generator draws from Python's global random generator",
}
HASH_SEEDED = frozenset(
    {"isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder"}
)
EVALS_LITERAL = frozenset({"string_insertion", "spiral_matrix", "binary_matrix", "n_queens"})
PARSES_SYMPY = frozenset(
    {
        "countdown",
        "puzzle24",
        "simple_integration",
        "intermediate_integration",
        "polynomial_multiplication",
    }
)
# sympy names an expression answer may use; any other name sympy defines is refused
MATH_NAMES = frozenset(
    "sin cos tan cot sec csc asin acos atan acot asec acsc sinh cosh tanh coth asinh acosh atanh "
    "exp log ln sqrt cbrt root Abs sign pi E I oo Integral".split()
)
MAX_EXPRESSION_CHARS = 2000
MAX_DIGITS = 10_000  # of any number an expression answer makes
MAX_EXPONENT_DIGITS = 3  # an exponent below 1000

SYSTEM_PROMPT = (
    "Solve the problem. Think step by step, briefly. Then give only the final answer, in the "
    "exact form the question asks for, between <answer> and </answer> tags, e.g. "
    "<answer>42</answer>."
)

_LOCK = threading.Lock()  # reasoning-gym's generators are not all thread-safe (np.random.seed)
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_PLAIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")


def _rg() -> Any:
    """The reasoning_gym package, imported on first use; InvalidInput naming the extra without
    it."""
    try:
        import reasoning_gym
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "reasoning_gym":
            raise InvalidInput(INSTALL) from None
        raise InvalidInput(f"{INSTALL} (its dependency {exc.name} is missing)") from None
    return reasoning_gym


def version() -> str:
    """The installed reasoning-gym's version."""
    try:
        return package_metadata.version("reasoning-gym")
    except package_metadata.PackageNotFoundError:
        raise InvalidInput(INSTALL) from None


def hash_seed_fixed() -> bool:
    """Whether this process's string hashing is reproducible (PYTHONHASHSEED is a number)."""
    return os.environ.get("PYTHONHASHSEED", "").isdigit()


@functools.cache
def known_names() -> tuple[str, ...]:
    """Every dataset reasoning-gym registers."""
    return tuple(sorted(_rg().factory.DATASETS))


def dataset_names() -> tuple[str, ...]:
    """The datasets this mode can rebuild in any process (with a fixed hash seed, more)."""
    return tuple(n for n in known_names() if refusal(n) is None)


def refusal(name: str) -> str | None:
    """Why dataset ``name`` cannot be used here, or None when it can."""
    if name not in known_names():
        close = difflib.get_close_matches(name[:64], known_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (
            f"unknown reasoning-gym dataset {name[:64]!r}{hint}; "
            "`rollfleet tasks reasoning-gym --list` shows the names"
        )
    if name in UNBUILDABLE:
        return f"reasoning-gym dataset {name!r} cannot be rebuilt: {UNBUILDABLE[name]}"
    if name in HASH_SEEDED and not hash_seed_fixed():
        return (
            f"reasoning-gym dataset {name!r} depends on Python's string hash seed: set "
            "PYTHONHASHSEED to a number (the same one) wherever its tasks are generated and run"
        )
    return None


def source_error(name: str, seed: int, size: int) -> tuple[str, str] | None:
    """The field and the reason when (name, seed, size) is not a dataset this mode can rebuild;
    None when it is."""
    reason = refusal(name)
    if reason is not None:
        return "dataset", reason
    if not 0 <= seed <= MAX_SEED:
        return "seed", f"seed {seed} is out of range: 0 to {MAX_SEED}"
    if not 1 <= size <= MAX_SIZE:
        return "size", f"size {size} is out of range: 1 to {MAX_SIZE:,}"
    return None


def check_source(name: str, seed: int, size: int) -> None:
    """InvalidInput when (name, seed, size) is not a dataset this mode can rebuild."""
    error = source_error(name, seed, size)
    if error is not None:
        raise InvalidInput(error[1])


@functools.lru_cache(maxsize=8)
def _dataset(name: str, seed: int, size: int) -> Any:
    with contextlib.redirect_stdout(sys.stderr):  # a few generators print
        try:
            dataset = _rg().create_dataset(name, seed=seed, size=size)
        except (ValueError, AssertionError, TypeError) as exc:
            raise InvalidInput(
                f"reasoning-gym cannot build {name!r} with seed {seed} and size {size}: {exc}"
            ) from None
    if name in EVALS_LITERAL:
        _literals_only(dataset)
    return dataset


@functools.lru_cache(maxsize=1024)
def _entry(name: str, seed: int, size: int, index: int) -> dict[str, Any]:
    with contextlib.redirect_stdout(sys.stderr):
        return dict(_dataset(name, seed, size)[index])


def entry(name: str, seed: int, size: int, index: int) -> dict[str, Any]:
    """Entry ``index`` of dataset (name, seed, size), rebuilt (cached per process, bounded);
    read it, never change it."""
    with _LOCK:
        return _entry(name, seed, size, index)


def task_line(name: str, seed: int, size: int, index: int) -> dict[str, Any]:
    """The task for entry ``index``, as a JSON-ready object."""
    found = entry(name, seed, size, index)
    return {
        "dataset": name,
        "seed": seed,
        "size": size,
        "index": index,
        "question": found["question"],
        "answer": found["answer"],
        "metadata": _plain(found.get("metadata", {})),
    }


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists, keys strings)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"reasoning-gym gave a value JSON cannot hold: {exc}") from None


def extract(answer: str) -> str:
    """The text inside the last ``<answer>…</answer>``, stripped; else ``answer`` as given."""
    found = _ANSWER_TAG.findall(answer)
    return str(found[-1]).strip() if found else answer


# --- answers that scorers would run as code -----------------------------------------------------


def _literal_eval(source: Any, *scopes: Any) -> Any:
    """``eval`` as the scorers of :data:`EVALS_LITERAL` see it: Python literals only."""
    return ast.literal_eval(source)


def _literals_only(dataset: Any) -> None:
    """Make ``eval`` in the module of ``dataset``'s class evaluate literals only."""
    vars(sys.modules[type(dataset).__module__])["eval"] = _literal_eval


def unsafe_reason(name: str, answer: str) -> str | None:
    """Why ``answer`` must not reach dataset ``name``'s scorer (sympy would run it as code), or
    None."""
    return _expression_reason(answer) if name in PARSES_SYMPY else None


def _expression_reason(answer: str) -> str | None:
    if len(answer) > MAX_EXPRESSION_CHARS or not answer.isascii():
        return f"an expression answer is ASCII and at most {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(answer.strip(), mode="eval")
        _digits(tree.body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "sympy would run it as code, and it is not a plain arithmetic expression"
    except _Unsafe as exc:
        return f"sympy would run it as code: {exc}"
    return None


class _Unsafe(Exception):
    """An expression answer holds something other than plain arithmetic."""


_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.BitXor)


def _digits(node: ast.AST) -> float:
    """An upper bound on the decimal digits of the numbers ``node`` makes (symbols count as
    one); _Unsafe for anything but numbers, safe names, elementary functions and arithmetic."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return len(str(abs(node.value))) + 1.0
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        return math.log10(abs(node.value) + 1) + 1
    if isinstance(node, ast.Name):
        _check_name(node.id)
        return 1.0
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _digits(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id not in MATH_NAMES:
            raise _Unsafe(f"it calls {node.func.id!r}")
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise _Unsafe("it unpacks arguments")
        return max((_digits(arg) for arg in node.args), default=1.0)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
        return _bounded(_binary(node))
    raise _Unsafe(f"it holds a {type(node).__name__}")


def _binary(node: ast.BinOp) -> float:
    left, right = _digits(node.left), _digits(node.right)
    if isinstance(node.op, ast.Pow):
        if right > MAX_EXPONENT_DIGITS + 1:
            raise _Unsafe("an exponent of 1000 or more")
        return max(left, 1.0) * 10 ** (right - 1)
    if isinstance(node.op, (ast.Mult, ast.Div)):
        return left + right
    return max(left, right) + 1


def _bounded(digits: float) -> float:
    if digits > MAX_DIGITS:
        raise _Unsafe(f"numbers of more than {MAX_DIGITS:,} digits")
    return digits


def _check_name(name: str) -> None:
    if name in MATH_NAMES or name == "C":
        return
    if not _PLAIN_NAME.fullmatch(name) or keyword.iskeyword(name) or hasattr(builtins, name):
        raise _Unsafe(f"it names {name!r}")
    if name in _sympy_names():
        raise _Unsafe(f"it names sympy's {name!r}")


@functools.cache
def _sympy_names() -> frozenset[str]:
    namespace: dict[str, Any] = {}
    exec("from sympy import *", namespace)  # what parse_expr resolves names in
    return frozenset(namespace)


# --- the mode -----------------------------------------------------------------------------------


def reward_of(name: str, index: int, value: Any) -> float:
    """A scorer's value as a reward in [0, 1]; InvalidInput when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(
            f"reasoning-gym's {name!r} scorer returned {value!r} for entry {index}: "
            "a finite number is needed"
        )
    return min(1.0, max(0.0, float(value)))


def score_entry(name: str, seed: int, size: int, index: int, answer: str) -> Score:
    """Score ``answer`` (the final answer: its ``<answer>`` text is taken) with reasoning-gym's
    scorer against the rebuilt entry ``index``."""
    said = extract(answer)
    rebuilt = entry(name, seed, size, index)
    details: dict[str, Any] = {
        "dataset": name,
        "index": index,
        "parsed": said[:DETAIL_CHARS],
        "expected": None if rebuilt["answer"] is None else str(rebuilt["answer"])[:DETAIL_CHARS],
    }
    reason = unsafe_reason(name, said)
    if reason is not None:
        details["not_scored"] = reason
    with _LOCK, contextlib.redirect_stdout(sys.stderr):
        try:
            scorer = _dataset(name, seed, size).score_answer
            value = scorer("" if reason else said, copy.deepcopy(rebuilt))
        except Exception as exc:  # the scorer cannot read this answer: it earns nothing
            error = f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS]
            return Score(reward=0.0, correct=False, details={**details, "scorer_error": error})
    reward = reward_of(name, index, value)
    return Score(reward=reward, correct=reward == 1.0, details=details)


class ReasoningGymSession:
    """No tools: the model answers; reasoning-gym's scorer grades the rebuilt entry."""

    def __init__(self, task: dict[str, Any]) -> None:
        """Score entry (dataset, seed, size, index); the task's own answer is never read."""
        self.tools: list[Tool] = []
        self.source = (task["dataset"], task["seed"], task["size"], task["index"])

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """reasoning-gym tasks offer no tools."""
        return f"error: there is no tool named {name!r}; answer directly"

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """reasoning-gym's own score of the answer (in a thread: some scorers use sympy)."""
        return await asyncio.to_thread(score_entry, *self.source, answer)


class ReasoningGymMode:
    """reasoning-gym's 100-odd procedural task families."""

    name = "reasoning-gym"
    uses_tools = False
    resume = "replay"  # a crashed rollout reuses the reply its last attempt received

    def check(self, task: Any, where: str) -> None:
        """The source fields, then the question, answer and metadata as the generator makes
        them."""
        require_fields(
            task, where, {"dataset": str, "seed": int, "size": int, "index": int, "question": str}
        )
        name, seed, size, index = (task[k] for k in ("dataset", "seed", "size", "index"))
        error = source_error(name, seed, size)
        if error is not None:
            raise InvalidInput(f"{where}: field {error[0]!r}: {error[1]}")
        if not 0 <= index < size:
            raise InvalidInput(f"{where}: field 'index' {index} is out of range: 0 to {size - 1}")
        _check_texts(task, where)
        expected = task_line(name, seed, size, index)
        for field in ("question", "answer", "metadata"):
            if field in task and task[field] != expected[field]:
                hint = " (made under another PYTHONHASHSEED?)" if name in HASH_SEEDED else ""
                raise InvalidInput(
                    f"{where}: field {field!r} is not what reasoning-gym {version()} generates "
                    f"for dataset {name!r}, seed {seed}, size {size}, index {index}{hint}"
                )

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Ask for the final answer between ``<answer>`` tags, reasoning-gym's convention."""
        return SYSTEM_PROMPT

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The question (checked to be the generator's)."""
        return str(task["question"])

    async def open(self, task: dict[str, Any], env: Any) -> ReasoningGymSession:
        """A session for the rebuilt entry; InvalidInput when this process rebuilds another
        question than the one the model is shown."""
        name, seed, size, index = (task[k] for k in ("dataset", "seed", "size", "index"))
        check_source(name, seed, size)
        rebuilt = await asyncio.to_thread(entry, name, seed, size, index)
        if rebuilt["question"] != task["question"]:
            raise InvalidInput(
                f"reasoning-gym {version()} here rebuilds another question for dataset "
                f"{name!r}, seed {seed}, size {size}, index {index} than the task's"
            )
        return ReasoningGymSession(task)


def _check_texts(task: dict[str, Any], where: str) -> None:
    if "answer" not in task:
        raise InvalidInput(f"{where}: field 'answer' is missing")
    for field in ("question", "answer"):
        value = task[field]
        if field == "answer" and value is None:
            continue
        if not isinstance(value, str):
            raise InvalidInput(f"{where}: field {field!r} must be str, got {type(value).__name__}")
        if len(value) > MAX_TEXT_CHARS:
            raise InvalidInput(
                f"{where}: field {field!r} is longer than {MAX_TEXT_CHARS:,} characters"
            )
    if "metadata" in task and not isinstance(task["metadata"], dict):
        raise InvalidInput(
            f"{where}: field 'metadata' must be an object, got {type(task['metadata']).__name__}"
        )
