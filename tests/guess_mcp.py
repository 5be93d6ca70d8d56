"""Guess as an OpenEnv MCP environment for tests/test_standard_tools.py (`--env openenv:tests.guess_mcp.GuessMCPEnvironment
--agent tools`, or served by OpenEnv's own create_app: app()): its one tool is `guess(number: int)`, built with
OpenEnv's MCPEnvironment on a FastMCP server. The secret is a number from 1 to 8 drawn from reset's seed, each guess
answered higher, lower or correct (reward 1, done); `max_turns` calls end the episode."""

from __future__ import annotations

import random

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import EnvironmentMetadata, Observation, State


class GuessObservation(Observation):
    message: str


class GuessMCPEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_turns: int = 4):
        mcp = FastMCP("guess")

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the secret number."""
            self.turns += 1
            if number == self.secret:
                self.won = True
                return "Correct!"
            return "Higher." if number < self.secret else "Lower."

        super().__init__(mcp)
        self.max_turns, self.secret, self.turns, self.won = max_turns, 0, 0, False

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self.secret, self.turns, self.won = random.Random(seed).randint(1, 8), 0, False
        return GuessObservation(message="The secret is a number from 1 to 8.")

    def step(self, action, timeout_s: float | None = None, **kwargs) -> Observation:
        # (MCPEnvironment answers a tool call with its result alone: the reward and the end are the game's)
        won = self.won
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs), won)

    async def step_async(self, action, timeout_s: float | None = None, **kwargs) -> Observation:
        won = self.won  # (a server's WebSocket session steps here)
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs), won)

    def _scored(self, action, observation: Observation, won: bool) -> Observation:
        if isinstance(action, CallToolAction):  # reward 1 on the winning call
            observation.reward, observation.done = float(self.won and not won), self.won or self.turns >= self.max_turns
        return observation

    def _step_impl(self, action, timeout_s: float | None = None, **kwargs) -> Observation:
        return GuessObservation(message=f"{type(action).__name__} is no action here: call the guess tool.")

    @property
    def state(self) -> State:
        return State(step_count=self.turns)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="GuessMCPEnvironment", description="Guess the secret number from 1 to 8.")


def app(sessions: int = 16):
    """The environment on OpenEnv's own server (WebSocket sessions at /ws), `sessions` at once."""
    return create_app(GuessMCPEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=sessions)
