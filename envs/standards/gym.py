"""A Gymnasium env with text observations and actions as one of our envs: `--env gym:TARGET`.

TARGET is `module:callable` (a class or function that returns the env; its --env-options are its keyword arguments)
or an id registered with Gymnasium (`gym:GuessNumber-v0`: gymnasium.make(id, **options); `pkg:Id-v0` imports pkg
first, as gymnasium.make does). The env follows Gymnasium 1.x: reset(seed=...) -> (observation, info) and
step(action) -> (observation, reward, terminated, truncated, info), with str observations (anything else is shown as
str(observation)) and str actions. The env need not be a gymnasium.Env: a plain class with those reset and step
(close optional) plays the same (docs/bring-your-own-env.md).

    task id     the seed of reset: the same task id replays the same episode (groups, resume), as long as the env
                draws only from the np_random reset seeds (Gymnasium's contract)
    action      the reply's action (envs/standards.action_of), as the str the env's step takes
    reward      the return so far (the sum of step rewards); done: terminated or truncated (info says which)
    instruction env.metadata["description"] where the env has one, else the generic one (envs/standards)

What the standard does not give (splits, an expert, a horizon, a state key) is the package's default
(envs/standards). A Gymnasium env runs in this process: --env-url does not apply.
"""

from __future__ import annotations

import importlib

import gymnasium

from envs import REACT_ONLY_ONE, Env, StepResult
from envs import standards


def check(target: str) -> None:
    """Raise (ImportError, AttributeError, ValueError) where `target` names no callable and no registered id."""
    _factory(target)


def make(name: str, target: str, url: str | None = None, instruction: str | None = None, ack: str = standards.ACK,
         **options) -> GymEnv:
    if url is not None:
        raise ValueError(f"{name} runs in this process (a Gymnasium env); --env-url is for OpenEnv servers")
    env = _factory(target)(**options)
    return GymEnv(name, env, {"instruction": instruction} if instruction else {}, ack)


def _factory(target: str):
    """The callable that makes the env: module:callable, else gymnasium.make on a registered id."""
    module, colon, attribute = target.rpartition(":")
    if colon and attribute.replace(".", "_").isidentifier():
        made = importlib.import_module(module)
        for part in attribute.split("."):
            made = getattr(made, part)
        if not callable(made):
            raise TypeError(f"{target} is not callable: give module:callable, a class or function that returns the env")
        return made
    if colon:
        importlib.import_module(module)  # (where its registration is)
    try:
        gymnasium.spec(attribute)
    except gymnasium.error.Error as error:
        raise ValueError(f"{target} is neither module:callable nor a Gymnasium id ({error})") from None
    return lambda **options: gymnasium.make(attribute, **options)


class GymEnv(Env):
    def __init__(self, name: str, env, options: dict, ack: str):
        self.name, self.env, self.ack = name, env, ack
        self.instruction = standards.instruction((getattr(env, "metadata", None) or {}).get("description"), options)
        self.score = 0.0

    def reset(self, task_id: int) -> str:
        observation, _ = self.env.reset(seed=int(task_id))
        self.score = 0.0
        return str(observation)

    def step(self, text: str) -> StepResult:
        action = standards.action_of(text)
        if action is None:
            return StepResult(REACT_ONLY_ONE, self.score, False, {"valid": False})
        observation, reward, terminated, truncated, info = self.env.step(action)
        self.score += float(reward)
        done = bool(terminated or truncated)
        return StepResult(str(observation), self.score, done, {"valid": bool(info.get("valid", True)),
                                                                "truncated": bool(truncated and not terminated)})

    def close(self) -> None:
        if hasattr(self.env, "close"):  # (a plain class with Gymnasium's reset and step need not have one)
            self.env.close()
