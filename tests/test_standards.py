"""Envs in a standard shape played as our envs (envs/standards): `--env gym:...`, `openenv:...`, `verifiers:...` on the
small Guess envs of tests/guess_{gym,openenv,verifiers}.py. A task id replays the same episode (groups and resume are
exact), the reward is the return at the end, and train.py, eval.py and the guard take a spec as they take babyai:
alone, in a mix, on an OpenEnv server, resumed; what cannot work (a missing package, a server that does not answer, an
expert asked of an env without one) stops with one sentence."""

import json
import random
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openenv", reason="the standards are optional: pip install -r requirements-standards.txt")
pytest.importorskip("verifiers", reason="the standards are optional: pip install -r requirements-standards.txt")

import envs  # noqa: E402
import verifiers.v1 as vf  # noqa: E402
import eval as eval_script  # noqa: E402
import train  # noqa: E402
from envs.guard import EnvArgs, make_envs  # noqa: E402
from envs.standards.verifiers import END  # noqa: E402
from rl.flags import build  # noqa: E402
from rl.limits import check_entries, env_limits  # noqa: E402
from rl.model import EMBEDDED  # noqa: E402
from test_serve import serving_app  # noqa: E402
from tests.guess_gym import solve  # noqa: E402
from tests.guess_openenv import app  # noqa: E402

GYM = "gym:tests.guess_gym:Guess"
REGISTERED = "gym:tests.guess_gym:GuessText-v0"
OPENENV = "openenv:tests.guess_openenv.GuessEnvironment"
VERIFIERS = "verifiers:guess_verifiers"  # (tests/ is on sys.path: verifiers imports a taskset by a dotless name)


@pytest.fixture(scope="module")
def openenv_url():
    """GuessEnvironment on OpenEnv's own server (create_app), 16 WebSocket sessions at once."""
    with serving_app(app()) as url:
        yield url


def play(env: envs.Env, task_id: int, replies: list[str]) -> list:
    """The first observation and each reply's StepResult, up to the episode's end."""
    said = [env.reset(task_id)]
    for text in replies:
        said.append(env.step(text))
        if said[-1].done:
            break
    return said


# ----------------------------------------------------------------------------------------------
# Names, options and flags


def test_a_spec_is_an_env_name_for_options_timeouts_urls_and_task_files(tmp_path):
    assert envs.known(GYM) and envs.known("openenv:http://127.0.0.1:8000") and envs.known("babyai")
    assert not envs.known("gym:") and not envs.known("mujoco:Ant") and not envs.known("babyai.size")
    options = {f"{GYM}.size": "5", "babyai.x": "1", "openenv:http://127.0.0.1:8000.timeout": "3", "max_turns": "6"}
    assert envs.own_options(options, GYM) == {"size": "5", "max_turns": "6"}  # (split on the last dot)
    assert envs.own_options(options, "openenv:http://127.0.0.1:8000") == {"timeout": "3", "max_turns": "6"}
    flags = EnvArgs(env_options=options, env_timeout=(f"{GYM}=5",), env_url=(f"{OPENENV}=http://127.0.0.1:1",))
    flags.check((GYM, "babyai", "openenv:http://127.0.0.1:8000", OPENENV))
    assert flags.timeout(GYM) == 5 and flags.timeout(OPENENV) == 0 and envs.call_timeout(OPENENV) == 60
    assert (envs.registration(GYM).upstream_horizon, envs.registration(GYM).upstream_max_new_tokens) == (30, 512)
    assert flags.urls(OPENENV) == ("http://127.0.0.1:1",) and flags.urls(GYM) is None
    with pytest.raises(SystemExit, match="--env-timeout names gym:tests.guess_gym:Guess, not an env of this run"):
        flags.check(("babyai",))
    with pytest.raises(SystemExit, match="--env-options names gym:tests.guess_gym:Guess, "
                                         "openenv:http://127.0.0.1:8000, not an env of this run"):
        EnvArgs(env_options=options).check(("babyai",))
    mixed = tmp_path / "tasks.json"
    mixed.write_text(json.dumps([{"item_id": f"{GYM}_3"}, {"item_id": "babyai_5"}, {"item_id": f"{GYM}_1000007"}]))
    assert envs.load_tasks(mixed, ("babyai", GYM)) == {GYM: [3, 1000007], "babyai": [5]}
    splits = envs.splits(GYM)
    assert splits["train"] == list(range(1000)) and splits["test"] == list(range(1_000_000, 1_000_100))
    assert envs.category(GYM, 3) == "Guess" and envs.category("openenv:http://127.0.0.1:8000/", 3) == "127.0.0.1:8000"


def test_env_limits_name_a_spec_by_the_key_after_its_last_dot():
    """--env-limits splits ENV.KEY as --env-options does (envs.scope_of): a spec's own dots stay its name."""
    run = SimpleNamespace(env=("babyai", GYM), env_limits={f"{GYM}.horizon": "3", "babyai.max_new_tokens": "64"},
                          horizon=(6,), horizon_every=80, max_new_tokens=128, max_tokens=4096)
    limits = env_limits(run)
    assert limits[GYM].horizon == (3,) and limits[GYM].max_new_tokens == 128
    assert limits["babyai"].horizon == (6,) and limits["babyai"].max_new_tokens == 64
    with pytest.raises(SystemExit, match=r"^--env-limits gym:tests.guess_gym:Guess.size: entries are ENV.KEY VALUE"):
        check_entries({f"{GYM}.size": "3"}, run.env)


def test_what_cannot_be_played_stops_with_one_sentence(monkeypatch):
    with pytest.raises(SystemExit, match=r"^unknown env 'guess'; choose one of: babyai, .* gym:\.\.\. openenv"):
        envs.check_env("guess")
    with pytest.raises(SystemExit, match=r"^--env gym:nowhere\.games:Guess: No module named 'nowhere'$"):
        envs.check_env("gym:nowhere.games:Guess")
    with pytest.raises(SystemExit, match="is neither module:callable nor a Gymnasium id"):
        envs.check_env("gym:NoSuchGame-v0")
    with pytest.raises(SystemExit, match="tests.guess_gym.Guess is not an OpenEnv Environment subclass"):
        envs.check_env("openenv:tests.guess_gym.Guess")
    # a standard whose package is not installed
    monkeypatch.delitem(sys.modules, "envs.standards.openenv", raising=False)
    for name in ("openenv", "openenv.core"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit, match=r"^--env openenv:elsewhere\.Game needs openenv-core, which is not installed "
                                         r"here .*: pip install -r requirements-standards.txt$"):
        envs.check_env("openenv:elsewhere.Game")
    monkeypatch.undo()
    # an OpenEnv server that does not answer, and options a Gymnasium env does not take: the guard's one line
    with pytest.raises(SystemExit, match=r"^cannot make a openenv:http://127.0.0.1:9 env on the env server at "
                                         r"http://127.0.0.1:9: ConnectionError: no OpenEnv server answers"):
        make_envs("openenv:http://127.0.0.1:9", 1, urls="http://127.0.0.1:9", timeout=5)
    with pytest.raises(SystemExit, match=r"^cannot make a gym:tests.guess_gym:Guess env with options \{'colour': 1\}: "
                                         r"TypeError: .*colour"):
        make_envs(GYM, 1, {"colour": 1})
    with pytest.raises(LookupError, match="has no scripted expert"):
        envs.oracle(envs.make(GYM))
    from scripts.make_expert_data import main as make_expert_data
    with pytest.raises(SystemExit, match="has no scripted expert"):
        make_expert_data(["--env", GYM])


# ----------------------------------------------------------------------------------------------
# Each adapter: one task id, one episode


def test_a_spec_names_one_file_or_directory(tmp_path, monkeypatch):
    """An eval result's and a run's default names hold the env: a spec's ':' and '/' (a URL's) would make them
    several directories deep, or names other systems refuse."""
    from rl.run import file_safe

    monkeypatch.chdir(tmp_path)
    spec = "openenv:http://127.0.0.1:8000"
    out = eval_script.output_path(build(eval_script.Args, model="tiny-agent", env=(spec,)), spec, {})
    assert out.parent == Path("runs/eval") and out.name.startswith("openenv-http-127.0.0.1-8000-tiny-agent-")
    assert file_safe(f"{GYM}+babyai-grpo") == "gym-tests.guess_gym-Guess+babyai-grpo"
    assert file_safe("babyai+textcraft-ppo") == "babyai+textcraft-ppo"


@pytest.mark.parametrize("spec", [GYM, REGISTERED])
def test_gymnasium_seeds_are_task_ids_and_the_reward_is_the_return(spec):
    env = envs.make(spec, max_turns=6)
    assert env.instruction.startswith("Guess the secret number.") and "Action:" in env.instruction
    episodes = []
    for _ in range(2):  # the same task twice: the same secret, so the same episode
        play(env, 7, [])
        secret = env.env.unwrapped.secret
        episodes.append(play(env, 7, [f"Thought: halve it\nAction: {guess}" for guess in solve(secret)]))
    assert episodes[0] == episodes[1] and episodes[0][-1].done and episodes[0][-1].reward == 1.0
    assert [r.reward for r in episodes[0][1:-1]] == [0.0] * (len(episodes[0]) - 2)
    assert len({play(env, seed, [])[0] + str(env.env.unwrapped.secret) for seed in range(20)}) > 1  # seeds differ
    play(env, 7, [])
    assert env.step("Action: 1\nAction: 2") == envs.StepResult(envs.REACT_ONLY_ONE, 0.0, False, {"valid": False})
    assert env.step("seven").info["valid"] is False  # (no Action line: the raw reply is the action)
    assert env.step("Action: 1").observation in ("Higher.", "Correct!")


@pytest.mark.parametrize("seeds", [True, False])
def test_envs_that_draw_from_the_global_generators_replay_by_task_id_in_threads(seeds):
    """GEM's and TextArena's games seed Python's global random at reset and draw from it later, and the rollout steps
    its envs in threads: each episode of a task must still play that task, and the trainer's own global stream must
    not move. (seeds=False: an env that draws from random without ever seeding it replays by task id too.)"""
    from concurrent.futures import ThreadPoolExecutor

    def secrets(task_id: int) -> list[str]:
        env = envs.make("gym:tests.guess_gym:GlobalGuess", seeds=seeds)
        said = [r.observation for r in play(env, task_id, [f"Action: {guess}" for guess in range(1, 9)])[1:]]
        env.close()
        return said

    outside = random.getstate()
    with ThreadPoolExecutor(8) as pool:
        games = list(pool.map(secrets, [3] * 8 + [5] * 8))
    assert games[:8] == [games[0]] * 8 and games[8:] == [games[8]] * 8 and games[0] != games[8]
    assert random.getstate() == outside


@pytest.mark.slow  # (a subprocess or a hung call's seconds)
def test_a_careless_gym_env_fails_one_episode_and_a_hung_one_holds_up_no_other(monkeypatch):
    """A NaN or inf reward ends its episode as an env failure (it would void the step's update for every env); info
    None is no info; a call that hangs holding the global generators' lock holds the others up RNG_WAIT_S at most
    (they play on without their own, with a warning); own_rng False takes no lock at all."""
    import threading
    import time

    from envs.standards import gym as gym_adapter

    for bad in (float("nan"), float("inf")):
        env = envs.make("gym:tests.guess_gym:Odd", reward=bad)
        env.reset(1)
        with pytest.raises(ValueError, match=f"answered a reward of {bad}"):
            env.step("Action: 1")
    env = envs.make("gym:tests.guess_gym:Odd")
    assert env.reset(1) and env.step("Action: 1").info["valid"]  # (info None: no info)
    with pytest.raises(TypeError, match="made a str, which has no reset and step"):
        envs.make("gym:os:getcwd")
    monkeypatch.setattr(gym_adapter, "RNG_WAIT_S", 0.2)
    for own_rng, wait in ((True, 0.2), (False, 0.0)):
        hung, other = (envs.make("gym:tests.guess_gym:Odd", hang=h, own_rng=own_rng) for h in (3.0, 0.0))
        hung.reset(1), other.reset(2)
        hanging = threading.Thread(target=hung.step, args=("Action: 1",), daemon=True)
        hanging.start()
        deadline = time.perf_counter() + 10
        while own_rng and not gym_adapter.GLOBAL_RNG.locked() and time.perf_counter() < deadline:
            time.sleep(0.01)  # (until the hung call holds the lock, where it takes one)
        start = time.perf_counter()
        with pytest.warns(UserWarning, match="held the global generators") if own_rng else nullcontext():
            assert other.step("Action: 1").observation in ("Higher.", "Correct!")
        assert wait <= time.perf_counter() - start < wait + 2.5  # (the hung call sleeps 3 s)
        hanging.join()  # (its lock given back: the next test's gym envs keep their own generators)


def test_a_gym_env_forks_by_deepcopy_and_one_that_cannot_says_why():
    """--group-start fork on a Gymnasium env: a copy plays on from the same state, its own generators with it."""
    import threading

    env = envs.make("gym:tests.guess_gym:GlobalGuess")
    play(env, 3, ["Action: 1"])
    twin = env.fork()
    assert [env.step("Action: 2"), env.step("Action: 3")] == [twin.step("Action: 2"), twin.step("Action: 3")]
    assert env.env.secret == twin.env.secret and twin.env is not env.env
    env.env.lock = threading.Lock()  # (what deepcopy refuses)
    with pytest.raises(NotImplementedError, match="cannot copy its state: deepcopy failed"):
        env.fork()


def test_openenv_in_process_and_on_its_server_play_the_same_episodes(openenv_url):
    local, served = envs.make(OPENENV), envs.make(f"openenv:{openenv_url}")
    named = envs.make(OPENENV, url=openenv_url, timeout=10)  # (--env openenv:Class --env-url URL)
    assert local.instruction == served.instruction == named.instruction
    assert local.instruction.startswith("Guess the secret number from 1 to 8.")
    replies = ["Action: 4", "Thought: no number\nAction: four", "Action: 6", "Action: 7", "Action: 8", "Action: 2"]
    for task_id in (0, 5, 12):
        episode = play(local, task_id, replies)
        assert play(local, task_id, replies) == episode == play(served, task_id, replies)
        assert play(named, task_id, replies) == episode
        assert episode[2] == envs.StepResult("Error: that is not a valid action (it sets guess).", 0.0, False,
                                             {"valid": False})
        assert episode[-1].done and episode[-1].reward == float(episode[-1].observation == "Correct!")
    for env in (local, served, named):
        env.close()


def test_openenv_options_name_a_field_the_server_has_and_a_kind_of_reward(openenv_url):
    with pytest.raises(ValueError, match=r"^--env-options observation text: the observation has no such field "
                                         r"\(it has message\)$"):
        envs.make(f"openenv:{openenv_url}", observation="text")
    with pytest.raises(ValueError, match=r"reward sum: say step .* or return"):
        envs.make(f"openenv:{openenv_url}", reward="sum")
    served = envs.make(f"openenv:{openenv_url}", observation="message", task_key="seed", reward="return")
    assert served.reset(5) == "The secret is a number from 1 to 8."
    assert [served.step(f"Action: {guess}").reward for guess in ("four", "1", "8")][:2] == [0.0, 0.0]  # (as summed)
    served.close()


def test_the_guards_timeout_is_the_openenv_clients(openenv_url):
    """--env-timeout SPEC=S bounds an OpenEnv client's own wait for a message too, not only the guard's."""
    (guarded,) = make_envs(f"openenv:{openenv_url}", 1, timeout=7)
    assert guarded.env.client._async._message_timeout == 7
    guarded.close()
    (gym,) = make_envs(GYM, 1, timeout=7)  # (a Gymnasium env has no client: no timeout option for it)
    gym.close()


def test_a_full_openenv_server_is_said_in_one_sentence():
    """A server at its max sessions closes a new session after saying so: the client's reset says it, not
    "ConnectionClosedOK: received 1000 (OK)"."""
    with serving_app(app(1)) as url:
        first, second = envs.make(f"openenv:{url}", timeout=5), envs.make(f"openenv:{url}", timeout=5)
        first.reset(0)
        with pytest.raises(ConnectionError, match=rf"^the OpenEnv server at {url} is full \(its max sessions at once, "
                                                  r"max_concurrent_envs, is 1\): make fewer env instances "):
            second.reset(0)
        first.close(), second.close()


def test_verifiers_rows_are_task_ids_and_the_rubric_scores_the_end():
    game, single = envs.make(VERIFIERS), envs.make(VERIFIERS, env="single_agent")
    assert game.instruction.startswith("Guess the secret number from 1 to 8.")
    assert envs.splits(VERIFIERS) == {"train": list(range(18)), "test": [18, 19]}  # (20 rows: the last tenth tests)
    replies = ["Action: 4", "Thought: higher\nAction: 6", "Action: 7", "Action: 8"]
    episode = play(game, 6, replies)  # row 6: the secret is 7
    assert episode == play(game, 6, replies)
    assert play(game, 0, ["Action: 1"])[-1] == envs.StepResult(END, 1.0, True, {})  # (an earlier row after a later)
    assert [r.observation for r in episode[1:]] == ["Higher.", "Higher.", END]
    assert [r.reward for r in episode[1:]] == [0.0, 0.0, 1.0] and episode[-1].done
    assert [r.observation for r in play(game, 6, ["Action: 1"] * 4)[1:]][-1] == END
    assert play(game, 6, ["Action: 1"] * 4)[-1].reward == 0.0  # (4 turns, never right)
    assert play(single, 3, ["Action: 4"]) == ["Your guess?", envs.StepResult(END, 1.0, True, {})]
    assert play(single, 3, ["4 is my guess"])[-1].reward == 0.0  # (the raw reply, not the secret)
    assert play(game, 2, ["Action: 3"])[1].observation == END  # (a lower row after a higher one: the row read before)
    with pytest.raises(IndexError, match="not a row of the taskset"):
        game.reset(20)
    game.close(), single.close()


def test_a_reward_that_is_not_finite_fails_its_episode_alone(monkeypatch):
    """A NaN reward would skip the whole step's update, every env's of a mix: the env's step raises instead (the
    rollout records an env error for that one trajectory), in one sentence naming the env and the value."""
    from tests.guess_openenv import GuessEnvironment, GuessObservation

    monkeypatch.setattr(GuessEnvironment, "step", lambda self, action, **_: GuessObservation(message="?", reward=float(
        "nan")))
    local = envs.make(OPENENV)
    local.reset(0)
    with pytest.raises(ValueError, match=rf"^{OPENENV} gave the reward nan, which is not a finite number$"):
        local.step("Action: 4")
    monkeypatch.setattr(vf.Trace, "reward", property(lambda self: float("inf")))
    game = envs.make(VERIFIERS)
    game.reset(6)
    with pytest.raises(RuntimeError, match=rf"{VERIFIERS} gave the reward inf, which is not a finite number$"):
        game.step("Action: 7")
    local.close(), game.close()


@pytest.mark.slow  # (a subprocess or a hung call's seconds)
def test_a_verifiers_env_closed_mid_episode_leaves_no_pending_task():
    """close() lets the cancelled episode finish before its loop stops: no "Task was destroyed but it is pending!"
    on stderr at the end of every run."""
    closed = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import envs; "
                             f"env = envs.make('{VERIFIERS}'); env.reset(6); env.close(); "
                             "import time, gc; time.sleep(0.5); del env; gc.collect()"],
                            capture_output=True, text=True, timeout=120)
    assert closed.returncode == 0 and "pending" not in closed.stderr, closed.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# The trainer and eval.py on them


def run(tmp_path, name, *flags):
    argv = ["--engine", "hf", "--tasks-per-step", "3", "--n", "2", "--horizon", "2", "--max-new-tokens", "16",
            "--eval-every", "0", "--out-dir", str(tmp_path), "--run-name", name, *flags]
    run_dir = train.main(train.parse_args(argv))
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rollouts, metrics


@pytest.mark.slow
def test_a_mix_with_babyai_trains_resumes_exactly_and_evaluates(tmp_path):
    mix = ["--env", "babyai", GYM, VERIFIERS, "--save-every", "1"]
    whole_rollouts, whole_metrics = run(tmp_path, "whole", *mix, "--steps", "2")
    assert {r["item_id"].rpartition("_")[0] for r in whole_rollouts} == {"babyai", GYM, VERIFIERS}
    assert all(r["error"] is None for r in whole_rollouts)
    for step in (1, 2):  # each group: n episodes of one task id
        groups = {}
        for r in whole_rollouts:
            if r["step"] == step:
                groups.setdefault(r["group"], set()).add(r["item_id"])
        assert len(groups) == 3 and all(len(ids) == 1 for ids in groups.values())
    assert f"rollout/{GYM}/success" in whole_metrics[0] and f"rollout/{VERIFIERS}/reward" in whole_metrics[0]
    run(tmp_path, "part", *mix, "--steps", "1")
    part_rollouts, part_metrics = run(tmp_path, "part", *mix, "--steps", "2", "--resume", "auto")
    assert part_rollouts == whole_rollouts and part_metrics == whole_metrics

    result = eval_script.main(build(eval_script.Args, model=str(EMBEDDED["tiny-agent"]), env=(GYM, "babyai"),
                                    engine="hf", k=2, limit=4, horizon=(2,), max_new_tokens=16,
                                    out=str(tmp_path / "eval")))
    own = result["envs"][GYM]
    assert own["protocol"] == "agentgym" and own["tasks"] == 4 and own["errors"] == 0
    assert own["categories"].keys() == {"Guess"}
    assert {int(task) for task in own["per_task"]} <= set(range(1_000_000, 1_000_100))  # (its test seeds)
    assert result["envs"]["babyai"]["tasks"] == 4


@pytest.mark.slow
def test_training_on_an_openenv_server_asynchronously_with_a_window(openenv_url, tmp_path):
    served = f"openenv:{openenv_url}"
    rollouts, metrics = run(tmp_path, "served", "--env", served, "--steps", "2", "--max-staleness", "1",
                            "--context", "window:1", "--horizon", "3")
    assert len(rollouts) == 12 and all(r["error"] is None and r["item_id"].startswith(served) for r in rollouts)
    assert [m["charts/step"] for m in metrics] == [1, 2]
    local, _ = run(tmp_path, "local", "--env", OPENENV, "--steps", "1", "--horizon", "3")
    assert all(r["error"] is None for r in local)
