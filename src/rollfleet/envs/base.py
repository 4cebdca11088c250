"""What every mode shares: tools, sessions, task-field checks, answer normalisation.

A *mode* (``math``, ``py``, ``rag``, ``web``, ``osworld``) checks a task before anything runs,
writes the prompts, and opens a *session* per rollout. A session offers tools to the agent,
runs them, and scores the final answer. Rewards are always computed from the answer (and,
for ``py`` and ``osworld``, from running it); nothing is hard-coded.
"""

from __future__ import annotations

import base64
import inspect
import math
import re
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.errors import InvalidInput
from rollfleet.pool.base import EnvSource, Instance

ToolFn = Callable[[dict[str, Any]], Awaitable[str]]


@dataclass(frozen=True)
class Tool:
    """One tool an environment offers: a name, what it does, its parameters (strings unless
    ``schema`` gives a parameter's JSON schema; all required but those in ``optional``).
    ``side_effects``: running it changes something outside the session's own state (sends,
    pays, deletes): a resumed rollout never runs one call of it twice."""

    name: str
    description: str
    parameters: Mapping[str, str] = field(default_factory=dict)  # name -> description
    schema: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()
    side_effects: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's ``tools`` format."""
        props = {
            k: {**self.schema.get(k, {"type": "string"}), "description": v}
            for k, v in self.parameters.items()
        }
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": [k for k in self.parameters if k not in self.optional],
                },
            },
        }

    def signature(self) -> str:
        """One line for a plain-text prompt: ``name {"arg": "..."}: description``."""
        args = ", ".join(
            f'"{k}": "<{v}{", optional" if k in self.optional else ""}>"'
            for k, v in self.parameters.items()
        )
        return f"{self.name} {{{args}}}: {self.description}"


@dataclass(frozen=True)
class Observation:
    """What a tool call (or a reset) showed: text, and screenshots as PNG bytes; ``done`` when
    the episode ended with it."""

    text: str
    images: tuple[bytes, ...] = ()
    done: bool = False


def image_part(png: bytes) -> dict[str, Any]:
    """A PNG as an OpenAI chat content part (a base64 data URL)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


def observation_of(result: str | Observation) -> Observation:
    """A tool's result as an Observation (a plain string is text only)."""
    return result if isinstance(result, Observation) else Observation(result)


@dataclass(frozen=True)
class Score:
    """A computed reward with what it was computed from."""

    reward: float
    correct: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transcript:
    """The whole rollout a session scores: the conversation as the model saw it (``messages``:
    system, user, assistant and observation turns) and every tool call in order (``calls``:
    ``turn``, ``tool``, ``args``, ``observation``)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)


class Session(Protocol):
    """One rollout's view of an environment.

    A session may also have ``first: Observation | None`` (what the environment showed before
    any action, e.g. OSWorld's reset screenshot), read with :func:`first_observation`, and
    ``async turn_reward(text, calls) -> float``, a reward for one turn alone (read with
    :func:`turn_reward`).
    """

    tools: list[Tool]

    async def call(self, name: str, args: dict[str, Any]) -> str | Observation:
        """Run a tool and return its observation (text, or an Observation with screenshots)."""
        ...

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """Compute the reward of a final answer, seeing the whole ``transcript`` (a session
        written as ``score(self, answer)`` is called with the answer alone)."""
        ...


class EnvSpec(BaseModel):
    """What environment a runner process provides (sent to it as JSON); a mode reads the
    fields it needs in its ``env_source``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: str
    use_pool: bool = Field(
        default=False, description="share num_instances among the process's rollouts"
    )
    num_instances: int = Field(default=3, ge=1)
    corpus: str | None = None
    site: str | None = None
    sandbox: dict[str, Any] = Field(default_factory=dict, description="SandboxLimits fields")
    desktop: dict[str, Any] = Field(default_factory=dict, description="DesktopOptions fields")
    standin: bool = Field(
        default=False, description="desktop: DesktopEnvStandIn instead of OSWorld (tests)"
    )


class Mode(Protocol):
    """A task family: checks tasks, writes prompts, opens sessions.

    Optional, read with :func:`env_source_of`, :func:`preflight_of` and
    :func:`shares_process`: ``env_source(spec, concurrency) -> EnvSource | None`` (what
    ``ctx.env`` a runner process gives the mode's rollouts; none without it),
    ``preflight(spec, local) -> None`` (fail fast, in one line, when the environment cannot exist
    on this machine), ``shares_process: bool`` (False: one runner process per rollout, for
    environments that use this machine's CPU or do things to their process; True without it),
    ``pools_instances: bool`` (its environments come from a pool that ``--use-vm-pool`` shares
    among one process's rollouts), and ``observations`` (the ``--observation`` choices, the
    first the default), ``resume`` (how a crashed rollout's environment comes back:
    ``replay``, ``snapshot`` or ``restart``, the default; :mod:`rollfleet.agents.resume`).
    """

    name: str
    uses_tools: bool  # its sessions offer tools: an answer may take more than one turn

    def check(self, task: Any, where: str) -> None:
        """Raise InvalidInput naming ``where`` (file:line) and the field when the task is bad."""
        ...

    def system_prompt(self, task: dict[str, Any]) -> str:
        """The system message."""
        ...

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The first user message."""
        ...

    async def open(self, task: dict[str, Any], env: Any) -> Session:
        """A session for one rollout; ``env`` is ``ctx.env`` (an Instance) or None."""
        ...


def env_source_of(mode: Mode, spec: EnvSpec, concurrency: int = 1) -> EnvSource | None:
    """The EnvSource a mode's rollouts get in a runner process (None: no ``ctx.env``)."""
    make = getattr(mode, "env_source", None)
    return None if make is None else make(spec, concurrency)


def preflight_of(mode: Mode, spec: EnvSpec, local: bool) -> None:
    """Run a mode's preflight check, if it has one (``local``: runners start on this machine,
    without a remote control plane hosting the environment)."""
    check = getattr(mode, "preflight", None)
    if check is not None:
        check(spec, local)


def shares_process(mode: Mode) -> bool:
    """Whether a mode's rollouts may share one runner process."""
    return bool(getattr(mode, "shares_process", True))


async def turn_reward(session: Session, text: str, calls: list[dict[str, Any]]) -> float:
    """The reward a session gives one turn (its reply ``text`` and its ``calls``: tool, args,
    observation), from its optional ``turn_reward`` method; 0.0 for sessions without one.
    It reaches the tokens of that turn only (e.g. a penalty for a tool error)."""
    score = getattr(session, "turn_reward", None)
    if score is None:
        return 0.0
    value = await score(text, calls)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidInput(f"turn_reward returned {value!r}: a finite number is needed")
    return float(value)


async def score_of(session: Session, answer: str, transcript: Transcript) -> Score:
    """The session's score of ``answer``, given the transcript when its ``score`` takes one."""
    method = session.score
    try:
        takes = len(inspect.signature(method).parameters) >= 2
    except (TypeError, ValueError):
        takes = True
    return await (method(answer, transcript) if takes else method(answer))


def first_observation(session: Session) -> Observation | None:
    """What the session showed before any action (None for modes that show nothing)."""
    first = getattr(session, "first", None)
    return first if isinstance(first, Observation) else None


def require_fields(task: Any, where: str, fields: Mapping[str, type | tuple[type, ...]]) -> None:
    """Check that ``task`` is an object with each field present, non-empty and of its type."""
    if not isinstance(task, dict):
        raise InvalidInput(f"{where}: expected a JSON object, got {type(task).__name__}")
    for name, kind in fields.items():
        if name not in task:
            raise InvalidInput(f"{where}: field {name!r} is missing")
        value = task[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise InvalidInput(
                f"{where}: field {name!r} must be {names}, got {type(value).__name__}"
            )
        if isinstance(value, (str, list)) and not value:
            raise InvalidInput(f"{where}: field {name!r} is empty")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse spaces (SQuAD-style)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between two answers after normalisation."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common: dict[str, int] = {}
    for tok in pred:
        if tok in ref:
            common[tok] = min(pred.count(tok), ref.count(tok))
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


class StaticEnv:
    """An EnvSource handing every rollout the same in-process object (a search index, a site)."""

    def __init__(
        self,
        handle: Any,
        name: str,
        endpoint: str | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """Lease ``handle`` to everyone; ``on_close`` runs at close()."""
        self.handle, self.name, self.endpoint, self._on_close = handle, name, endpoint, on_close

    @asynccontextmanager
    async def lease(
        self, *, attempt_id: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[Instance]:
        """The shared object, wrapped as an Instance."""
        yield Instance(
            instance_id=f"{self.name}-0",
            pool=self.name,
            endpoint=self.endpoint,
            handle=self.handle,
            attempt_id=attempt_id,
        )

    async def close(self) -> None:
        """Run the close hook."""
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def handle_of(env: Any) -> Any:
    """The provider object behind ``ctx.env`` (an Instance), or ``env`` itself."""
    return getattr(env, "handle", env)
