"""Guess, a Gymnasium text env for tests/test_standards.py (`--env gym:tests.guess_gym:Guess`, or its registered id
`gym:tests.guess_gym:GuessText-v0`): the secret is a number from 1 to `size` drawn from reset's seed; each guess is
answered higher, lower or correct (reward 1, terminated); a reply that is not a number is answered so and counts as a
turn; `max_turns` guesses end the episode truncated."""

from __future__ import annotations

import random
import time

import gymnasium
from gymnasium.spaces import Text


class Guess(gymnasium.Env):
    metadata = {"description": "Guess the secret number. After each guess you hear whether it is higher or lower."}

    def __init__(self, size: int = 8, max_turns: int = 4):
        self.size, self.max_turns = size, max_turns
        self.observation_space, self.action_space = Text(200), Text(50)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.secret, self.turns = int(self.np_random.integers(1, self.size + 1)), 0
        return f"The secret is a number from 1 to {self.size}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turns += 1
        truncated = self.turns >= self.max_turns
        if not action.strip().isdigit():
            return f"{action!r} is not a number.", 0.0, False, truncated, {"valid": False}
        guess = int(action)
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, truncated, {}


def solve(secret: int) -> list[str]:
    """The guesses a binary search makes, for tests that know the secret."""
    low, high, guesses = 1, 8, []
    while True:
        guess = (low + high) // 2
        guesses.append(str(guess))
        if guess == secret:
            return guesses
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)


gymnasium.register("GuessText-v0", entry_point=Guess)


class GlobalGuess(Guess):
    """Guess as GEM's and TextArena's games draw: from Python's global `random`, seeded at reset (or, with
    `seeds=False`, not seeded by the env at all), the secret drawn at the first guess."""

    def __init__(self, size: int = 8, max_turns: int = 4, seeds: bool = True):
        super().__init__(size, max_turns)
        self.seeds = seeds

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        if self.seeds:
            random.seed(seed)
        self.secret, self.turns = None, 0
        return f"The secret is a number from 1 to {self.size}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.secret is None:
            time.sleep(0.001)  # (another episode's thread runs meanwhile, as in a rollout)
            self.secret = random.randint(1, self.size)
        return super().step(action)


class Odd(Guess):
    """Guess answering as a careless env may: `reward` on every step (NaN, inf), info None, or a step that sleeps
    `hang` seconds (a hung env, for the lock the gym adapter keeps around the global generators)."""

    def __init__(self, reward: float = 0.0, hang: float = 0.0):
        super().__init__()
        self.reward, self.hang = reward, hang

    def step(self, action: str) -> tuple[str, float, bool, bool, None]:
        time.sleep(self.hang)
        observation, _, terminated, truncated, _ = super().step(action)
        return observation, self.reward, terminated, truncated, None
