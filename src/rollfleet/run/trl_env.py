"""A rollfleet mode as the ``environment_factory`` of TRL's ``GRPOTrainer`` (docs/trl.md).

There TRL generates and calls the environment; rollfleet's fleet takes no part. TRL 1.16
(``GRPOTrainer.__init__`` and ``_generate_and_score_completions``) calls ``factory()`` for one
instance per rollout (and reuses them, batch after batch), reads the class's public methods as the
tools (each method's signature and Google-style docstring become the JSON schema that the chat
template shows), calls ``reset(**example)`` before each rollout, synchronously in the trainer's
thread, runs async tools and an async ``get_reward()`` on its own event loop (a daemon thread,
``GRPOTrainer.async_loop``), and logs ``get_reward``'s value under the class's name. TRL calls
nothing else: there is no ``close``.

:func:`environment_factory` builds that class from a mode: one async method per tool of the
mode's sessions, forwarding to the rollout's session; ``answer(text)``, by which the model hands
in its final answer (its reply text never reaches the environment); and ``get_reward()``, the
mode's own score of that answer given the calls made. ``reset`` checks the task with the mode's
``check`` and starts a new rollout; the session opens at the rollout's first tool call or at
``get_reward``, on the loop that runs them (TRL's), and every call of the rollout must come from
that loop. No thread is started; the sample session that lists the tools opens on a loop of its
own, in a thread that ends before :func:`environment_factory` returns.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from rollfleet.envs import get_mode
from rollfleet.envs.base import (
    Mode,
    Observation,
    Session,
    Tool,
    Transcript,
    observation_of,
    score_of,
)
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput, PoolError, RollfleetError

T = TypeVar("T")

WHERE = "trl example"  # how a task from TRL is named in the mode's check errors
TASK_COLUMN = "rollfleet_task"  # a dataset column holding the task as JSON (see task_of)
MAX_OBSERVATION_CHARS = 4000  # of a tool's observation shown to the model
ANSWER = Tool(
    "answer",
    "submit your final answer; the task ends with it, and only the first answer counts",
    {"text": "your final answer"},
)
ANSWER_NOTE = "When you know the answer, call the answer tool with it."
RESERVED = frozenset({"answer", "reset", "get_reward"})
_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}


class ModeEnvironment:
    """One rollout of a mode's task, as TRL drives it; :func:`environment_factory` makes the
    subclass with a method per tool."""

    _mode: Mode
    _tools: tuple[Tool, ...]

    def __init__(self) -> None:
        """An environment waiting for ``reset``."""
        self._start(None)

    def reset(self, **example: Any) -> None:
        """Start a rollout of the example's task (:func:`task_of`), checked by the mode: its
        InvalidInput names the field when the task is bad."""
        task = task_of(example)
        self._mode.check(task, WHERE)
        self._start(task)

    def _start(self, task: Any) -> None:
        """Forget the last rollout: no session, calls, answer or reward yet."""
        self._task = task
        self._session: Session | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # every call in order, as the agent loop records them; "turn" counts calls (TRL does
        # not tell the environment where the model's turns begin)
        self._calls: list[dict[str, Any]] = []
        self._answer: str | None = None
        self._reward: float | None = None

    async def get_reward(self) -> float:
        """The mode's score of the submitted answer, given every call made (0.0 without an
        answer); computed once per rollout."""
        if self._reward is None:
            self._reward = await self._score()
        return self._reward

    async def _score(self) -> float:
        """The mode's score of the answer (0.0 without one)."""
        if self._answer is None:
            return 0.0
        transcript = Transcript(calls=list(self._calls))
        return (await score_of(await self._open(), self._answer, transcript)).reward

    async def _run(self, name: str, args: dict[str, Any]) -> str:
        """Run a tool of the mode's session; the observation's text, capped."""
        if self._answer is not None:
            return "error: the task is over (an answer is in); no more tool calls"
        found = observation_of(await (await self._open()).call(name, args))
        self._calls.append(
            {
                "turn": len(self._calls),
                "tool": name,
                "args": args,
                "observation": found.text,
                "images": len(found.images),
            }
        )
        if found.done:  # the episode ended with this call: its name is the answer, as in the loop
            self._answer = name
        return _capped(found)

    async def _submit(self, name: str, args: dict[str, Any]) -> str:
        """Take the final answer (the first one only)."""
        if self._answer is not None:
            return "error: an answer is already in; it stands"
        text = args.get("text")
        if isinstance(text, bool) or not isinstance(text, (str, int, float)):
            return 'error: answer needs {"text": "<your final answer>"}'
        self._answer = str(text)  # a parser may have typed "122" as a number
        return "answer received; the task is over"

    async def _open(self) -> Session:
        """The rollout's session, opened on the running loop at the first need."""
        loop = asyncio.get_running_loop()
        if self._session is None:
            if self._task is None:
                raise RollfleetError("call reset(**task) before the environment's tools")
            session = await self._mode.open(self._task, None)
            if tuple(session.tools) != self._tools:
                raise RollfleetError(
                    f"mode {self._mode.name}: this task's tools differ from the ones TRL shows "
                    "(environment_factory needs a mode whose tools do not depend on the task)"
                )
            self._session, self._loop = session, loop
        elif loop is not self._loop:
            raise RollfleetError(
                "this rollout's session lives on another event loop: call an "
                "environment's methods from one loop (TRL's)"
            )
        return self._session


def environment_factory(mode_ref: str, sample_task: Any = None) -> type[ModeEnvironment]:
    """The environment class of the mode ``mode_ref`` names (as ``--mode``), for
    ``GRPOTrainer(environment_factory=...)``: each tool of the mode a method, plus ``answer``.

    The tools are read once, from a session opened on ``sample_task`` (checked by the mode; an
    empty task without one), so a mode's tools must not depend on the task: a rollout whose
    session offers other tools fails. Sessions open with no ``ctx.env``: modes that need a
    pooled environment (py, rag, web, osworld) are refused here. Each tool's schema is checked
    to be the one TRL will derive from the method (InvalidInput otherwise)."""
    mode = get_mode(mode_ref)
    tools = _tools_of(mode, mode_ref, sample_task)
    namespace: dict[str, Any] = {"_mode": mode, "_tools": tools, "__module__": __name__}
    for tool in tools:
        namespace[_method_name(tool, mode_ref)] = _method(tool, ModeEnvironment._run)
    namespace[ANSWER.name] = _method(ANSWER, ModeEnvironment._submit)
    for tool in (*tools, ANSWER):
        _check_schema(namespace[tool.name], tool, mode_ref)
    name = "".join(part.capitalize() for part in _words(mode.name)) + "Environment"
    return cast(type[ModeEnvironment], type(name, (ModeEnvironment,), namespace))


def task_of(example: Mapping[str, Any]) -> Any:
    """The task in a TRL example: its ``rollfleet_task`` column (JSON, as :func:`task_dataset`
    writes it) when it has one, else its fields less TRL's ``prompt``."""
    if TASK_COLUMN not in example:
        return {key: value for key, value in example.items() if key != "prompt"}
    try:
        return json.loads(example[TASK_COLUMN])
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{WHERE}: field {TASK_COLUMN!r} is not a JSON task: {exc}") from None


def task_dataset(data: Path, mode_ref: str) -> Any:
    """A ``datasets.Dataset`` of the tasks in ``data`` (checked by the mode): per task, TRL's
    ``prompt`` (the mode's system prompt with :data:`ANSWER_NOTE`, and its user prompt) and the
    task as JSON in ``rollfleet_task`` (a column per field would make ``datasets`` merge dicts of
    different keys, filling each with the others' keys as None)."""
    from datasets import Dataset

    mode = get_mode(mode_ref)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": f"{mode.system_prompt(line.task)}\n{ANSWER_NOTE}"},
                {"role": "user", "content": mode.user_prompt(line.task)},
            ],
            TASK_COLUMN: json.dumps(line.task),
        }
        for line in load_tasks(data, mode)
    ]
    return Dataset.from_list(rows)


def _tools_of(mode: Mode, mode_ref: str, sample_task: Any) -> tuple[Tool, ...]:
    """The tools of a session of ``mode`` opened on ``sample_task`` (none for a mode without)."""
    if not mode.uses_tools:
        return ()
    if sample_task is not None:
        mode.check(sample_task, "sample_task")
    try:
        session = _run_apart(lambda: mode.open(sample_task or {}, None))
    except PoolError as exc:
        raise InvalidInput(
            f"environment_factory({mode_ref!r}): {exc}; TRL's environments open "
            "sessions without one"
        ) from None
    except Exception as exc:
        hint = "" if sample_task is not None else "; pass sample_task (any task of the mode)"
        raise InvalidInput(
            f"environment_factory({mode_ref!r}): opening a session failed "
            f"({type(exc).__name__}: {exc}){hint}"
        ) from None
    return tuple(session.tools)


def _run_apart(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on a loop of its own, in a thread that ends with it (the caller may be
    inside a running loop, as a notebook is)."""
    with ThreadPoolExecutor(1, thread_name_prefix="rollfleet-trl-env") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def _method_name(tool: Tool, mode_ref: str) -> str:
    """The tool's name, if it can be a tool method's."""
    name = tool.name
    if not name.isidentifier() or name.startswith("_") or name in RESERVED:
        reserved = ", ".join(sorted(RESERVED))
        raise InvalidInput(
            f"mode {mode_ref}: tool {name!r} cannot be a TRL tool method "
            f"(a Python name, not starting with _, not {reserved})"
        )
    return name


def _method(tool: Tool, run: Callable[[Any, str, dict[str, Any]], Coroutine[Any, Any, str]]) -> Any:
    """An async method taking the tool's parameters as keywords and passing them to ``run``,
    with the signature, annotations and docstring TRL reads the tool's schema from."""

    async def method(self: Any, **args: Any) -> str:
        return await run(self, tool.name, args)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    try:
        params += [_parameter(tool, key) for key in tool.parameters]
        signature = inspect.Signature(params)
    except ValueError as exc:
        raise InvalidInput(
            f"tool {tool.name}: its parameters cannot be a method's: {exc}"
        ) from None
    method.__name__ = method.__qualname__ = tool.name
    method.__doc__ = _docstring(tool)
    method.__annotations__ = {p.name: p.annotation for p in params[1:]}  # no return: not in schema
    setattr(method, "__signature__", signature)  # noqa: B010
    return method


def _parameter(tool: Tool, key: str) -> inspect.Parameter:
    """A keyword parameter for one of the tool's (ValueError when ``key`` is no Python name)."""
    default = None if key in tool.optional else inspect.Parameter.empty
    annotation = _annotation(tool.schema.get(key, {}))
    return inspect.Parameter(
        key, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _annotation(schema: Mapping[str, Any]) -> Any:
    """The Python type transformers turns back into ``schema`` (``str`` for a plain string)."""
    if "enum" in schema:
        return cast(Any, Literal)[tuple(schema["enum"])]
    kind = schema.get("type", "string")
    if kind == "array" and "items" in schema:
        return list[_annotation(schema["items"])]  # type: ignore[misc]
    return _TYPES.get(kind, Any) if isinstance(kind, str) else Any


def _docstring(tool: Tool) -> str:
    """The tool's description, then a Google-style ``Args:`` block of its parameters."""
    args = "".join(f"\n    {key}: {text}" for key, text in tool.parameters.items())
    return f"{tool.description}\n\nArgs:{args}" if args else tool.description


def _check_schema(method: Any, tool: Tool, mode_ref: str) -> None:
    """InvalidInput unless transformers derives ``tool.openai()`` from ``method``."""
    from transformers.utils.chat_template_utils import get_json_schema

    want = tool.openai()
    try:
        got = get_json_schema(method)
    except Exception as exc:
        got = {"error": f"{type(exc).__name__}: {exc}"}
    else:  # transformers leaves out an empty "required"
        got["function"]["parameters"].setdefault("required", [])
    if got != want:
        raise InvalidInput(
            f"mode {mode_ref}: TRL would show tool {tool.name} as {json.dumps(got)}, "
            f"not as the mode's {json.dumps(want)}"
        )


def _capped(found: Observation) -> str:
    """An observation's text, cut to MAX_OBSERVATION_CHARS (its images are not shown)."""
    text = found.text
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    cut = len(text) - MAX_OBSERVATION_CHARS
    return f"{text[:MAX_OBSERVATION_CHARS]}\n[cut: {cut} more characters]"


def _words(name: str) -> list[str]:
    """A mode's name split at anything not a letter or digit (``reasoning-gym``)."""
    return "".join(ch if ch.isalnum() else " " for ch in name).split()
