"""``openenv``: drive any OpenEnv environment server, and serve a rollfleet mode as one.

**Driving one** (``--mode openenv:URL``). `OpenEnv <https://pypi.org/project/openenv-core/>`_
servers expose ``reset``, ``step`` and ``/schema``; their HTTP ``/reset`` and ``/step`` make a
fresh environment per request, so an episode goes over the WebSocket ``/ws``, one connection per
rollout (its message protocol, spoken here directly, needs no install). A task line is the
reset's arguments (``{"seed": 3}``, ``{}``; at most :data:`MAX_TASK_CHARS` as JSON); the reset
also gets ``episode_id``, the rollout's attempt id, unless the line sets one. The session offers
one tool, ``step``, whose parameters are the fields of the server's action schema (``/schema``,
read once per process; the base ``metadata`` field is left out). A call sends the action and
returns the observation's fields as compact JSON (at most :data:`MAX_OBSERVATION_CHARS`); an
action the server refuses (validation, or the environment raising) is an ``error: …``
observation for the model, and the episode goes on. The episode ends when an observation says
``done``.

Reward: the **sum** of the ``reward`` of every observation of the episode (the reset's too;
``null`` counts 0), as the server sent them; the model's final answer is not sent anywhere and
does not change it. ``correct`` means the episode ended (``done``) with a sum above 0. A server
that cannot be reached, closes the connection, is full, or sends something unreadable or a
reward that is not a finite number raises :class:`InfraError` (the attempt is retried, never
scored); a reset it refuses is :class:`InvalidInput` (the task line is wrong for it).

Serving a rollfleet mode as an OpenEnv environment is :mod:`rollfleet.envs.openenv_serve`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from rollfleet.envs.base import (
    EnvSpec,
    Observation,
    Score,
    Tool,
    Transcript,
    handle_of,
)
from rollfleet.errors import InfraError, InvalidInput
from rollfleet.pool.base import Instance

MAX_URL_CHARS = 400
MAX_TASK_CHARS = 4096  # a task line (the reset's arguments), as JSON
MAX_ACTION_CHARS = 8192  # an action's arguments, as JSON
MAX_MESSAGE_BYTES = 4 * 2**20  # one WebSocket message from the server
MAX_SCHEMA_BYTES = 256 * 2**10  # the server's /schema answer
MAX_SCHEMA_NODES = 5000  # of the action schema with its $refs inlined
MAX_DEPTH = 12  # of the action schema's nesting, inlined $refs included (recursive ones stop)
MAX_FIELDS = 32  # action fields
MAX_OBSERVATION_CHARS = 4000  # of an observation shown to the model
MAX_ERROR_CHARS = 600  # of a refusal shown to the model
MAX_DESCRIPTION_CHARS = 300
MAX_REWARDS_KEPT = 256  # per-observation rewards in a score's details
CONNECT_TIMEOUT_S = 10.0
MESSAGE_TIMEOUT_S = 60.0  # for the server's answer to one reset or step
HTTP_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 2.0  # for the server to close a session we said goodbye to
HIDDEN_FIELDS = frozenset({"metadata"})  # on every OpenEnv action; not the model's to fill
# error codes after which the session goes on: the action (or reset) was refused; any other
# (capacity reached, the environment could not be made, the session broke) is the server's failure
REFUSALS = frozenset({"VALIDATION_ERROR", "EXECUTION_ERROR"})

SYSTEM_PROMPT = (
    "You act in an environment through its step tool: each call sends one action and shows what "
    "the environment returns. Keep acting until the environment says the episode is done; your "
    "reward is what the environment gives."
)


def base_url(url: str) -> str:
    """The server's HTTP base URL (``http(s)://host[:port][/prefix]``, ``ws(s)://`` accepted);
    InvalidInput for anything else."""
    parts = urlsplit(url.strip())
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if (
        len(url) > MAX_URL_CHARS
        or scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        raise InvalidInput(
            f"--mode openenv:{url[:MAX_URL_CHARS]}: the server's URL is http(s)://host:port, "
            "e.g. --mode openenv:http://127.0.0.1:8000"
        )
    return f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def socket_url(base: str) -> str:
    """The WebSocket endpoint of the server at ``base``."""
    return "ws" + base.removeprefix("http") + "/ws"


# --- the action schema becomes the step tool ----------------------------------------------------


_TOOLS: dict[str, Tool] = {}  # server base URL -> its step tool, read once per process


def step_tool_at(base: str) -> Tool:
    """The ``step`` tool of the server at ``base``, from its ``/schema`` (read once per process;
    a failure is not kept); InfraError when it does not answer or its schema is unusable."""
    tool = _TOOLS.get(base)
    if tool is None:
        if len(_TOOLS) >= 16:
            _TOOLS.clear()
        tool = _TOOLS[base] = step_tool(read_schema(base), base)
    return tool


def read_schema(base: str) -> dict[str, Any]:
    """``GET base/schema``, bounded; InfraError naming what is wrong."""
    try:
        with httpx.stream("GET", f"{base}/schema", timeout=HTTP_TIMEOUT_S) as response:
            if response.status_code != 200:
                raise InfraError(
                    f"openenv: {base} answered GET /schema with HTTP {response.status_code}: "
                    "not an OpenEnv server?"
                )
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_SCHEMA_BYTES:
                    raise InfraError(f"openenv: {base}/schema is over {MAX_SCHEMA_BYTES:,} bytes")
    except httpx.HTTPError as exc:
        raise InfraError(
            f"openenv: {base} does not answer ({type(exc).__name__}: {exc})"[:500]
        ) from None
    try:
        schema = json.loads(body)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise InfraError(f"openenv: {base}/schema is not a JSON object")
    return schema


def step_tool(schema: dict[str, Any], where: str = "the server") -> Tool:
    """The ``step`` tool for an OpenEnv ``/schema`` answer: one parameter per action field."""
    action = schema.get("action")
    properties = action.get("properties", {}) if isinstance(action, dict) else None
    if not isinstance(action, dict) or not isinstance(properties, dict):
        raise InfraError(f"openenv: {where}/schema has no action schema with properties")
    defs = action.get("$defs")
    budget = [MAX_SCHEMA_NODES]
    fields: dict[str, dict[str, Any]] = {
        str(k): _inline(v, defs if isinstance(defs, dict) else {}, budget, where)
        for k, v in properties.items()
        if k not in HIDDEN_FIELDS and isinstance(v, dict)
    }
    if len(fields) > MAX_FIELDS:
        raise InfraError(f"openenv: {where}: the action has {len(fields)} fields; at most 32")
    listed = action.get("required")
    required = {str(x) for x in listed} if isinstance(listed, list) else set()
    described = _text(action.get("description") or action.get("title") or "")
    return Tool(
        "step",
        "one action in the environment" + (f" ({described})" if described else ""),
        parameters={k: _text(v.get("description") or k) for k, v in fields.items()},
        schema={k: {p: x for p, x in v.items() if p != "description"} for k, v in fields.items()},
        optional=frozenset(k for k in fields if k not in required),
    )


def _text(value: Any) -> str:
    return " ".join(str(value).split())[:MAX_DESCRIPTION_CHARS]


def _inline(node: Any, defs: dict[str, Any], budget: list[int], where: str, depth: int = 0) -> Any:
    """``node`` with its ``#/$defs/`` references replaced by their schemas (below MAX_DEPTH:
    deeper, any value), titles dropped."""
    budget[0] -= 1
    if budget[0] < 0:
        raise InfraError(f"openenv: {where}: the action schema is too large to offer as a tool")
    if depth > MAX_DEPTH:
        return {}
    if isinstance(node, list):
        return [_inline(v, defs, budget, where, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    found = defs.get(ref.removeprefix("#/$defs/")) if isinstance(ref, str) else None
    base = _inline(found, defs, budget, where, depth + 1) if isinstance(found, dict) else {}
    return base | {
        k: _inline(v, defs, budget, where, depth + 1)
        for k, v in node.items()
        if not (k == "title" and isinstance(v, str)) and k != "$ref"
    }


# --- one episode over the WebSocket ---------------------------------------------------------------


class Episode:
    """One OpenEnv WebSocket session: one environment on the server, one message at a time."""

    def __init__(self, socket: ClientConnection, url: str) -> None:
        """Wrap an open connection to ``url``."""
        self._socket, self.url, self.closed = socket, url, False

    @classmethod
    async def open(cls, url: str) -> Episode:
        """Connect to ``url`` (``ws(s)://…/ws``); InfraError when it cannot."""
        try:
            socket = await connect(
                url,
                open_timeout=CONNECT_TIMEOUT_S,
                max_size=MAX_MESSAGE_BYTES,
                close_timeout=2,
                compression=None,
            )
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise InfraError(f"openenv: cannot open a session at {url}: {_why(exc)}") from None
        return cls(socket, url)

    async def ask(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one ``reset`` or ``step`` and return the server's reply (``type`` and ``data``)."""
        if self.closed:
            raise InfraError(f"openenv: the session at {self.url} is closed")
        try:
            await self._socket.send(json.dumps({"type": kind, "data": data}))
        except ConnectionClosed:
            pass  # a server that closed at once (full) said why first: read it below
        except (OSError, WebSocketException) as exc:
            raise InfraError(f"openenv: {self.url} during a {kind}: {_why(exc)}") from None
        try:
            raw = await asyncio.wait_for(self._socket.recv(), MESSAGE_TIMEOUT_S)
        except TimeoutError:
            raise InfraError(
                f"openenv: {self.url} did not answer a {kind} within {MESSAGE_TIMEOUT_S:.0f} s"
            ) from None
        except (OSError, WebSocketException) as exc:
            raise InfraError(f"openenv: {self.url} during a {kind}: {_why(exc)}") from None
        try:
            reply = json.loads(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("data"), dict):
            raise InfraError(f"openenv: {self.url} sent an unreadable reply to a {kind}")
        if reply.get("type") == "error" and reply["data"].get("code") not in REFUSALS:
            raise InfraError(f"openenv: {self.url} failed a {kind}: {refusal(reply['data'])}")
        return reply

    async def close(self) -> None:
        """Say goodbye and let the server close (it drops the environment first, and a client
        that closes first makes OpenEnv's server log a traceback); close after CLOSE_WAIT_S."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._socket.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(self._socket.wait_closed(), CLOSE_WAIT_S)
        except (OSError, TimeoutError, WebSocketException):
            pass
        await self._socket.close()


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def refusal(data: dict[str, Any]) -> str:
    """A server's error reply in one line: the fields it names and what is wrong with each,
    else its message."""
    problems = [
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}".lstrip(": ")
        for e in data.get("errors") or ()
        if isinstance(e, dict)
    ]
    return ("; ".join(problems) or str(data.get("message") or "refused"))[:MAX_ERROR_CHARS]


def finite_reward(value: Any, where: str) -> float:
    """An observation's reward as a float (None is 0.0); InfraError when not a finite number."""
    if value is None:
        return 0.0
    if isinstance(value, (bool, int, float)) and math.isfinite(value):
        return float(value)
    raise InfraError(f"openenv: {where} sent the reward {str(value)[:40]!r}: not a finite number")


def shown(fields: Any) -> str:
    """An observation's fields as the model sees them: compact JSON, capped."""
    text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), default=str)
    return text if len(text) <= MAX_OBSERVATION_CHARS else text[:MAX_OBSERVATION_CHARS] + "…[cut]"


class OpenEnvSession:
    """One episode: the ``step`` tool; the environment's own rewards, summed."""

    def __init__(self, tool: Tool, episode: Episode, episode_id: str) -> None:
        """Drive ``episode`` (reset already sent: call :meth:`reset`)."""
        self.tools = [tool]
        self.episode, self.episode_id = episode, episode_id
        self.rewards: list[float] = []
        self.done = False
        self.first: Observation | None = None

    async def reset(self, arguments: dict[str, Any]) -> None:
        """Reset with ``arguments``; the first observation becomes ``first``."""
        reply = await self.episode.ask("reset", arguments)
        if reply.get("type") != "observation":
            raise InvalidInput(
                f"openenv: {self.episode.url} refused the reset {shown(arguments)[:200]}: "
                f"{refusal(reply['data'])}"
            )
        self.first = self._seen(reply["data"])

    async def call(self, name: str, args: dict[str, Any]) -> str | Observation:
        """Send ``args`` as the action; the observation, or ``error: …`` for the model."""
        if name != "step":
            return f"error: unknown tool {name[:64]!r}; the only tool is step"
        if self.done:
            return "error: the episode is over"
        if len(json.dumps(args)) > MAX_ACTION_CHARS:
            return f"error: the action is over {MAX_ACTION_CHARS} characters as JSON"
        reply = await self.episode.ask("step", args)
        if reply.get("type") != "observation":
            return f"error: the environment refused the action: {refusal(reply['data'])}"
        return self._seen(reply["data"])

    def _seen(self, data: dict[str, Any]) -> Observation:
        self.rewards.append(finite_reward(data.get("reward"), self.episode.url))
        self.done = data.get("done") is True
        return Observation(shown(data.get("observation", {})), done=self.done)

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """The sum of the environment's rewards (the answer does not change it); closes the
        connection."""
        await self.aclose()
        total = math.fsum(self.rewards)
        return Score(
            reward=total,
            correct=self.done and total > 0,
            details={
                "episode_id": self.episode_id,
                "done": self.done,
                "observations": len(self.rewards),
                "rewards": self.rewards[:MAX_REWARDS_KEPT],
            },
        )

    async def aclose(self) -> None:
        """Close the connection (the server drops the environment)."""
        await self.episode.close()


# --- the lease that closes a rollout's episodes ---------------------------------------------------


class _Held:
    """The episodes one rollout opened, closed when its lease ends."""

    def __init__(self) -> None:
        self.episodes: list[Episode] = []

    async def close(self) -> None:
        for episode in self.episodes:
            await episode.close()


class OpenEnvSource:
    """``ctx.env`` for openenv rollouts: a lease per rollout that closes the WebSocket sessions
    it opened, whatever ends the rollout (an engine failure, a cancel, a timeout)."""

    def __init__(self, base: str) -> None:
        """Lease sessions on the server at ``base``."""
        self.base = base
        self._serial = itertools.count()

    @asynccontextmanager
    async def lease(
        self, *, attempt_id: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[Instance]:
        """Hold the rollout's episodes; close them at the end."""
        held = _Held()
        try:
            yield Instance(
                instance_id=f"openenv-{next(self._serial)}",
                pool="openenv",
                endpoint=self.base,
                handle=held,
                attempt_id=attempt_id,
            )
        finally:
            await held.close()

    async def close(self) -> None:
        """Nothing is held between leases."""


# --- the mode -------------------------------------------------------------------------------------


class OpenEnvMode:
    """Any OpenEnv environment server, one episode per rollout."""

    name = "openenv"
    uses_tools = True

    def __init__(self, url: str | None = None) -> None:
        """Drive the server at ``url`` (``--mode openenv:URL``); nothing is contacted yet."""
        if url is None:
            raise InvalidInput(
                "--mode openenv needs the server's URL: --mode openenv:http://127.0.0.1:8000"
            )
        self.url = base_url(url)

    def check(self, task: Any, where: str) -> None:
        """A task line is a JSON object (the reset's arguments) of at most 4096 characters."""
        if not isinstance(task, dict):
            raise InvalidInput(
                f'{where}: expected a JSON object (the reset\'s arguments, e.g. {{"seed": 3}}), '
                f"got {type(task).__name__}"
            )
        size = len(json.dumps(task))
        if size > MAX_TASK_CHARS:
            raise InvalidInput(
                f"{where}: the task is {size:,} characters; at most {MAX_TASK_CHARS}"
            )

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Act through ``step`` until the environment is done (the loop adds the tool)."""
        return SYSTEM_PROMPT

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The reset's arguments; the first observation follows it."""
        reset = f" (reset with {shown(task)})" if task else ""
        return f"A new episode has started{reset}. The environment shows:"

    def preflight(self, spec: EnvSpec, local: bool) -> None:
        """The server answers ``/schema`` with an action schema; one line otherwise."""
        try:
            step_tool_at(self.url)
        except InfraError as exc:
            raise InvalidInput(exc.message) from None

    def env_source(self, spec: EnvSpec, concurrency: int) -> OpenEnvSource:
        """Leases that close each rollout's sessions."""
        return OpenEnvSource(self.url)

    async def open(self, task: dict[str, Any], env: Any) -> OpenEnvSession:
        """Connect, reset with the task's arguments, and return the session."""
        tool = _TOOLS.get(self.url)
        if tool is None:  # the first rollout of this process reads the schema
            tool = await asyncio.to_thread(step_tool_at, self.url)
        given = task.get("episode_id")
        attempt = getattr(env, "attempt_id", None)
        episode_id = given if isinstance(given, str) else attempt or uuid.uuid4().hex
        episode = await Episode.open(socket_url(self.url))
        held = handle_of(env)
        if isinstance(held, _Held):
            held.episodes.append(episode)
        session = OpenEnvSession(tool, episode, episode_id)
        try:
            await session.reset({"episode_id": episode_id, **task})
        except BaseException:
            await episode.close()
            raise
        return session
