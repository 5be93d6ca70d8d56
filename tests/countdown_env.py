"""Countdown: the smallest env, added by docs/environments.md's recipe in tests/test_add_env.py (this module plus one
registry line). Task t ends in success after t % 3 + 1 replies, whatever they say, so a run's outcomes are
known in advance: under a horizon of 2 the tasks of category "three" end at the horizon, the others solved."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from envs import Env, StepResult

INSTRUCTION = "Count down with me. Reply with anything; the task ends when the count reaches zero."
ACK = "OK. I will reply until the count reaches zero."


class Countdown(Env):
    name = "countdown"
    instruction = INSTRUCTION
    ack = ACK

    def reset(self, task_id: int) -> str:
        self.left = task_id % 3 + 1
        return f"Task {task_id}: {self.left} to go."

    def step(self, text: str) -> StepResult:
        self.left -= 1
        done = self.left == 0
        return StepResult("Zero: done." if done else f"{self.left} to go.", float(done), done, {"valid": bool(text.strip())})


def make() -> Countdown:
    return Countdown()


def category(task_id: int) -> str:
    return ("one", "two", "three")[task_id % 3]


def oracle(env: Countdown) -> Callable[[str], str]:
    return lambda observation: "Action: next"


def default_split_files() -> tuple[Path, Path]:
    data = Path(__file__).parent / "data"
    return data / "countdown_train.json", data / "countdown_test.json"
