"""An env that raises, hangs or loses its backend (the SciWorld JVM) ends one trajectory, marked with the
error, and is replaced by a fresh instance for the next episode; a hung env holds the rollout up for its
timeout, never longer (envs/guard.py)."""

import sys
import threading
import time

import pytest

import envs
from envs import sciworld
from envs.babyai import BabyAI
from envs.guard import EnvTimeout, Guarded
from rl.engines import RoundEngine, Sample
from rl.model import load_tokenizer
from rollout import ChatFormat, rollout

RELEASE = threading.Event()  # lets the hung calls go at the end of the test session


@pytest.fixture(scope="module", autouse=True)
def release_hung_calls():
    yield
    RELEASE.set()


class Hangs(BabyAI):
    """BabyAI whose steps on task 2 never answer, and whose steps on task 3 raise."""

    name = "hangs"

    def step(self, text):
        if self.task_id == 2:
            RELEASE.wait()
        if self.task_id == 3:
            raise ConnectionError("backend gone")
        return super().step(text)


@pytest.fixture
def hangs(monkeypatch):
    module = type("Module", (), {"make": staticmethod(Hangs), "category": staticmethod(lambda _: "all")})
    monkeypatch.setitem(sys.modules, "hangs_env", module)
    monkeypatch.setitem(envs.ENVS, "hangs", envs.Registration("hangs_env", call_timeout=60.0, upstream_horizon=20))


class Says(RoundEngine):
    """An engine that answers every turn with the same text."""

    name = "says"

    def __init__(self, fmt, text):
        super().__init__()
        self.ids = fmt.encode(text) + [fmt.end_of_turn]

    def generate(self, batch, limits):
        return [Sample(self.ids[:limit], [0.0] * min(limit, len(self.ids))) for limit in limits]


@pytest.mark.timeout(120)
def test_a_hung_or_raising_env_ends_only_its_trajectory_and_is_replaced(hangs):
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    engine = Says(fmt, "Thought: go.\nAction: turn left")
    environments = [Guarded("hangs", {}, timeout=1.0) for _ in range(4)]
    hung, raising = environments[1].env, environments[2].env
    start = time.perf_counter()
    trajectories = rollout(engine, fmt, environments, [1, 2, 3, 4], [0, 1, 2, 3], horizon=3, max_new_tokens=32,
                           max_tokens=4096)
    assert time.perf_counter() - start < 30  # the hang is unbounded; its timeout is 1 s
    assert [t.finish for t in trajectories] == ["horizon", "error", "error", "horizon"]
    assert trajectories[1].error == "step failed: EnvTimeout: no answer in 1 s"
    assert trajectories[2].error == "step failed: ConnectionError: backend gone"
    assert trajectories[0].turns == trajectories[3].turns == 3
    # the next episode of those rows runs on fresh instances, and plays normally
    trajectories = rollout(engine, fmt, environments, [1, 1, 1, 1], [0, 0, 0, 0], horizon=2, max_new_tokens=32,
                           max_tokens=4096)
    assert environments[1].env is not hung and environments[2].env is not raising
    assert [t.finish for t in trajectories] == ["horizon"] * 4
    for env in environments:
        env.close()


def test_the_guard_passes_answers_and_the_envs_own_errors_through(hangs):
    env = Guarded("hangs", {}, timeout=5.0)
    assert env.reset(3).startswith("Your goal:") and env.instruction == BabyAI.instruction
    first = env.env
    with pytest.raises(ConnectionError, match="backend gone"):
        env.step("Action: turn left")
    assert env.env is None  # abandoned: the next call makes a fresh one
    assert env.reset(1).startswith("Your goal:") and env.env is not first
    env.reset(2)
    env.timeout = 0.2
    with pytest.raises(EnvTimeout, match="no answer in 0.2 s"):
        env.step("Action: turn left")
    env.close()


class SlowStart(BabyAI):
    """BabyAI whose instances after the first take 0.5 s to start; counts them, open and closed."""

    name, made, closed = "slow", [], []

    def __init__(self):
        if SlowStart.made:
            time.sleep(0.5)
        super().__init__()
        SlowStart.made.append(self)

    def step(self, text):
        raise ConnectionError("backend gone")

    def close(self):
        SlowStart.closed.append(self)


def test_an_instance_that_starts_after_its_call_timed_out_is_closed_not_used(monkeypatch):
    module = type("Module", (), {"make": staticmethod(SlowStart), "category": staticmethod(lambda _: "all")})
    monkeypatch.setattr(envs, "_module", lambda name: module)
    env = Guarded("slow", {}, timeout=0.2)
    env.reset(1)
    with pytest.raises(ConnectionError):
        env.step("Action: turn left")  # gives the first instance up
    for _ in range(3):  # each reset starts a new instance, slower than the timeout
        with pytest.raises(EnvTimeout):
            env.reset(1)
    time.sleep(1.0)  # the starts finish after their calls were given up on
    assert len(SlowStart.made) == 4 and SlowStart.closed == SlowStart.made and env.env is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_sciworld_jvm_ends_the_episode_and_the_next_one_starts_a_new_jvm():
    env = Guarded("sciworld", {}, timeout=120)
    try:
        env.reset(0)
        jvm = env.env.jvm
        jvm.process.kill()
        with pytest.raises(sciworld.SimulatorError, match="died"):
            env.step("Thought: look.\nAction: look around")
        assert env.env is None
        assert "Your task is to boil water" in env.reset(0)
        assert env.env.jvm is not jvm and env.env.jvm.alive
        assert env.step("Thought: look.\nAction: look around").observation
    finally:
        env.close()
        sciworld.shutdown()
