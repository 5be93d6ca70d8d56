"""docs/environments.md's "Add an environment" recipe, followed once: a module (tests/countdown_env.py, with its splits in
tests/data/) and one registry line, and train.py, eval.py under its default protocol for a model, and
envs/serve.py with envs/remote.py take the new env with no other edit. Countdown's outcomes do not depend on
what the model says (task t is solved after t % 3 + 1 replies), so every score here is known in advance."""

import json

import httpx
import pytest

import envs
import eval as eval_script
from rl.flags import build
import train
from envs.remote import RemoteEnv
from envs.serve import build_app, parse_args
from rl.model import EMBEDDED
from test_serve import serving

# the recipe's registry line (in envs/__init__.py it would read "countdown": Registration("envs.countdown", ...))
COUNTDOWN = envs.Registration("tests.countdown_env", call_timeout=10.0, upstream_horizon=2, upstream_max_new_tokens=16)


@pytest.fixture(scope="module")
def countdown_url():
    """Countdown registered for this module's tests, and served over HTTP by envs/serve.py."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(envs.ENVS, "countdown", COUNTDOWN)
        with serving("countdown") as url:
            yield url


def outcome(task_id: int, horizon: int) -> dict:
    """What Countdown's rule says an episode of this task ends with under this horizon."""
    needed = task_id % 3 + 1
    solved = needed <= horizon
    return {"category": ("one", "two", "three")[task_id % 3], "turns": min(needed, horizon),
            "finish": "done" if solved else "horizon", "reward": float(solved), "success": solved}


@pytest.mark.slow
def test_training_on_the_new_env_in_process_and_over_http(countdown_url, tmp_path):
    def run(name, *flags):
        argv = ["--env", "countdown", "--engine", "hf", "--steps", "1", "--tasks-per-step", "6", "--n", "2",
                "--horizon", "2", "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", name, *flags]
        run_dir = train.main(train.parse_args(argv))
        rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
        metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return rollouts, metrics

    local_rollouts, local_metrics = run("local")
    assert len(local_rollouts) == 12 and all(r["error"] is None for r in local_rollouts)
    for record in local_rollouts:
        assert record["item_id"] == f"countdown_{record['task_id']}" and 0 <= record["task_id"] < 30  # its train split
        assert {key: record[key] for key in ("category", "turns", "finish", "reward", "success")} == \
               outcome(record["task_id"], horizon=2)
    [metrics] = local_metrics
    assert metrics["finish/horizon"] == sum(r["finish"] == "horizon" for r in local_rollouts) / 12
    remote_rollouts, remote_metrics = run("remote", "--env-url", countdown_url)
    assert remote_rollouts == local_rollouts and remote_metrics == local_metrics


@pytest.mark.slow
def test_eval_scores_the_new_env_under_the_default_protocol(countdown_url, tmp_path):
    """A model that is neither the embedded one (by name) nor a run's checkpoint is scored under upstream's limits
    (--protocol auto: agentgym), which for a new env are those of its registry line."""
    def evaluate(name, **flags):
        return eval_script.main(build(eval_script.Args, model=str(EMBEDDED["tiny-agent"]), env="countdown", engine="hf", k=2,
                                                 out=str(tmp_path / name), **flags))

    local = evaluate("local")
    assert local["protocol"] == "agentgym" and (local["horizon"], local["max_new_tokens"]) == (2, 16)
    assert local["tasks"] == 12 and local["errors"] == 0  # its test split, tasks 30-41
    assert local["avg@k"] == local["pass@k"] == pytest.approx(8 / 12)
    assert {name: c["success"] for name, c in local["categories"].items()} == {"one": 1.0, "two": 1.0, "three": 0.0}
    episodes = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    assert len(episodes) == 24 and all(
        {key: e[key] for key in ("category", "turns", "finish", "reward", "success")} == outcome(e["task_id"], 2)
        for e in episodes)
    remote = evaluate("remote", env_url=countdown_url)
    assert {k: v for k, v in remote.items() if k not in ("seconds", "env_settings", "env_url")} == \
           {k: v for k, v in local.items() if k not in ("seconds", "env_settings", "env_url")}


def test_serving_the_new_env_over_http(countdown_url):
    assert parse_args(["--env", "countdown"]).env == "countdown"  # python -m envs.serve --env countdown
    assert build_app("countdown").state.instances.call_timeout == COUNTDOWN.call_timeout
    local = envs.make("countdown")
    with httpx.Client(base_url=countdown_url) as http:
        assert http.get("/").json() == "This is environment countdown."
        env_id = http.post("/create").json()["id"]
        assert http.post("/step", json={"id": env_id, "action": "Action: next"}).status_code == 409  # no reset yet
        first = http.post("/reset", json={"id": env_id, "data_idx": 5}).json()
        assert first == {"observation": local.reset(5), "state_key": None}  # (an env without state_key)
        for text in ("Action: next", "", "Action: next"):  # task 5: three replies; an empty one is not valid
            answer = http.post("/step", json={"id": env_id, "action": text}).json()
            mine = local.step(text)
            assert answer == {"observation": mine.observation, "reward": mine.reward, "done": mine.done, "info": mine.info,
                              "state_key": None}
            assert http.get("/observation", params={"id": env_id}).json() == mine.observation
        assert answer["done"] and http.get("/detail", params={"id": env_id}).json() == answer
        assert http.post("/close", json={"id": env_id}).json() is True
    remote = envs.make("countdown", url=countdown_url)
    assert isinstance(remote, RemoteEnv) and remote.timeout == COUNTDOWN.call_timeout
    assert (remote.instruction, remote.ack) == (local.instruction, local.ack)
    for task_id in (30, 31, 32):
        assert envs.oracle_episode(remote, task_id) == envs.oracle_episode(local, task_id)
    remote.close()
