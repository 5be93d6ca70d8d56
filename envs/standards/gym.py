"""A Gymnasium env with text observations and actions as one of our envs: `--env gym:TARGET`.

TARGET is `module:callable` (a class or function that returns the env; its --env-options are its keyword arguments)
or an id registered with Gymnasium (`gym:GuessNumber-v0`: gymnasium.make(id, **options); `pkg:Id-v0` imports pkg
first, as gymnasium.make does). The env follows Gymnasium 1.x: reset(seed=...) -> (observation, info) and
step(action) -> (observation, reward, terminated, truncated, info), with str observations (anything else is shown as
str(observation)) and str actions. The env need not be a gymnasium.Env: a plain class with those reset and step
(close optional) plays the same (docs/bring-your-own-env.md).

    task id     the seed of reset: the same task id replays the same episode (groups, resume), as long as the env
                draws from the np_random reset seeds (Gymnasium's contract) or from Python's or numpy's global
                generators (as GEM's and TextArena's games do: random.seed at reset, random.randint after); see below
    action      the reply's action (envs/standards.action_of; whole_reply True: the reply), as the str the env's step
                takes
    reward      the return so far (the sum of step rewards); done: terminated or truncated (info says which)
    instruction env.metadata["description"] where the env has one, else the generic one (envs/standards)
    fork        a deep copy (--group-start fork), where deepcopy can copy the env

What the standard does not give (splits, an expert, a horizon, a state key) is the package's default
(envs/standards). A Gymnasium env runs in this process: --env-url does not apply.

The global generators: the rollout steps its envs in threads, so an env that seeds `random` at reset and draws from
it later would draw from whichever episode seeded last (a group's episodes could play different tasks), and it
would move the trainer's own global streams. So each instance has its own copy of `random`'s and numpy's global
state, swapped in around each of its calls under one lock, and seeded from the task id at reset before the env's own
reset runs: an env that draws from the global generators without seeding them replays by task id too. The price: gym
envs' calls run one at a time (free for a game in Python, which the GIL runs one at a time anyway; an env that waits
on I/O or sleeps should be made with `--env-options own_rng False`, which plays it without), and a call that waits
RNG_WAIT_S for a hung env's plays on without its own, with a warning, rather than fail. A reward that is not finite
(NaN, inf) ends its episode as an env failure: one such episode would void its whole step's update.
"""

from __future__ import annotations

import copy
import importlib
import math
import random
import threading
import warnings

import gymnasium
import numpy as np

from envs import REACT_ONLY_ONE, Env, StepResult
from envs import standards


def check(target: str) -> None:
    """Raise (ImportError, AttributeError, ValueError) where `target` names no callable and no registered id."""
    _factory(target)


def make(name: str, target: str, url: str | None = None, instruction: str | None = None, ack: str = standards.ACK,
         whole_reply: bool = False, own_rng: bool = True, **options) -> GymEnv:
    if url is not None:
        raise ValueError(f"{name} runs in this process (a Gymnasium env); --env-url is for OpenEnv servers")
    env = _factory(target)(**options)
    if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
        raise TypeError(f"{target} made a {type(env).__name__}, which has no reset and step: give a callable that "
                        "returns the env")
    return GymEnv(name, env, {"instruction": instruction} if instruction else {}, ack, whole_reply, own_rng)


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


GLOBAL_RNG = threading.Lock()  # around any call that swaps an instance's global-generator state in (module docstring)
RNG_WAIT_S = 10.0  # how long a call waits for another's global generators before it plays on without its own


class GymEnv(Env):
    def __init__(self, name: str, env, options: dict, ack: str, whole_reply: bool = False, own_rng: bool = True):
        self.name, self.env, self.ack, self.whole_reply, self.own_rng = name, env, ack, whole_reply, own_rng
        self.instruction = standards.instruction((getattr(env, "metadata", None) or {}).get("description"), options)
        self.score = 0.0
        self.rng: tuple | None = None  # its own state of random's and numpy's global generators, between calls

    def reset(self, task_id: int) -> str:
        observation, _ = self._own_rng(self.env.reset, seed=int(task_id))
        self.score = 0.0
        return str(observation)

    def step(self, text: str) -> StepResult:
        action = standards.action_of(text, self.whole_reply)
        if action is None:
            return StepResult(REACT_ONLY_ONE, self.score, False, {"valid": False})
        observation, reward, terminated, truncated, info = self._own_rng(self.env.step, action)
        if not math.isfinite(reward := float(reward)):  # (one such episode would void its whole step's update)
            raise ValueError(f"{self.name} answered a reward of {reward}: the episode ends as an env failure")
        self.score += reward
        done = bool(terminated or truncated)
        return StepResult(str(observation), self.score, done, {"valid": bool((info or {}).get("valid", True)),
                                                                "truncated": bool(truncated and not terminated)})

    def fork(self) -> GymEnv:
        """Env.fork: a deep copy, the game with its generators (its np_random, and this instance's state of the
        global ones) in it; an env that deepcopy cannot copy (one holding a lock, a socket, a process) says so."""
        try:
            return copy.deepcopy(self)
        except Exception as error:  # noqa: BLE001 - whatever deepcopy meets, the run is told in one sentence
            raise NotImplementedError(f"a {self.name} env cannot copy its state: deepcopy failed "
                                      f"({type(error).__name__}: {error})") from None

    def close(self) -> None:
        if hasattr(self.env, "close"):  # (a plain class with Gymnasium's reset and step need not have one)
            self.env.close()

    def _own_rng(self, call, *args, seed: int | None = None):
        """call(*args) (reset: with seed=) with this instance's global-generator state swapped in (module docstring);
        a reset seeds it from the task id first. A call that waited RNG_WAIT_S for another's (a hung env's) plays on
        without, as does every call of an env made with own_rng False."""
        run = (lambda: call(*args)) if seed is None else (lambda: call(seed=seed))
        if not self.own_rng:
            return run()
        if not GLOBAL_RNG.acquire(timeout=RNG_WAIT_S):
            warnings.warn(f"a gym env's call has held the global generators over {RNG_WAIT_S:.0f} s (hung?): the others "
                          "play on without their own, so an env that draws from random may not replay exactly")
            return run()
        outside = random.getstate(), np.random.get_state()
        try:
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
            elif self.rng is not None:
                random.setstate(self.rng[0])
                np.random.set_state(self.rng[1])
            return run()
        finally:
            self.rng = random.getstate(), np.random.get_state()
            random.setstate(outside[0])
            np.random.set_state(outside[1])
            GLOBAL_RNG.release()
