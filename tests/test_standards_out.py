"""Our five envs played by the standards' own clients (issue 63, "Out"): OpenEnv's WebSocket client against
envs/standards/openenv_server.py's app (uvicorn on a loopback port, in a thread), and verifiers' loader and its own
rollout machinery on envs/standards/verifiers_env.py, its model a stub OpenAI-compatible endpoint that answers the
scripted expert's reply. Every episode's observations, rewards and done equal the in-process env's, step by step;
SciWorld's first observation lists a room's objects in the JVM's hash order (compared as a set of lines) and
WebArena's element ids are Chromium's (its observations are not compared, and its expert plays live from what the
client shows, as scripts/bench/env.py does). Also: malformed actions, task ids the env refuses, an env that fails,
two sessions at once, OpenEnv's HTTP path, the horizon, and the id verifiers resolves."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import verifiers.v1 as vf
from fastapi import FastAPI, Request
from openenv.core.generic_client import GenericEnvClient
from verifiers.v1.clients import EvalClientConfig, ModelContext

import envs
from envs.standards import verifiers_env
from envs.standards.openenv_server import AgentGymClient, AgentGymEnvironment, TextAction, build_app, parse_args
from envs.standards.verifiers import END
from rl.agent import make_agent
from test_serve import serving_app

ROOT = Path(__file__).resolve().parent.parent
needs_chromium = pytest.mark.skipif(
    not Path(os.environ.get("WEBARENA_CHROMIUM", "/usr/bin/chromium")).is_file(),
    reason="Chromium is not installed here (CI installs it: apt-get install -y chromium)")
# the tasks each env's expert plays (fewer for the JVM and the browser), and the options it is made with
TASKS = {"babyai": [0, 5, 33], "textcraft": [0, 130, 420], "searchqa": [1000000, 1000001, 1000002],
         "sciworld": [31], "webarena": [6, 9]}
OPTIONS = {"webarena": {"sites": "local"}}  # the local sites: nothing outside this machine
ENVS = ["babyai", "textcraft", "searchqa", pytest.param("sciworld", marks=pytest.mark.slow),
        pytest.param("webarena", marks=[pytest.mark.slow, needs_chromium])]
LIVE_ORACLE = ("webarena",)  # its replies name element ids of the play that shows them


# ----------------------------------------------------------------------------------------------
# The expert's episodes in process, and what a standard's play must equal


class Expert:
    """The scripted expert's in-process episodes of env `name`: per task, the reset's observation and every step's
    (reply, observation, reward, done); and `player(task_id)`, the replies for a play through a standard."""

    def __init__(self, name: str):
        self.name, self.episodes = name, {}
        self.env = envs.make(name, **OPTIONS.get(name, {}))
        for task_id in TASKS[name]:
            observation, steps = self.env.reset(task_id), []
            act = envs.oracle(self.env)
            first = observation
            for _ in range(100):
                text = act(observation)
                result = self.env.step(text)
                steps.append((text, result.observation, result.reward, result.done))
                observation = result.observation
                if result.done:
                    break
            assert steps[-1][3] and steps[-1][2] > 0, (name, task_id, steps[-1])  # done, and solved
            self.episodes[task_id] = (first, steps)

    def player(self, task_id: int):
        """observation -> reply: the recorded replies in order, or (LIVE_ORACLE) the expert on what is shown."""
        if self.name in LIVE_ORACLE:
            self.env.reset(task_id)
            return envs.oracle(self.env)
        replies = iter(text for text, *_ in self.episodes[task_id][1])
        return lambda observation: next(replies)

    def same_first(self, task_id: int, observation: str) -> bool:
        mine = self.episodes[task_id][0]
        if self.name == "sciworld":
            return sorted(mine.splitlines()) == sorted(observation.splitlines())
        return self.name in LIVE_ORACLE or observation == mine

    def outcomes(self, steps) -> list:
        """What must be equal: every (observation, reward, done), or WebArena's (reward, done)."""
        return [tuple(step[-2:]) if self.name in LIVE_ORACLE else tuple(step[-3:]) for step in steps]


@pytest.fixture(scope="module")
def experts():
    made = {}

    def expert(name: str) -> Expert:
        if name not in made:
            made[name] = Expert(name)
        return made[name]

    yield expert
    for one in made.values():
        one.env.close()


@pytest.fixture(scope="module")
def openenv_url():
    """openenv_url(name): the URL of envs/standards/openenv_server.py's app for env `name`, one a module."""
    with contextlib.ExitStack() as stack:
        urls = {}

        def url(name: str) -> str:
            if name not in urls:
                urls[name] = stack.enter_context(serving_app(build_app(name, OPTIONS.get(name))))
            return urls[name]

        yield url


def client(url: str, name: str) -> GenericEnvClient:
    return GenericEnvClient(base_url=url, message_timeout_s=envs.call_timeout(name))


# ----------------------------------------------------------------------------------------------
# OpenEnv: the documented client plays every env's expert episodes as in process


@pytest.mark.parametrize("name", ENVS)
def test_openenv_client_plays_the_expert_episodes_as_in_process(name, experts, openenv_url):
    expert, steps_played = experts(name), 0
    local = expert.env
    with client(openenv_url(name), name).sync() as env:
        for task_id, (_, steps) in expert.episodes.items():
            result = env.reset(task_id=task_id)
            first = result.observation
            assert (first["task_id"], first["instruction"], first["ack"]) == (task_id, local.instruction, local.ack)
            assert expert.same_first(task_id, first["text"]) and (result.reward, result.done) == (None, False)
            act, observation, played, rewards = expert.player(task_id), first["text"], [], 0.0
            for _ in steps if name not in LIVE_ORACLE else range(100):
                result = env.step({"text": act(observation)})
                observation, rewards = result.observation["text"], rewards + result.reward
                played.append((observation, result.observation["score"], result.done))
                if result.done:
                    break
            assert expert.outcomes(played) == expert.outcomes(steps), (name, task_id)
            assert rewards == pytest.approx(played[-1][1], abs=1e-9)  # (a step's reward: the change in the score)
            steps_played += len(played)
        state = env.state()
        assert (state["env"], state["task_id"], state["step_count"]) == (name, task_id, len(played))
    print(f"openenv {name}: {len(expert.episodes)} episodes, {steps_played} steps as in process")


def test_the_typed_client_plays_an_episode(experts, openenv_url):
    expert = experts("babyai")
    first, steps = expert.episodes[5]
    with AgentGymClient(base_url=openenv_url("babyai")).sync() as env:
        result = env.reset(task_id=5)
        assert result.observation.text == first and result.observation.instruction == expert.env.instruction
        played = []
        for text, *_ in steps:
            result = env.step(TextAction(text=text))
            played.append((result.observation.text, result.observation.score, result.done))
        assert played == expert.outcomes(steps) and result.observation.info["success"] is True


def test_a_bad_action_is_an_observation_and_a_bad_request_one_error(experts, openenv_url):
    local = experts("babyai").env
    with client(openenv_url("babyai"), "babyai").sync() as env:
        assert env.reset(task_id=33).observation["text"] == local.reset(33)
        for junk in ["no action here", "Action: a\nAction: b", "Action: fly to the moon"]:
            mine, theirs = local.step(junk), env.step({"text": junk})
            assert (theirs.observation["text"], theirs.observation["score"], theirs.done) == \
                (mine.observation, mine.reward, mine.done)
            assert theirs.observation["info"]["valid"] is False
        for bad in ({"txt": "turn left"}, {"text": 5}, {"text": "turn left", "extra": 1}):
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                env.step(bad)
        mine, theirs = local.step("Action: turn left"), env.step({"text": "Action: turn left"})  # the session goes on
        assert theirs.observation["text"] == mine.observation


def test_a_task_id_the_env_refuses_is_one_line_and_the_session_goes_on(experts, openenv_url):
    with client(openenv_url("babyai"), "babyai").sync() as env:
        for bad in (-1, "twelve", True):
            with pytest.raises(RuntimeError, match="task_id must be an integer from 0 to 2147483647") as refused:
                env.reset(task_id=bad)
            assert "\n" not in str(refused.value)
        assert env.reset(task_id=0).observation["text"] == experts("babyai").episodes[0][0]
    with client(openenv_url("searchqa"), "searchqa").sync() as env:
        with pytest.raises(RuntimeError, match="searchqa task id 1000000000 is not in the embedded set"):
            env.reset(task_id=10**9)
        assert env.reset(task_id=1000000).observation["text"] == experts("searchqa").episodes[1000000][0]


def test_a_rejected_task_id_over_http_is_a_422_and_leaves_the_episode_as_it_was(openenv_url, monkeypatch):
    reset = httpx.post(openenv_url("babyai") + "/reset", json={"task_id": -1})
    assert reset.status_code == 422 and reset.json() == {"detail": "task_id must be an integer from 0 to 2147483647, "
                                                                   "not -1"}
    session = AgentGymEnvironment("babyai")
    session.reset(task_id=5)
    monkeypatch.setattr(session.env, "reset", lambda task_id: (_ for _ in ()).throw(ValueError("no such task")))
    with pytest.raises(ValueError, match="no such task"):
        session.reset(task_id=7)
    assert session.state.task_id == 5  # (the episode under way is still task 5's)
    session.close()


def test_a_failing_env_is_one_error_and_the_server_goes_on(experts, openenv_url, monkeypatch):
    url = openenv_url("babyai")

    def dead(self, text):
        raise RuntimeError("the simulator died")

    with client(url, "babyai").sync() as env:
        env.reset(task_id=0)
        monkeypatch.setattr(envs.babyai.BabyAI, "step", dead)
        with pytest.raises(RuntimeError, match="Server error: the simulator died"):
            env.step({"text": "Action: turn left"})
        monkeypatch.undo()
    assert httpx.get(url + "/health").json()["status"] == "healthy"
    first, steps = experts("babyai").episodes[0]
    with client(url, "babyai").sync() as env:
        assert env.reset(task_id=0).observation["text"] == first
        assert env.step({"text": steps[0][0]}).done


def test_two_sessions_at_once_each_play_their_own_episode(experts, openenv_url):
    expert = experts("babyai")
    with client(openenv_url("babyai"), "babyai").sync() as one, client(openenv_url("babyai"), "babyai").sync() as two:
        (_, five), (_, thirty_three) = expert.episodes[5], expert.episodes[33]
        one.reset(task_id=5)
        two.reset(task_id=33)
        for i in range(max(len(five), len(thirty_three))):  # interleaved, each as in process
            for env, steps in ((one, five), (two, thirty_three)):
                if i < len(steps):
                    result = env.step({"text": steps[i][0]})
                    assert (result.observation["text"], result.observation["score"], result.done) == steps[i][1:]
        assert one.state()["task_id"] == 5 and two.state()["task_id"] == 33


def test_a_seed_is_the_train_splits_task_and_http_has_no_episode(openenv_url):
    url, train = openenv_url("textcraft"), envs.splits("textcraft")["train"]
    with client(url, "textcraft").sync() as env:
        assert env.reset(seed=3).observation["task_id"] == train[3]
        assert env.reset(seed=len(train) + 3).observation["task_id"] == train[3]
        assert env.reset().observation["task_id"] in train
    reset = httpx.post(url + "/reset", json={"task_id": 130})  # HTTP: a new env per request, reset and closed
    assert reset.status_code == 200 and reset.json()["observation"]["text"] == envs.make("textcraft").reset(130)
    step = httpx.post(url + "/step", json={"action": {"text": "Action: get 1 oak log"}})
    assert step.status_code == 409 and "play an episode over the WebSocket" in step.json()["detail"]
    assert httpx.get(url + "/schema").json()["action"]["required"] == ["text"]


@pytest.mark.slow
def test_the_command_serves_an_env():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert parse_args(["--env", "textcraft", "--env-options", "a", "1"]).env_options == {"a": 1}
    server = subprocess.Popen([sys.executable, "-m", "envs.standards.openenv_server", "--env", "textcraft", "--port",
                               str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read().decode()[-2000:]
            try:
                httpx.get(url + "/health").raise_for_status()
                break
            except httpx.TransportError:
                time.sleep(0.1)
        local = envs.make("textcraft")
        with client(url, "textcraft").sync() as env:
            observation = env.reset(task_id=0).observation["text"]
            assert observation == local.reset(0)
            act = envs.oracle(local)
            for _ in range(10):
                result = env.step({"text": act(observation)})
                observation = result.observation["text"]
                if result.done:
                    break
            assert (result.reward, result.done) == (1.0, True)
    finally:
        server.terminate()
        server.wait(30)


# ----------------------------------------------------------------------------------------------
# verifiers: its loader and rollout machinery play every env's expert episodes as in process


class StubModel:
    """An OpenAI-compatible chat endpoint whose answer is `reply(messages)` (set per episode)."""

    def __init__(self):
        self.reply = None
        self.app = FastAPI()

        @self.app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            text = await asyncio.to_thread(self.reply, body["messages"])
            return {"id": "stub", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@pytest.fixture(scope="module")
def model():
    """(the stub, the ModelContext a verifiers run calls it with)"""
    stub = StubModel()
    with serving_app(stub.app) as url:
        yield stub, ModelContext(model="expert", client=EvalClientConfig(base_url=f"{url}/v1",
                                                                          api_key_var="AGENTGYM_STUB_KEY"))


def play(env: vf.Env, tasks, ctx: ModelContext) -> list[vf.Episode]:
    async def run():
        async with env.serving():
            return [await env.run_episode(task, ctx) for task in tasks]

    return asyncio.run(run())


def as_dicts(messages) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.mark.parametrize("name", ENVS)
def test_verifiers_plays_the_expert_episodes_as_in_process(name, experts, model):
    expert, (stub, ctx), steps_played = experts(name), model, 0
    config = vf.resolve_env_config({"taskset": {"id": "agentgym-rl", "env": name, "task_ids": TASKS[name],
                                                "horizon": 100, "env_options": OPTIONS.get(name, {})}})
    env = vf.load_environment(config)  # verifiers' own loader, from the id
    assert isinstance(env, verifiers_env.AgentGymEnv)
    react = make_agent("react")
    for task in env.taskset:
        task_id = task.data.task_id
        first, steps = expert.episodes[task_id]
        assert task.data.id == f"{name}_{task_id}"
        assert as_dicts(task.data.prompt)[:2] == react.opening(expert.env, first)[:2]
        assert expert.same_first(task_id, task.data.prompt[2].content)
        act = expert.player(task_id)
        stub.reply = lambda messages: act(messages[-1]["content"])
        [episode] = play(env, [task], ctx)
        assert episode.ok, episode.errors
        [trace] = episode.traces
        played = [(step["observation"], step["reward"], step["done"]) for step in trace.info["steps"]]
        assert expert.outcomes(played) == expert.outcomes(steps), (name, task_id)
        assert trace.rewards["reward"].score == steps[-1][2] and trace.num_turns == len(played)
        # the conversation the model saw: our react opening, then each observation but the last as a user turn
        messages = as_dicts(trace.messages)
        assert messages[:3] == react.opening(expert.env, trace.task.data.prompt[2].content)
        users = [m["content"] for m in messages[3:] if m["role"] == "user"]
        assert users == [observation for observation, *_ in played[:-1]]
        steps_played += len(played)
    print(f"verifiers {name}: {len(expert.episodes)} episodes, {steps_played} steps as in process")


def test_load_environment_rows_splits_horizon_and_errors(experts, model):
    stub, ctx = model
    env = verifiers_env.load_environment("babyai", split="test", num_tasks=2)
    assert [task.data.task_id for task in env.taskset] == envs.splits("babyai")["test"][:2]
    assert isinstance(env, verifiers_env.AgentGymEnv) and isinstance(env.taskset, verifiers_env.AgentGymTaskset)
    # the horizon cuts an episode: BabyAI task 5's expert takes 49 steps; its reward is the last step's
    expert = experts("babyai")
    env = verifiers_env.load_environment("babyai", task_ids=[5], horizon=3)
    replies = iter(text for text, *_ in expert.episodes[5][1])
    stub.reply = lambda messages: next(replies)
    [episode] = play(env, list(env.taskset), ctx)
    steps = episode.traces[0].info["steps"]
    assert len(steps) == 3 and not steps[-1]["done"]
    assert [tuple(s.values()) for s in steps] == [step[1:] for step in expert.episodes[5][1][:3]]
    assert episode.traces[0].rewards["reward"].score == steps[-1]["reward"]
    with pytest.raises(ValueError, match="unknown env 'chess'; choose one of: babyai"):
        verifiers_env.load_environment("chess")
    with pytest.raises(ValueError, match="outside AgentGym's ranges"):
        list(verifiers_env.load_environment("searchqa", task_ids=[-1]).taskset)


# ----------------------------------------------------------------------------------------------
# Out, then in: the In adapters (envs/standards/openenv.py, verifiers.py) play our envs served by the Out modules


OURS_ON_OPENENV = {"whole_reply": True, "observation": "text", "task_key": "task_id"}  # (openenv.py)


@pytest.mark.parametrize("name", ["babyai", "textcraft", pytest.param("sciworld", marks=pytest.mark.slow)])
def test_the_openenv_adapter_plays_our_served_env_as_in_process(name, experts, openenv_url):
    """(SciWorld: its progress scores arrive as steps' rewards, which the adapter sums back into the score)"""
    expert = experts(name)
    env = envs.make(f"openenv:{openenv_url(name)}", **OURS_ON_OPENENV)
    for task_id, (first, steps) in expert.episodes.items():
        assert expert.same_first(task_id, env.reset(task_id))
        played = [env.step(text) for text, *_ in steps]
        assert expert.outcomes([(r.observation, r.reward, r.done) for r in played]) == expert.outcomes(steps)
    env.close()


def test_without_the_options_the_openenv_adapter_cannot_play_our_served_env(experts, openenv_url):
    """It sends what follows `Action:`, which our env reads as no action, and shows every field as JSON."""
    bare = envs.make(f"openenv:{openenv_url('babyai')}")
    bare.reset(0)
    assert json.loads(bare.step(experts("babyai").episodes[0][1][0][0]).observation)["info"]["valid"] is False
    bare.close()


@pytest.mark.slow  # (a subprocess or a hung call's seconds)
def test_the_spec_verifiers_agentgym_rl_is_an_env_in_a_fresh_process():
    """train.py and eval.py take `--env verifiers:agentgym-rl` with nothing imported before (this test process has
    imported envs/standards/verifiers_env.py, which registers the id: a fresh one has not)."""
    made = subprocess.run([sys.executable, "-c", "import envs, envs.standards as s; s.check('verifiers:agentgym-rl'); "
                           "env = envs.make('verifiers:agentgym-rl', taskset={'env': 'babyai'}, whole_reply=True); "
                           "print(env.reset(0) == env.reset(0))"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and made.stdout.strip() == "True", made.stderr[-2000:]


@pytest.mark.parametrize("name", ["babyai", "textcraft"])
def test_the_verifiers_adapter_plays_agentgym_rl_as_in_process(name, experts):
    """Our taskset's `env` field goes in the adapter's `taskset` (its own `env` is a verifiers env id); row k is
    task_ids[k]. verifiers says the opening as one prompt and never shows the agent the env's last observation (run()
    ends with the episode), so the first observation is the react opening's three texts and the last is END."""
    expert = experts(name)
    env = envs.make("verifiers:agentgym-rl", taskset={"env": name, "task_ids": TASKS[name], "horizon": 100},
                    whole_reply=True)
    for row, (task_id, (first, steps)) in enumerate(expert.episodes.items()):
        assert env.reset(row) == "\n\n".join([expert.env.instruction, expert.env.ack, first])
        played = [env.step(text) for text, *_ in steps]
        assert [(r.observation, r.reward, r.done) for r in played] == [step[1:] for step in steps[:-1]] + [
            (END, *steps[-1][2:])], (name, task_id)
    env.close()
