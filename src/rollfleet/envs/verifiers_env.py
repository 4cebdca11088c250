"""``verifiers:REF``: a verifiers (0.4, ``verifiers.v1``) taskset's tasks, answered through the
fleet and scored by the taskset's own rewards.

``REF`` (``module:factory`` or ``path/to/file.py:factory``) names a callable returning a
``verifiers.v1.Taskset``. A task line names one of its tasks by position, as ``rollfleet tasks
verifiers REF`` writes it::

    {"index": 3, "prompt": "What is 2 + 2?"}

``prompt`` may be left out; when it is given it must be what the taskset makes at that
position (the task file is input, not truth: a session rebuilds the task from the taskset in
its runner process and never reads anything else from the line).

The model is prompted with the task's system prompt (the taskset's, else
:data:`DEFAULT_SYSTEM`) and its prompt, and answers through the agent's ``ctx.llm`` like any
mode. Scoring is verifiers' own: the conversation becomes a ``verifiers.v1.Trace`` (system and
user messages as given, every assistant turn as sampled) and ``Task.score`` runs the task's
``@vf.reward`` and ``@vf.metric`` functions on it, exactly as ``vf replay`` re-scores a
recorded trace. The reward is ``trace.reward`` (the weighted sum); ``correct`` when every reward
gave its full 1.0.

What needs verifiers' own runtime is refused by name at ``check``, never skipped silently: a
task whose ``toolsets`` launch MCP tool servers, judges (they call a model of their own), and
rewards or metrics that take a ``runtime`` (a sandbox this mode does not create).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import threading
from collections.abc import Iterator
from typing import Any

from rollfleet import refs
from rollfleet.envs.base import Score, Tool, Transcript, require_fields
from rollfleet.errors import InvalidInput

MAX_TASKS = 100_000  # positions of one taskset this mode reads
MAX_PROMPT_CHARS = 100_000
DEFAULT_SYSTEM = "You are a helpful assistant."
INSTALL = "the verifiers mode needs the verifiers package (0.4): pip install verifiers"


def _vf() -> Any:
    """``verifiers.v1``, imported on first use; InvalidInput naming the package without it."""
    try:
        import verifiers.v1 as vf
    except ModuleNotFoundError as exc:
        missing = exc.name or "verifiers"
        raise InvalidInput(
            INSTALL if missing.split(".")[0] == "verifiers" else f"{INSTALL} ({missing} is missing)"
        ) from None
    return vf


class _Tasks:
    """A taskset's tasks by position, built as far as asked (at most :data:`MAX_TASKS`)."""

    def __init__(self, taskset: Any) -> None:
        """Read ``taskset`` lazily (it may be a generator)."""
        self.taskset = taskset
        self._built: list[Any] = []
        self._rest: Iterator[Any] = itertools.islice(iter(taskset), MAX_TASKS)
        self._lock = threading.Lock()

    def get(self, index: int) -> Any | None:
        """The task at ``index``, or None when the taskset has none there."""
        with self._lock:
            while len(self._built) <= index:
                found = next(self._rest, None)
                if found is None:
                    return None
                self._built.append(found)
            return self._built[index]

    def count(self) -> int:
        """How many tasks the taskset holds (at most :data:`MAX_TASKS`)."""
        while self.get(len(self._built)) is not None:
            pass
        return len(self._built)


@functools.lru_cache(maxsize=8)
def tasks_of(ref: str) -> _Tasks:
    """The tasks of the taskset ``ref``'s factory makes (once per process)."""
    vf = _vf()
    try:
        factory = refs.resolve(ref)
    except InvalidInput as exc:
        raise InvalidInput(f"--mode verifiers:{ref}: {exc.message}") from None
    if not callable(factory):
        raise InvalidInput(f"--mode verifiers:{ref}: {factory!r} is not callable")
    try:
        made = factory()
    except Exception as exc:
        raise InvalidInput(
            f"--mode verifiers:{ref}: its factory raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(made, vf.Taskset):
        raise InvalidInput(
            f"--mode verifiers:{ref}: the factory returned {type(made).__name__}, not a "
            "verifiers.v1.Taskset"
        )
    return _Tasks(made)


def task_at(ref: str, index: int) -> Any:
    """The verifiers Task at ``index``; InvalidInput when there is none."""
    found = tasks_of(ref).get(index) if 0 <= index < MAX_TASKS else None
    if found is None:
        raise InvalidInput(f"verifiers:{ref} has no task at index {index}")
    return found


def prompts(task: Any, fallback: str | None) -> tuple[str, str]:
    """``(system, user)`` text of a verifiers task; InvalidInput for a prompt this mode cannot
    show (none, an assistant turn in it, images, too long)."""
    vf = _vf()
    system, prompt = task.data.system_prompt, task.data.prompt
    if isinstance(prompt, str):
        user = prompt
    elif prompt:
        parts = []
        for message in prompt:
            if isinstance(message, vf.SystemMessage):
                system = vf.types.content_text(message.content)
            elif isinstance(message, vf.UserMessage) and isinstance(message.content, str):
                parts.append(message.content)
            else:
                raise InvalidInput(
                    f"a prompt holding a {type(message).__name__} with {type(message.content)}"
                    " content: this mode shows system and user text"
                )
        user = "\n\n".join(parts)
    else:
        raise InvalidInput("the task has no prompt (the user opens the conversation)")
    if len(user) > MAX_PROMPT_CHARS:
        raise InvalidInput(f"its prompt is longer than {MAX_PROMPT_CHARS:,} characters")
    return system or fallback or DEFAULT_SYSTEM, user


def refusal(task: Any) -> str | None:
    """Why a verifiers task needs what this mode does not create, or None when it can run here."""
    kind = type(task).__name__
    if type(task).toolsets(task.config):
        return f"{kind} launches MCP toolsets (verifiers' own runtime serves them)"
    if task.config.judges:
        return f"{kind} is scored by judges, which call a model of their own"
    for hook in ("reward", "metric"):
        for fn in task.hooks(hook):
            runtime = inspect.signature(fn).parameters.get("runtime")
            if runtime is not None and runtime.default is inspect.Parameter.empty:
                return f"{kind}'s {hook} {fn.__name__} needs the task's runtime (a sandbox)"
    return None


def trace_of(task: Any, transcript: Transcript, answer: str) -> Any:
    """The conversation as a ``verifiers.v1.Trace`` (each assistant turn sampled), as verifiers
    records one; a transcript without messages becomes the task's prompt and ``answer``."""
    vf = _vf()
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )
    messages = transcript.messages or [
        {"role": "user", "content": task.data.prompt_text},
        {"role": "assistant", "content": answer},
    ]
    for position, message in enumerate(messages):
        role, text = message.get("role"), _text(message.get("content"))
        made = {
            "system": vf.SystemMessage,
            "user": vf.UserMessage,
            "assistant": vf.AssistantMessage,
        }.get(str(role), vf.UserMessage)(content=text)
        trace.nodes.append(
            vf.MessageNode(
                parent=position - 1 if position else None,
                message=made,
                sampled=role == "assistant",
            )
        )
    trace.ok = trace.is_completed = True
    return trace


def _text(content: Any) -> str:
    """A chat message's text (its text parts, when it has parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class VerifiersSession:
    """No tools: the model answers; the task's own rewards score the conversation."""

    def __init__(self, task: Any) -> None:
        """Score with verifiers task ``task`` (rebuilt from the taskset)."""
        self.tools: list[Tool] = []
        self.task = task

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """This mode offers no tools."""
        return f"error: there is no tool named {name!r}; answer directly"

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """verifiers' ``Task.score`` on the conversation: the weighted sum of its rewards."""
        trace = trace_of(self.task, transcript or Transcript(), answer)
        await self.task.score(trace)
        rewards = {k: v for k, v in trace.rewards.items() if v is not None}
        for name, value in rewards.items():
            if not math.isfinite(value.score) or not math.isfinite(value.weight):
                raise InvalidInput(
                    f"{type(self.task).__name__}'s reward {name} gave {value.score} (weight "
                    f"{value.weight}): a finite number is needed"
                )
        return Score(
            reward=float(trace.reward),
            correct=bool(rewards) and all(v.score >= 1.0 for v in rewards.values()),
            details={
                "rewards": {k: v.score for k, v in rewards.items()},
                "metrics": {k: v for k, v in trace.metrics.items() if v is not None},
            },
        )


class VerifiersMode:
    """Any verifiers taskset whose tasks need no runtime of verifiers' own."""

    name = "verifiers"
    uses_tools = False
    resume = "replay"  # a crashed rollout reuses the reply its last attempt received

    def __init__(self, ref: str | None = None) -> None:
        """The taskset ``ref``'s factory makes (``--mode verifiers:module:factory``)."""
        if not ref:
            raise InvalidInput(
                "--mode verifiers needs the taskset's factory: --mode verifiers:module:factory"
                " or verifiers:path/to/file.py:factory"
            )
        self.ref = ref
        tasks_of(ref)

    def _task(self, task: dict[str, Any]) -> Any:
        return task_at(self.ref, task["index"])

    def check(self, task: Any, where: str) -> None:
        """An ``index`` of the taskset whose task can run here, and its ``prompt`` if given."""
        require_fields(task, where, {"index": int})
        index = task["index"]
        if not 0 <= index < MAX_TASKS or tasks_of(self.ref).get(index) is None:
            raise InvalidInput(f"{where}: field 'index' {index}: the taskset has no task there")
        found = self._task(task)
        reason = refusal(found)
        if reason is not None:
            raise InvalidInput(f"{where}: task {index}: {reason}")
        try:
            user = prompts(found, tasks_of(self.ref).taskset.system_prompt)[1]
        except InvalidInput as exc:
            raise InvalidInput(f"{where}: task {index}: {exc.message}") from None
        if "prompt" in task and task["prompt"] != user:
            raise InvalidInput(
                f"{where}: field 'prompt' is not what the taskset makes at index {index}"
            )

    def system_prompt(self, task: dict[str, Any]) -> str:
        """The task's system prompt (the taskset's, else :data:`DEFAULT_SYSTEM`)."""
        return prompts(self._task(task), tasks_of(self.ref).taskset.system_prompt)[0]

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The task's prompt, as the taskset makes it."""
        return prompts(self._task(task), tasks_of(self.ref).taskset.system_prompt)[1]

    async def open(self, task: dict[str, Any], env: Any) -> VerifiersSession:
        """A session scoring with the task the taskset makes at ``index``."""
        found = self._task(task)
        reason = refusal(found)
        if reason is not None:
            raise InvalidInput(f"task {task['index']}: {reason}")
        return VerifiersSession(found)


def task_line(ref: str, index: int) -> dict[str, Any]:
    """The task line for position ``index`` of the taskset ``ref`` makes."""
    found = task_at(ref, index)
    return {"index": index, "prompt": prompts(found, tasks_of(ref).taskset.system_prompt)[1]}
