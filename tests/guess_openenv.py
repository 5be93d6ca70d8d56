"""Guess as an OpenEnv Environment for tests/test_standards.py (`--env openenv:tests.guess_openenv.GuessEnvironment`,
or served by OpenEnv's own create_app: app()): the secret is a number from 1 to 8 drawn from reset's seed, each guess
answered higher, lower or correct (reward 1, done); `max_turns` guesses end the episode."""

from __future__ import annotations

import random

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_turns: int = 4):
        super().__init__()
        self.max_turns, self.secret, self.turns = max_turns, 0, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.secret, self.turns = random.Random(seed).randint(1, 8), 0
        return GuessObservation(message="The secret is a number from 1 to 8.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self.turns += 1
        if action.guess == self.secret:
            return GuessObservation(message="Correct!", reward=1.0, done=True)
        said = "Higher." if action.guess < self.secret else "Lower."
        return GuessObservation(message=said, reward=0.0, done=self.turns >= self.max_turns)

    @property
    def state(self) -> State:
        return State(step_count=self.turns)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="GuessEnvironment", description="Guess the secret number from 1 to 8.")


def app(sessions: int = 16):
    """The environment on OpenEnv's own server (WebSocket sessions at /ws), `sessions` at once."""
    return create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=sessions)
