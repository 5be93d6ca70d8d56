"""envs/serve.py (AgentGym's HTTP protocol) and envs/remote.py (its client), over loopback only: each
env's endpoints and shapes, a remote env equal to the in-process one step for step, malformed requests
from 50 concurrent clients, the instance cap, idle expiry, call timeouts and an unreachable server."""

import base64
import contextlib
import json
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

import envs
import envs.textcraft
from envs.remote import RemoteEnv, RemoteEnvError
from envs.serve import build_app, main, parse_args


@contextlib.contextmanager
def serving(name: str, **settings):
    """build_app(name, **settings) on an ephemeral loopback port, in a thread; yields its URL."""
    with serving_app(build_app(name, **settings)) as url:
        yield url


@contextlib.contextmanager
def serving_app(app):
    """An app on an ephemeral loopback port, in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def textcraft_url():
    with serving("textcraft") as url:
        yield url


@pytest.fixture(scope="module")
def babyai_url():
    with serving("babyai") as url:
        yield url


def assert_refused(response: httpx.Response, status: int | None = None) -> None:
    """A 4xx (or the given status) whose body is one line of JSON {"error": reason}."""
    assert 400 <= response.status_code < 500 if status is None else response.status_code == status, \
        (response.status_code, response.text)
    reason = response.json()["error"]
    assert reason and "\n" not in reason and "Traceback" not in reason


def same(a: envs.StepResult, b: envs.StepResult) -> bool:
    return (a.observation, a.reward, a.done) == (b.observation, b.reward, b.done)


# ----------------------------------------------------------------------------------------------
# Each env's endpoints and answers


def test_textcraft_endpoints(textcraft_url):
    local = envs.make("textcraft")
    with httpx.Client(base_url=textcraft_url) as http:
        assert http.get("/").json() == "This is environment TextCraft."
        # upstream's client sends minecraft_dir too; a new env is reset to task id = its id
        upstream_body = {"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None}
        created = http.post("/create", json=upstream_body).json()
        env_id = created["id"]
        assert created == {"id": env_id, "observation": local.reset(env_id), "done": False, "reward": 0,
                           "state_key": local.state_key()}
        reset = http.post("/reset", json={"id": env_id, "data_idx": 130}).json()
        assert reset == {"id": env_id, "observation": local.reset(130), "done": False, "reward": 0,
                         "state_key": local.state_key()}
        plan = envs.textcraft.plan(local.tree, local.goal)
        for action in ["inventory", "get 1 nothing", *plan]:  # the server takes the action already parsed
            answer = http.post("/step", json={"id": env_id, "action": action}).json()
            mine = local.act(action)
            # (upstream's answer, `valid`: did the env take the action, and its state key, which our client passes on)
            assert answer == {"observation": mine.observation, "reward": mine.reward, "done": mine.done,
                              "valid": mine.info["valid"], "state_key": local.state_key()}
            assert http.get("/observation", params={"id": env_id}).json() == mine.observation
        assert answer["reward"] == 1.0 and answer["done"] is True
        detail = {key: value for key, value in answer.items() if key not in ("valid", "state_key")}  # (upstream's)
        assert http.get("/detail", params={"id": env_id}).json() == {**detail, "deleted": False}
        assert_refused(http.post("/create", json={"goal": "stick"}), 422)
        assert http.post("/close", json={"id": env_id}).json() is True
        assert http.post("/close", json={"id": env_id}).json() is False  # as upstream: 200 false for an unknown id
        assert_refused(http.post("/step", json={"id": env_id, "action": "inventory"}), 404)



def test_a_textcraft_env_created_past_the_goals_gets_upstreams_goal_not_a_renamed_one():
    """Upstream resets a new env to task id = its id, goals[id % 544]; ids from 544 on are renamed goals here
    (envs/textcraft.py), so /create takes the modulo, and /reset to 544 + g is the renamed goal g."""
    local = envs.make("textcraft")
    app = build_app("textcraft")
    app.state.instances.next_id = 544 * 2 + 7  # (as after that many /create calls)
    with serving_app(app) as url, httpx.Client(base_url=url) as http:
        created = http.post("/create").json()
        assert created["id"] == 544 * 2 + 7 and created["observation"] == local.reset(7)
        renamed = http.post("/reset", json={"id": created["id"], "data_idx": 544 + 3}).json()
        assert renamed["observation"] == local.reset(544 + 3) != local.reset(3)


def test_babyai_endpoints(babyai_url):
    local = envs.make("babyai")
    with httpx.Client(base_url=babyai_url) as http:
        assert http.get("/").json() == "This is environment BabyAI."
        env_id = http.post("/create").json()["id"]
        assert_refused(http.post("/step", json={"id": env_id, "action": "turn left"}), 409)
        assert_refused(http.get("/observation", params={"id": env_id}), 409)
        assert_refused(http.post("/reset", json={"id": env_id}), 422)  # data_idx is required, as upstream
        first = local.reset(120)
        assert http.post("/reset", json={"id": env_id, "data_idx": 120}).json() == {
            "observation": first, "reward": 0.0, "score": 0.0, "deleted": False, "done": False,
            "state_key": local.state_key()}
        assert http.get("/observation", params={"id": env_id}).json()["observation"] == first
        act, observation = envs.oracle(local), first
        while True:
            action = envs.react_action(act(observation))
            answer = http.post("/step", json={"id": env_id, "action": action}).json()
            mine = local.act(action)
            # our reward is upstream's cumulative score; its per-step reward is 0 until the success
            assert answer == {"observation": mine.observation, "reward": mine.reward if mine.done else 0.0,
                              "score": mine.reward, "done": mine.done, "valid": mine.info["valid"],
                              "state_key": local.state_key()}
            assert http.get("/observation", params={"id": env_id}).json() == {
                "observation": f"Your goal: {local.goal}\n{mine.observation}", "reward": answer["reward"],
                "score": mine.reward, "done": mine.done, "deleted": False}
            observation = mine.observation
            if mine.done:
                break
        assert 0 < answer["score"] <= 1
        after = http.post("/step", json={"id": env_id, "action": "turn left"}).json()
        assert after == {"observation": "The task is already finished.", "reward": 0.0, "score": answer["score"],
                         "done": True, "valid": False, "state_key": answer["state_key"]}

        image = http.post("/render", json={"id": env_id}).json()
        assert image.startswith("data:image/png;base64,")
        png = base64.b64decode(image.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
        width, height = struct.unpack(">II", png[16:24])
        assert len(zlib.decompress(png[41:-12])) == height * (1 + 3 * width)  # one filter byte + RGB per row
        assert http.post("/close", json={"id": env_id}).json() is True


def test_searchqa_endpoints():
    local = envs.make("searchqa")
    task = envs.splits("searchqa")["test"][0]
    with serving("searchqa") as url, httpx.Client(base_url=url) as http:
        assert http.get("/").json() == "ok"
        env_idx = http.post("/create", json={"id": 0}).json()
        assert isinstance(env_idx, int)  # a bare int, as upstream
        assert_refused(http.get("/observation", params={"env_idx": env_idx}), 409)
        first = local.reset(task)
        reset = http.post("/reset", json={"env_idx": env_idx, "id": task})
        assert reset.json() == first and reset.headers["state-key"] == local.state_key() == "no documents"
        act = envs.oracle(local)
        for text in ["no tags at all", act(first), act("")]:
            mine = local.step(text)
            answer = http.post("/step", json={"env_idx": env_idx, "action": text}).json()
            assert answer == {"observation": mine.observation, "reward": mine.reward, "done": mine.done, "info": None,
                              "valid": mine.info["valid"], "state_key": local.state_key()}
            assert http.get("/observation", params={"env_idx": env_idx}).json() == first  # always the question
        assert answer["done"] and answer["reward"] == 1.0
        assert_refused(http.post("/reset", json={"env_idx": env_idx, "id": 5}), 422)  # a real-set id, no qa_path
        assert http.post("/close", json={"env_idx": env_idx}).json() is True


def test_sciworld_endpoints():
    local = envs.make("sciworld")
    task = 31
    with serving("sciworld") as url, httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/").json() == "This is environment ScienceWorld."
        env_id = http.post("/create").json()["id"]
        reset = http.post("/reset", json={"id": env_id, "data_idx": task}).json()
        assert set(reset) == {"task_name", "var_num", "task_description", "observation", "reward", "score",
                              "deleted", "done", "state_key"}
        assert (reset["task_name"], reset["var_num"]) == envs.sciworld.task_and_variation(task)
        assert reset["task_description"].startswith("Your task is to melt")
        assert reset["observation"].startswith("This room is called")
        assert http.get("/observation", params={"id": env_id}).json() == reset["observation"]
        hint = http.get("/action_hint", params={"id": env_id}).json()
        assert "look around" in hint["possible_actions"] and hint["possible_objects"]
        assert isinstance(http.get("/goals", params={"id": env_id}).json()["goals"], str)

        local.reset(task)
        gold = local.gold_actions()
        score = 0
        for action in gold:  # the client sends the parsed action
            answer = http.post("/step", json={"id": env_id, "action": action}).json()
            assert set(answer) == {"observation", "reward", "score", "done", "valid", "state_key"}
            assert answer["valid"] is True
            assert answer["reward"] == answer["score"] - score  # per-step reward, cumulative score
            score = answer["score"]
            if answer["done"]:
                break
        assert answer["done"] and answer["score"] == 100
        assert http.get("/detail", params={"id": env_id}).json()["score"] == 100
        assert http.post("/close", json={"id": env_id}).json() is True

        remote = envs.make("sciworld", url=url, reward="normalized")  # the client turns the score into its reward
        assert remote.reset(task).startswith(reset["task_description"] + "\nThis room is called")
        for action in gold:
            result = remote.step(f"Thought:\nnext.\n\nAction:\n{action}</s>")
            if result.done:
                break
        assert (result.reward, result.done, result.info["success"]) == (1.0, True, True)
        remote.close()
    local.close()


needs_chromium = pytest.mark.skipif(
    not Path(os.environ.get("WEBARENA_CHROMIUM", "/usr/bin/chromium")).is_file(),
    reason="Chromium is not installed here (CI installs it: apt-get install -y chromium)")


@pytest.mark.slow
@needs_chromium
def test_webarena_endpoints(monkeypatch):
    local = envs.make("webarena")
    local.reset(6)  # for its task config, which the oracle reads
    act = envs.oracle(local)
    with serving("webarena") as url, httpx.Client(base_url=url, timeout=120) as http:
        env_idx = http.post("/create").json()["env_idx"]
        assert http.get("/list_envs").json() == [env_idx]
        reset = http.post("/reset", json={"env_idx": env_idx, "seed": 0, "idx": 6}).json()
        assert reset["sites"] == ["shopping"] and reset["object"] == local.config["intent"]
        assert reset["observation"].startswith("Tab 0 (current)")  # upstream's: the page's text alone
        prompt = http.get("/observation", params={"env_idx": env_idx}).json()
        assert prompt.startswith("OBSERVATION:\nTab 0") and "PREVIOUS ACTION: None" in prompt
        for _ in range(10):
            answer = http.post("/step", json={"env_idx": env_idx, "action": act(prompt)}).json()
            assert set(answer) == {"observation", "reward", "terminated", "truncated", "info", "state_key"}
            prompt = answer["observation"]
            if answer["terminated"]:
                break
        assert answer["terminated"] and answer["reward"] == 1.0
        assert http.post("/close", json={"env_idx": env_idx}).json() == {"closed": "closed"}

        local.reset(9)
        act, remote = envs.oracle(local), envs.make("webarena", url=url)
        observation = remote.reset(9)
        assert observation.startswith("OBSERVATION:\nTab 0") and observation.endswith("PREVIOUS ACTION: None")
        assert remote.step("no backticks").observation == envs.webarena.NO_ACTION
        for _ in range(10):
            result = remote.step(act(observation))
            observation = result.observation
            if result.done:
                break
        assert (result.reward, result.done) == (1.0, True)

        def broken_reset(env, task_id):
            raise envs.webarena.BrowserError("the browser died")

        monkeypatch.setattr(envs.webarena.WebArena, "reset", broken_reset)
        with pytest.raises(RemoteEnvError, match="could not reset task 9"):
            remote.reset(9)  # upstream's answer {"observation": "TimeoutError", ...}, which its client raises on
        remote.close()
    local.close()


# ----------------------------------------------------------------------------------------------
# The remote env is the in-process env


JUNK = ["Action: a\nAction: b", "no action here", "Action: \x00\x07 left\n", "Thought: x\nAction:  CHECK available!!"]


@pytest.mark.parametrize("name, task_ids", [("babyai", [0, 5, 33, 120, 161]), ("textcraft", [0, 130, 420, 540])])
def test_remote_env_equals_in_process(name, task_ids, request):
    url = request.getfixturevalue(f"{name}_url")
    local, remote = envs.make(name), envs.make(name, url=url)
    assert isinstance(remote, RemoteEnv) and (remote.instruction, remote.ack) == (local.instruction, local.ack)
    for task_id in task_ids:
        observation = local.reset(task_id)
        assert remote.reset(task_id) == observation
        act = envs.oracle(local)
        for turn in range(100):
            for text in ([act(observation)] if turn % 2 else [*JUNK, act(observation)]):
                mine, theirs = local.step(text), remote.step(text)
                assert same(mine, theirs), (text, mine, theirs)
            observation = mine.observation
            if mine.done:
                break
        assert mine.done and mine.reward > 0
    remote.close()


def test_remote_searchqa_equals_in_process():
    with serving("searchqa") as url:
        local, remote = envs.make("searchqa"), envs.make("searchqa", url=url)
        for task_id in envs.splits("searchqa")["test"][:3]:
            observation = local.reset(task_id)
            assert remote.reset(task_id) == observation
            act = envs.oracle(local)
            for text in ["<answer>surely wrong</answer>", "<search>", act(observation), act(""), act("")]:
                mine, theirs = local.step(text), remote.step(text)
                assert same(mine, theirs)
                if mine.done:
                    break
            assert mine.done
        remote.close()


# ----------------------------------------------------------------------------------------------
# Hostile and concurrent clients


def malformed_requests(http: httpx.Client) -> list[httpx.Response]:
    too_big = json.dumps({"id": 0, "action": "x" * (2 << 20)})
    return [
        http.post("/step", content=b"{not json", headers={"content-type": "application/json"}),
        http.post("/step", content=b'{"id": 0, "action": "\xff\xfe"}', headers={"content-type": "application/json"}),
        http.post("/step", json={"id": "abc", "action": "inventory"}),
        http.post("/step", json={"id": 1.5, "action": "inventory"}),
        http.post("/step", json={"id": 10**9, "action": "inventory"}),
        http.post("/step", json={"id": 0}),
        http.post("/step", json={"id": 0, "action": ["inventory"]}),
        http.post("/step", content=b'{"id": 0, "action": "\\ud800"}', headers={"content-type": "application/json"}),
        http.post("/step", json=["inventory"]),
        http.post("/step"),
        http.post("/step", content=b"id=0&action=inventory", headers={"content-type": "text/plain"}),
        http.post("/reset", json={"id": 0, "data_idx": -5}),
        http.post("/reset", json={"id": 0, "data_idx": 2**40}),
        http.post("/step", content=too_big.encode(), headers={"content-type": "application/json"}),
        http.get("/observation", params={"id": "abc"}),
        http.get("/observation"),
        http.delete("/step"),
        http.get("/no/such/endpoint"),
        http.post("/create", json={"commands": "craft 1 x using 1 y"}),
    ]


@pytest.mark.slow
def test_fifty_concurrent_clients_with_malformed_requests():
    """25 clients play oracle episodes through RemoteEnv while 25 send malformed requests: every bad one
    gets a one-line 4xx, no answer is a 5xx, and every good episode equals the in-process one."""
    local = envs.make("textcraft")
    tasks = list(range(0, 500, 20))
    expected = {}
    for task_id in tasks:
        observation = local.reset(task_id)
        act, transcript = envs.oracle(local), [observation]
        while True:
            result = local.step(act(observation))
            transcript.append((result.observation, result.reward, result.done))
            observation = result.observation
            if result.done:
                break
        expected[task_id] = transcript

    with serving("textcraft", max_envs=64) as url:
        def good(task_id):
            remote, replay = envs.make("textcraft", url=url), envs.make("textcraft")
            observation = remote.reset(task_id)
            replay.reset(task_id)
            act, transcript = envs.oracle(replay), [observation]
            while True:
                result = remote.step(act(observation))
                transcript.append((result.observation, result.reward, result.done))
                observation = result.observation
                if result.done or len(transcript) > 60:
                    break
            remote.close()
            return transcript

        def bad(_):
            with httpx.Client(base_url=url) as http:
                return malformed_requests(http)

        start = time.perf_counter()
        with ThreadPoolExecutor(50) as pool:
            goods = [pool.submit(good, task_id) for task_id in tasks]
            bads = [pool.submit(bad, i) for i in range(25)]
            transcripts = [f.result(timeout=120) for f in goods]
            responses = [r for f in bads for r in f.result(timeout=120)]
        elapsed = time.perf_counter() - start

        for task_id, transcript in zip(tasks, transcripts):
            assert transcript == expected[task_id], task_id
        for response in responses:
            assert_refused(response)
        steps = sum(len(t) - 1 for t in transcripts)
        print(f"\n50 clients: {len(responses)} malformed requests (all 4xx) and {len(tasks)} episodes "
              f"({steps} steps) in {elapsed:.2f} s")
        with httpx.Client(base_url=url) as http:  # the server is still well
            assert http.get("/").status_code == 200


@pytest.mark.slow  # (waits out the idle expiry)
def test_instance_cap_and_idle_expiry():
    with serving("textcraft", max_envs=2, idle_timeout=1.0) as url, httpx.Client(base_url=url) as http:
        first, second = (http.post("/create").json()["id"] for _ in range(2))
        assert_refused(http.post("/create"), 503)
        time.sleep(1.6)  # both idle past the timeout: closed
        assert_refused(http.post("/step", json={"id": first, "action": "inventory"}), 404)
        assert http.post("/close", json={"id": second}).json() is False
        remote = envs.make("textcraft", url=url)
        remote.reset(3)
        old_id = remote.env_id
        time.sleep(1.6)
        with pytest.raises(RemoteEnvError, match="answered 404"):  # a step cannot be replayed on a new instance
            remote.step("Action: inventory")
        assert remote.reset(4) == envs.make("textcraft").reset(4)  # a reset starts on a new instance
        assert remote.env_id != old_id
        assert remote.step("Action: inventory").observation == "Inventory: You are not carrying anything."
        remote.close()


def test_call_timeout_and_one_call_per_instance(monkeypatch):
    act, running, overlaps, closed = envs.textcraft.TextCraft.act, {}, [], []

    def slow_act(self, action):
        running[id(self)] = running.get(id(self), 0) + 1
        overlaps.append(running[id(self)])
        time.sleep({"sleep": 1.5, "nap": 0.2}.get(action, 0))
        running[id(self)] -= 1
        return act(self, action)

    monkeypatch.setattr(envs.textcraft.TextCraft, "act", slow_act)
    monkeypatch.setattr(envs.textcraft.TextCraft, "close", lambda self: closed.append(self), raising=False)
    with serving("textcraft", call_timeout=0.8) as url, httpx.Client(base_url=url) as http:
        env_id = http.post("/create").json()["id"]
        with ThreadPoolExecutor(3) as pool:  # concurrent steps on one instance run one at a time
            answers = list(pool.map(lambda _: http.post("/step", json={"id": env_id, "action": "nap"}), range(3)))
        assert [a.status_code for a in answers] == [200] * 3 and max(overlaps) == 1, answers[0].text
        timed_out = http.post("/step", json={"id": env_id, "action": "sleep"})
        assert timed_out.status_code == 504 and "took longer than 0.8 s" in timed_out.json()["error"]
        assert_refused(http.post("/step", json={"id": env_id, "action": "inventory"}), 404)  # dropped
        deadline = time.monotonic() + 5
        while not closed and time.monotonic() < deadline:  # closed once the slow call returned
            time.sleep(0.05)
        assert len(closed) == 1


def test_remote_options():
    with pytest.raises(ValueError, match="pool_size: options of the sciworld env itself"):
        envs.make("sciworld", url="http://127.0.0.1:1", pool_size=4)
    with pytest.raises(ValueError, match="only sciworld takes reward"):
        envs.make("babyai", url="http://127.0.0.1:1", reward="normalized")


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RemoteEnvError, match=f"cannot reach the babyai env server at http://127.0.0.1:{port}"):
        envs.make("babyai", url=f"http://127.0.0.1:{port}", retries=1, backoff=0.01)


def test_command_line():
    args = parse_args(["--env", "sciworld", "--env-options", "pool_size", "4", "heap", "1g"])
    assert (args.host, args.env_options) == ("127.0.0.1", {"pool_size": 4, "heap": "1g"})
    with pytest.raises(SystemExit):
        parse_args(["--env", "sciworld", "--env-options", "pool_size"])
    with pytest.raises(SystemExit, match="cannot make a searchqa env"):  # bad options stop before the port opens
        main(["--env", "searchqa", "--env-options", "retriever", "dense"])
    assert all(envs.call_timeout(n) > 0 for n in envs.ENVS)


@pytest.mark.slow
def test_training_and_eval_over_env_url_equal_in_process(babyai_url, tmp_path):
    """train.py and eval.py on our own servers (--env-url, two of them) play, log and score exactly as in process."""
    import eval as eval_script
    from rl.flags import build
    import train

    def run(name, *flags):
        argv = ["--engine", "hf", "--steps", "2", "--tasks-per-step", "2", "--n", "2", "--horizon", "3",
                "--max-new-tokens", "16", "--lr", "0.01", "--out-dir", str(tmp_path), "--run-name", name, *flags]
        run_dir = train.main(train.parse_args(argv))
        rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
        metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return run_dir, rollouts, metrics

    with serving("babyai") as second_url:
        urls = [babyai_url, second_url]
        remote_dir, remote_rollouts, remote_metrics = run("remote", "--env-url", *urls)
        checkpoint = str(remote_dir / "checkpoints" / "step_2")
        remote_eval = eval_script.main(build(eval_script.Args, model=checkpoint, engine="hf", limit=3, env_url=tuple(urls),
                                                        out=str(tmp_path / "remote")))
    _, local_rollouts, local_metrics = run("local")
    assert all(r["error"] is None for r in remote_rollouts) and sum(r["turns"] for r in remote_rollouts) >= 8
    assert remote_rollouts == local_rollouts and remote_metrics == local_metrics
    assert json.loads((remote_dir / "config.json").read_text())["env_url"] == urls

    scored = [remote_eval, eval_script.main(build(eval_script.Args, model=checkpoint, engine="hf", limit=3,
                                                             out=str(tmp_path / "local")))]
    assert scored[0]["errors"] == 0 and list(scored[0]["env_url"]) == urls
    assert {k: v for k, v in scored[0].items() if k not in ("seconds", "env_settings", "env_url")} == \
           {k: v for k, v in scored[1].items() if k not in ("seconds", "env_settings", "env_url")}
