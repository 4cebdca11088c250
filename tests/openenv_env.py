"""A small OpenEnv environment, written with openenv-core's own server, for the openenv tests and
bench: guess a number from 1 to 10.

The reset earns START (so even an episode without a guess has a reward to get right), each
wrong guess -0.1, the right one 1.0, which ends the episode, as does guess number MAX_GUESSES.
The target is ``random.Random(seed).randint(1, 10)`` (:func:`target_of`). The server records
every reward it hands out, by episode id, and shows them at ``GET /ledger``, so a test can hold
a rollout's reward against what the server gave.

Run: ``python tests/openenv_env.py --port 8000``.
"""

from __future__ import annotations

import argparse
import random
import threading
import uuid
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_GUESSES = 4
START, WRONG, RIGHT = 0.05, -0.1, 1.0
LEDGER: dict[str, list[float]] = {}  # episode id -> every reward handed out, the reset's first
_LOCK = threading.Lock()  # steps run on the server's executor threads


def target_of(seed: int) -> int:
    """The number an episode reset with ``seed`` hides."""
    return random.Random(seed).randint(1, 10)


class GuessAction(Action):
    """Guess the hidden number."""

    guess: int = Field(..., ge=1, le=10, description="your guess, a whole number from 1 to 10")


class GuessObservation(Observation):
    """A hint after each guess."""

    hint: str = Field("", description="what the environment says")
    episode: str = Field("", description="the episode id")
    guesses: int = Field(0, description="guesses so far")


class GuessEnvironment(Environment):
    """Guess a number from 1 to 10 in at most MAX_GUESSES guesses."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.episode, self.target, self.guesses = "", 0, 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.episode = episode_id or uuid.uuid4().hex
        self.target = target_of(seed) if seed is not None else random.randint(1, 10)
        self.guesses = 0
        self._record(START)
        hint = f"Guess a number from 1 to 10; you have {MAX_GUESSES} guesses."
        return GuessObservation(hint=hint, episode=self.episode, reward=START)

    def step(  # type: ignore[override]
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.guesses += 1
        right = action.guess == self.target
        reward = RIGHT if right else WRONG
        self._record(reward)
        hint = "right" if right else ("higher" if action.guess < self.target else "lower")
        done = right or self.guesses >= MAX_GUESSES
        return GuessObservation(
            hint=hint, episode=self.episode, guesses=self.guesses, reward=reward, done=done
        )

    def _record(self, reward: float) -> None:
        with _LOCK:
            LEDGER.setdefault(self.episode, []).append(reward)

    @property
    def state(self) -> State:
        return State(episode_id=self.episode, step_count=self.guesses)


def make_app(max_sessions: int = 4) -> Any:
    """The server, with ``GET /ledger`` added."""
    app = create_app(
        GuessEnvironment,
        GuessAction,
        GuessObservation,
        env_name="guess",
        max_concurrent_envs=max_sessions,
    )

    @app.get("/ledger")
    def ledger() -> dict[str, list[float]]:
        with _LOCK:
            return {k: list(v) for k, v in LEDGER.items()}

    return app


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=4)
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.max_sessions),
        host="127.0.0.1",
        port=args.port,
        ws="websockets-sansio",
        log_level="warning",
    )
