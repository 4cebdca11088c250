"""A rollfleet mode served as an OpenEnv environment (``rollfleet env serve``): the reverse of
:mod:`rollfleet.envs.openenv`.

A rollfleet mode's tasks as an
OpenEnv environment, built with openenv-core's ``create_app`` (``pip install openenv-core``).
``reset(index=…)`` picks task ``index`` (else ``seed`` modulo the number of tasks, else one at
random) and shows the mode's prompts, its first observation and its tools (OpenAI format); a
step ``{"tool": NAME, "args": {…}}`` runs a session tool call, and ``{"answer": TEXT}`` scores
the answer with the mode's own scorer, puts the reward on that observation and ends the episode
(as does a tool whose observation says done, scored as the loop agent scores it).
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from rollfleet.envs.base import (
    Transcript,
    first_observation,
    observation_of,
    score_of,
)
from rollfleet.envs.openenv import MAX_ACTION_CHARS
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput

INSTALL = "serving a mode as an OpenEnv environment needs openenv-core: pip install openenv-core"


def serve_mode(mode_ref: str, tasks_file: str | Path, *, max_sessions: int = 8) -> Any:
    """The ASGI app (openenv-core's ``create_app``) serving the mode ``mode_ref``'s tasks of
    ``tasks_file`` as an OpenEnv environment, ``max_sessions`` WebSocket sessions at once."""
    from rollfleet.envs import get_mode

    action_cls, observation_cls, env_cls = _served_classes()
    from openenv.core.env_server.http_server import create_app

    mode = get_mode(mode_ref)
    if getattr(mode, "env_source", None) is not None:
        raise InvalidInput(
            f"--mode {mode_ref}: its sessions need a runner's environment (a sandbox, an index, a "
            "site); only modes without one can be served as OpenEnv environments"
        )
    factory = functools.partial(
        env_cls, mode, [line.task for line in load_tasks(Path(tasks_file), mode)]
    )
    return create_app(
        factory,
        action_cls,
        observation_cls,
        env_name=f"rollfleet-{mode.name}",
        max_concurrent_envs=max_sessions,
    )


@functools.cache
def _served_classes() -> tuple[Any, Any, Any]:
    """The action, observation and environment classes of a served mode (openenv-core's types,
    so they are made on first use)."""
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, State
        from openenv.core.env_server.types import Observation as OpenEnvObservation
    except ModuleNotFoundError as exc:
        missing = "" if (exc.name or "").startswith("openenv") else f" (its {exc.name} is missing)"
        raise InvalidInput(INSTALL + missing) from None
    from pydantic_core import PydanticCustomError

    class ModeAction(Action):  # type: ignore[misc]
        """Call one of the mode's tools (``tool`` with ``args``), or give the final ``answer``."""

        tool: str | None = Field(None, max_length=64, description="a tool to call")
        args: dict[str, Any] = Field(default_factory=dict, description="the tool's arguments")
        answer: str | None = Field(None, max_length=MAX_ACTION_CHARS, description="final answer")

        @model_validator(mode="after")
        def _one_of(self) -> ModeAction:
            if (self.tool is None) == (self.answer is None):
                raise PydanticCustomError(
                    "tool_or_answer", "give either tool (with args) or answer"
                )
            if len(json.dumps(self.args, default=str)) > MAX_ACTION_CHARS:
                raise PydanticCustomError("args_size", "args is over 8192 characters as JSON")
            return self

    class ModeObservation(OpenEnvObservation):  # type: ignore[misc]
        """What the mode shows: text; on reset also its system prompt and tools."""

        text: str = Field("", description="the prompt, a tool's observation, or the score")
        system: str | None = Field(None, description="the mode's system prompt (on reset)")
        tools: list[dict[str, Any]] = Field(default_factory=list, description="OpenAI format")
        correct: bool | None = Field(None, description="on the last step: the mode's verdict")

    class ModeEnvironment(Environment):  # type: ignore[misc]
        """One episode of a rollfleet mode: reset opens a session on a task."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self, mode: Any, tasks: list[dict[str, Any]]) -> None:
            super().__init__()
            self.mode, self.tasks = mode, tasks
            self.session: Any = None
            self.transcript = Transcript()
            self.episode_id: str | None = None
            self.steps, self.done = 0, False

        async def reset_async(
            self,
            seed: int | None = None,
            episode_id: str | None = None,
            index: int | None = None,
            **kwargs: Any,
        ) -> ModeObservation:
            chosen = index if index is not None else seed
            n = len(self.tasks)
            position = random.randrange(n) if chosen is None else chosen % n
            task = self.tasks[position]
            self.session = await self.mode.open(task, None)
            self.episode_id, self.steps, self.done = episode_id, 0, False
            first = first_observation(self.session)
            prompt = self.mode.user_prompt(task) + (f"\n\n{first.text}" if first else "")
            system = self.mode.system_prompt(task)
            self.transcript = Transcript(
                [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
            )
            return ModeObservation(
                text=prompt, system=system, tools=[t.openai() for t in self.session.tools]
            )

        async def step_async(
            self, action: ModeAction, timeout_s: float | None = None, **kwargs: Any
        ) -> ModeObservation:
            if self.session is None or self.done:
                raise RuntimeError("the episode is over: reset" if self.done else "reset first")
            self.steps += 1
            if action.answer is not None:
                return await self._finish(action.answer)
            seen = observation_of(await self.session.call(action.tool, action.args))
            self.transcript.calls.append(
                {
                    "turn": self.steps,
                    "tool": action.tool,
                    "args": action.args,
                    "observation": seen.text,
                }
            )
            self.transcript.messages.append(
                {"role": "user", "content": f"Observation from {action.tool}:\n{seen.text}"}
            )
            if seen.done:
                return await self._finish(str(action.tool), seen.text)
            return ModeObservation(text=seen.text)

        async def _finish(self, answer: str, text: str | None = None) -> ModeObservation:
            self.transcript.messages.append({"role": "assistant", "content": answer})
            score = await score_of(self.session, answer, self.transcript)
            self.done = True
            said = text if text is not None else f"reward {score.reward:g}"
            return ModeObservation(text=said, reward=score.reward, done=True, correct=score.correct)

        def reset(self, *args: Any, **kwargs: Any) -> ModeObservation:
            raise RuntimeError("a served rollfleet mode is asynchronous: reset_async")

        def step(self, *args: Any, **kwargs: Any) -> ModeObservation:
            raise RuntimeError("a served rollfleet mode is asynchronous: step_async")

        @property
        def state(self) -> Any:
            return State(episode_id=self.episode_id, step_count=self.steps)

    return ModeAction, ModeObservation, ModeEnvironment
