"""Env.state_key, GiGPO's step-level anchor groups, for every env: the same state reached by other actions or in
another order has the same key, whatever the turn; along the experts' episodes the key moves with every action that
changes the state and stays for one that does not; served envs (python -m envs.serve) and the guarded and delayed
wrappers give the in-process env's keys."""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import envs
from envs import canonical_key
from envs.babyai import canonical_state
from envs.guard import close_envs, make_envs
from envs.latency import Delayed
from envs.remote import RemoteEnv
from envs.sciworld import FIRST_IDS

ROOT = Path(envs.__file__).resolve().parent.parent
BABYAI_TASKS = [7, 47, 148]  # GoToSeq (the expert comes back to states it left), an "after you" sequence, UnlockToUnlock
TEXTCRAFT_TASKS = [0, 200, 450, 540]  # goals of depth 1, 2, 3 and 4
SEARCHQA_TASKS = envs.splits("searchqa")["test"][:3]


def keys_along(env, task_id: int, no_ops: list[str]) -> list[str]:
    """The keys of the expert's episode, checking that each of `no_ops` (replies that do not change the state), sent
    after every turn, leaves the key as it was."""
    observation = env.reset(task_id)
    agent, keys = envs.oracle(env), [env.state_key()]
    for _ in range(100):
        result = env.step(agent(observation))
        observation = result.observation
        keys.append(env.state_key())
        if result.done:
            break
        for text in no_ops:
            env.step(text)
            assert env.state_key() == keys[-1], text
    assert result.done
    assert all(isinstance(key, str) and len(key) <= envs.KEY_CHARS for key in keys)
    return keys


def played(env, task_id: int, texts: list) -> str:
    """The key after these replies to task_id's first observation (a callable: the reply it makes of the env)."""
    env.reset(task_id)
    for text in texts:
        env.step(text(env) if callable(text) else text)
    return env.state_key()


def test_canonical_key_is_the_form_when_short_else_a_digest():
    assert canonical_key("1 oak planks|2 stick") == "1 oak planks|2 stick"
    long = canonical_key("x" * (envs.KEY_CHARS + 1))
    assert len(long) == 16 and int(long, 16) >= 0 and long != canonical_key("x" * (envs.KEY_CHARS + 2))


def test_an_env_without_state_key_has_none():
    class Plain(envs.Env):
        name = "plain"

    assert Plain().state_key() is None


@pytest.mark.parametrize("name", ["babyai", "textcraft", "searchqa"])
def test_no_key_before_the_first_reset(name):
    assert envs.make(name).state_key() is None


# ----------------------------------------------------------------------------------------------
# BabyAI: the grid, the agent's cell, heading and load, the mission's progress


def test_babyai_turns_in_either_order_meet_again():
    env = envs.make("babyai")
    left, right = "Action: turn left", "Action: turn right"
    start = played(env, 0, [])
    assert played(env, 0, [left]) != start != played(env, 0, [right])
    assert played(env, 0, [left, right]) == played(env, 0, [right, left]) == start
    assert played(env, 0, [left] * 4) == start  # the same state at turn 4 as at turn 0
    assert played(env, 1, []) != start  # another task's first state


def test_babyai_key_moves_with_every_expert_action():
    env = envs.make("babyai")
    no_ops = ["Action: check available actions", "Action: fly to the moon", "Action: turn left\nAction: turn right"]
    for task_id in BABYAI_TASKS:
        keys = keys_along(env, task_id, no_ops)
        assert all(a != b for a, b in zip(keys, keys[1:])), task_id
    assert len(set(keys_along(env, 7, []))) < 14  # task 7's expert revisits states: the same keys again


def test_babyai_key_holds_what_only_the_verifier_knows():
    env = envs.make("babyai")
    env.reset(47)  # "... after you ...": which half is done is in no cell of the grid
    before = canonical_state(env.game)
    env.game.instrs.b_done = "success"
    assert canonical_state(env.game) != before


# ----------------------------------------------------------------------------------------------
# TextCraft: the inventory


def test_textcraft_gets_in_either_order_give_one_inventory():
    env = envs.make("textcraft")
    oak, coal = "Action: get 2 oak logs", "Action: get 1 coal"
    assert played(env, 3, []) == "nothing"
    assert played(env, 3, [oak, coal]) == played(env, 3, [coal, oak]) == "1 coal|2 oak logs"
    assert played(env, 3, ["Action: get 0 oak logs"]) == "nothing"  # a 0 is not in the key
    many = played(env, 3, [f"Action: get {10 ** 30} {item}" for item in ("oak logs", "coal", "diamond")])
    assert len(many) == 16  # past 100 characters: the digest


def test_textcraft_key_moves_with_every_expert_action():
    env = envs.make("textcraft")
    no_ops = ["Action: inventory", "Action: get 1 nothing", "Action: craft 1 stick using 99 oak planks", "Action: dance"]
    for task_id in TEXTCRAFT_TASKS:
        keys = keys_along(env, task_id, no_ops)
        assert all(a != b for a, b in zip(keys, keys[1:])), task_id


# ----------------------------------------------------------------------------------------------
# SearchQA: the set of documents retrieved


def test_searchqa_searches_in_either_order_give_one_set():
    env = envs.make("searchqa")
    task, a, b = SEARCHQA_TASKS[0], "<search>capital of Iraq</search>", "<search>capital of Germany</search>"
    assert played(env, task, []) == "no documents"
    both = played(env, task, [a, b])
    assert both == played(env, task, [b, a]) == played(env, task, [a, b, a])  # a search seen before adds nothing
    assert played(env, task, [a]) not in (both, "no documents")
    assert played(env, task, [a, "<answer>Paris</answer>", "no tags"]) == played(env, task, [a])


def test_searchqa_key_moves_with_every_new_document():
    env = envs.make("searchqa")
    for task_id in SEARCHQA_TASKS:
        observation, agent = env.reset(task_id), envs.oracle(env)
        seen, key = set(), env.state_key()
        while True:
            result = env.step(agent(observation))
            observation = result.observation
            new = set(result.info.get("doc_ids", ())) - seen
            seen |= new
            assert (env.state_key() != key) == bool(new)
            key = env.state_key()
            if result.done:
                break
            env.step("<answer>certainly not this</answer>")
            assert env.state_key() == key


# ----------------------------------------------------------------------------------------------
# SciWorld: the room as "look around" describes it, the inventory, the score


@pytest.fixture(scope="module")
def sciworld():
    env = envs.make("sciworld")
    yield env
    env.close()


def test_sciworld_doors_opened_in_either_order_give_one_room(sciworld):
    kitchen, studio = "Action: open door to kitchen", "Action: open door to art studio"
    start = played(sciworld, 0, [])  # boil: the hallway, six closed doors
    assert played(sciworld, 0, [kitchen]) != start
    assert played(sciworld, 0, [kitchen, studio]) == played(sciworld, 0, [studio, kitchen])
    assert played(sciworld, 0, [kitchen, "Action: close door to kitchen"]) == start


def test_sciworld_key_moves_with_every_expert_action_that_changes_the_room(sciworld):
    no_ops = ["Action: look around", "Action: inventory", "Action: xyzzy"]
    for task_id in (FIRST_IDS[12], FIRST_IDS[18]):  # find-non-living-thing, lifespan-longest-lived: replay exactly
        observation, agent = sciworld.reset(task_id), envs.oracle(sciworld)
        key = sciworld.state_key()
        while True:
            action = envs.sciworld.parse_action(agent(observation))
            result = sciworld.step(f"Action: {action}")
            observation = result.observation
            assert (sciworld.state_key() != key) == (action != "look around"), action
            key = sciworld.state_key()
            if result.done:
                break
            for text in no_ops:
                sciworld.step(text)
                assert sciworld.state_key() == key, text


# ----------------------------------------------------------------------------------------------
# WebArena: the URL, the tree without its ids, the typed values

needs_chromium = pytest.mark.skipif(
    not Path(os.environ.get("WEBARENA_CHROMIUM", "/usr/bin/chromium")).is_file(),
    reason="Chromium is not installed here (CI installs it: apt-get install -y chromium)")


def act(text: str) -> str:
    return f"In summary, the next action I will perform is ```{text}```"


def on(kind: str, line: str, *args: str):
    """The reply doing `kind` on the element of the tree line `line` (its id is the page load's), with args."""
    def reply(env) -> str:
        element = env.tree.split(f"] {line}")[0].rsplit("[", 1)[1]
        return act(f"{kind} [{element}]" + "".join(f" [{arg}]" for arg in args))

    return reply


@pytest.fixture(scope="module")
def webarena():
    env = envs.make("webarena", sites="local")
    yield env
    env.close()


@needs_chromium
def test_webarena_two_routes_to_one_page_meet(webarena):
    def step(reply) -> str:
        webarena.step(reply(webarena) if callable(reply) else reply)
        return webarena.state_key()

    start = played(webarena, 1, [])
    by_link = step(on("click", "link 'Headphones'"))
    assert by_link != start
    assert step(act("scroll [down]")) != by_link and step(act("scroll [up]")) == by_link
    assert step(act("go_back")) == start
    assert step(act(f"goto [{webarena.sites.to_alias(webarena.url)}headphones.html]")) == by_link  # loaded anew
    assert step(act("go_back")) == start
    for text in ("no backticks", act("dance [3]"), act("click [999999]"), act("goto [http://example.com]")):
        assert step(text) == start, text
    typed = step(on("type", "textbox 'Search'", "wireless", "0"))  # the tree does not show the text
    assert typed != start and step(on("type", "textbox 'Search'", "mouse", "0")) != typed


@pytest.mark.slow
@needs_chromium
def test_webarena_key_moves_with_every_expert_action(webarena):
    observation, agent = webarena.reset(4), envs.oracle(webarena)  # a search, a product, a review typed field by field
    keys = [webarena.state_key()]
    while True:
        result = webarena.step(agent(observation))
        observation = result.observation
        keys.append(webarena.state_key())
        if result.done:
            break
        webarena.step(act("dance"))
        assert webarena.state_key() == keys[-1]
    assert all(a != b for a, b in zip(keys[:-1], keys[1:-1])) and keys[-1] == keys[-2]  # `stop` changes nothing


# ----------------------------------------------------------------------------------------------
# Over HTTP and through the wrappers


def free_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture(scope="module")
def servers():
    """A `python -m envs.serve` process for each of BabyAI, TextCraft and SearchQA; yields their URLs by name."""
    names = ["babyai", "textcraft", "searchqa"]
    urls = {name: free_url() for name in names}
    processes = [subprocess.Popen([sys.executable, "-m", "envs.serve", "--env", name, "--port", urls[name].rsplit(":", 1)[1]],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name in names]
    try:
        deadline = time.monotonic() + 60
        for url, process in zip(urls.values(), processes):
            while True:
                assert process.poll() is None, process.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, f"the server at {url} did not answer in 60 s"
                with contextlib.suppress(httpx.TransportError):
                    httpx.get(url, timeout=1).raise_for_status()
                    break
                time.sleep(0.05)
        yield urls
    finally:
        for process in processes:
            process.kill()
            process.wait()


def same_keys(env, local, task_id: int) -> None:
    """env plays the expert's episode of task_id beside the in-process env `local`, key for key."""
    observation = env.reset(task_id)
    assert observation == local.reset(task_id) and env.state_key() == local.state_key() is not None
    agent = envs.oracle(local)
    while True:
        text = agent(observation)
        result = env.step(text)
        assert result.observation == local.step(text).observation and env.state_key() == local.state_key()
        observation = result.observation
        if result.done:
            break


@pytest.mark.parametrize("name, task_ids", [("babyai", BABYAI_TASKS[:2]), ("textcraft", TEXTCRAFT_TASKS[:2]),
                                            ("searchqa", SEARCHQA_TASKS[:1])])
def test_a_served_env_gives_the_in_process_keys(servers, name, task_ids):
    remote = envs.make(name, url=servers[name])
    for task_id in task_ids:
        same_keys(remote, envs.make(name), task_id)
    remote.step("Action: a\nAction: b" if name != "searchqa" else "no tags")  # answered here or there: kept
    assert remote.state_key() is not None
    remote.close()
    assert remote.state_key() is None


def test_a_remote_env_on_upstreams_server_has_no_key(monkeypatch):
    """Upstream's BabyAI server answers without state_key: the client says None, never a stale key."""
    def upstream(request: httpx.Request) -> httpx.Response:
        answers = {"/create": {"id": 0}, "/close": True,
                   "/reset": {"observation": "Your goal: go", "reward": 0.0, "score": 0.0, "deleted": False, "done": False},
                   "/step": {"observation": "moved", "reward": 0.0, "score": 0.0, "done": False}}
        return httpx.Response(200, json=answers[request.url.path])

    client = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **options: client(transport=httpx.MockTransport(upstream), **options))
    remote = RemoteEnv("babyai", "http://upstream:36001")
    remote.reset(0)
    assert remote.state_key() is None
    remote.step("Action: turn left")
    assert remote.state_key() is None


def test_guarded_and_delayed_envs_pass_keys_through(servers):
    for environments in (make_envs("textcraft", 1, delay="0.001", seed=0), make_envs("babyai", 1, urls=servers["babyai"])):
        [env] = environments
        assert isinstance(env.env, Delayed if env.delay else RemoteEnv)
        try:
            same_keys(env, envs.make(env.name), {"textcraft": TEXTCRAFT_TASKS[0], "babyai": BABYAI_TASKS[0]}[env.name])
        finally:
            close_envs(environments)
    [env] = make_envs("textcraft", 1)
    with pytest.raises(RuntimeError):
        env.step("Action: inventory")  # before a reset: the instance is given up on
    assert env.state_key() is None
    env.reset(0)
    assert env.state_key() == "nothing"
    close_envs([env])


def test_a_state_key_that_raises_is_none_in_process_and_over_http(monkeypatch):
    """A key only groups turns for GiGPO: an env whose state_key raises still plays, in the rollout's env threads and
    behind envs/serve.py alike (whose answer then has no key), never a failed reset or step."""
    import importlib

    from rl.trajectory import EnvAnswer
    from test_serve import serving

    countdown = importlib.import_module("tests.countdown_env")

    def broken(self):
        raise KeyError("no key")

    monkeypatch.setattr(countdown.Countdown, "state_key", broken)
    monkeypatch.setitem(envs.ENVS, "countdown", envs.Registration("tests.countdown_env", call_timeout=10.0,
                                                                  upstream_horizon=2, upstream_max_new_tokens=16))
    local = envs.make("countdown")
    first, _, key = EnvAnswer.of(local, "reset", 2)
    assert first == "Task 2: 3 to go." and key is None
    result, _, key = EnvAnswer.of(local, "step", "go")
    assert result.observation == "2 to go." and key is None
    with serving("countdown") as url:
        remote = envs.make("countdown", url=url)
        first, _, key = EnvAnswer.of(remote, "reset", 2)
        assert first == "Task 2: 3 to go." and key is None
        result, _, key = EnvAnswer.of(remote, "step", "go")
        assert result.observation == "2 to go." and key is None
        remote.close()
