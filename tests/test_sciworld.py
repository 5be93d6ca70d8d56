"""SciWorld port: AgentGym's task ids and text protocol, the simulator's scores, gold paths through
the text interface, many envs on one JVM, and surviving a dead or hung JVM. All envs made with
default options share one JVM for the whole session."""

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from scienceworld import ScienceWorldEnv
from scienceworld.constants import ID2TASK

import envs
from envs import sciworld
from envs.sciworld import FIRST_IDS, NUM_TASK_IDS, TASKS, SimulatorError, parse_action, task_and_variation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from sciworld_splits import simulator_splits  # noqa: E402

FIND_NON_LIVING_0 = FIRST_IDS[12]  # find-non-living-thing variation 0
BOIL_0 = 0
TEST_IDS = envs.splits("sciworld")["test"]
# Task families whose episodes replay identically (measured); the others vary between runs of the
# same variation in object order, temperatures or when a circuit lights up, upstream as here.
DETERMINISTIC = {"find-living-thing", "find-non-living-thing", "find-plant", "find-animal", "test-conductivity",
                 "lifespan-longest-lived", "lifespan-shortest-lived", "lifespan-longest-lived-then-shortest-lived"}


def java_pids() -> set[int]:
    """This test process's simulator JVMs (its children: other runs on the machine have their own)."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "scienceworld.jar"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


@pytest.fixture(scope="session", autouse=True)
def no_jvm_left_behind():
    before = java_pids()
    yield
    sciworld.shutdown()
    assert java_pids() <= before


@pytest.fixture(scope="module")
def env():
    env = envs.make("sciworld")
    yield env
    env.close()


def play_gold(env, task_id):
    result = envs.oracle_episode(env, task_id, horizon=200)
    assert result.done, "the gold path did not end the episode"
    return result


# ----------------------------------------------------------------------------------------------
# Task ids, prompt, parsing


def test_task_ids_are_agentgyms_flat_list(env):
    excluded = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}
    assert [name for key, name in ID2TASK.items() if key not in excluded] == [task for task, _ in TASKS]
    env.reset(0)
    assert env.call(lambda sim: [sim.getTaskMaxVariations(task) for task, _ in TASKS]) == [n for _, n in TASKS]
    assert NUM_TASK_IDS == 4639
    # the ranges listed from upstream's server in the reference notes
    assert task_and_variation(29) == ("boil", 29)
    assert task_and_variation(120) == ("use-thermometer", 0)
    assert task_and_variation(2335) == ("test-conductivity", 899)
    assert task_and_variation(3236) == ("find-non-living-thing", 0)
    assert task_and_variation(4629) == ("identify-life-stages-2", 0)
    assert task_and_variation(4638) == ("identify-life-stages-2", 9)
    assert envs.category("sciworld", 4240) == "lifespan-longest-lived"
    with pytest.raises(ValueError, match="0 to 4638"):
        task_and_variation(4639)


def test_instruction_and_ack_are_upstreams():
    env = envs.make("sciworld")
    assert env.instruction.startswith("You are an agent for science world. Every round I will give you an observation")
    assert '{"action": "wait1", "description": "take no action for 1 iteration"}, {"action":"examine OBJ",' in env.instruction
    assert env.instruction.endswith("Your response should use the following format:\nThought:\nyour thoughts.\n\nAction:\nyour next action")
    assert env.ack == "OK. I'll follow your instructions and try my best to solve the task."


@pytest.mark.parametrize("text, action", [
    ("Thought:\nI should open the door.\n\nAction:\nopen door to kitchen", "open door to kitchen"),
    ("Action: go to hallway\nThought: no, wait.\nAction:  look around  ", "look around"),
    ("Thought: two lines\nAction:\nmove lighter\nto red box", "move lighter\nto red box"),
    ("Action: focus on air</s>", "focus on air"),
    ("I will just think.", ""),
    ("", ""),
])
def test_action_is_everything_after_the_last_action_marker(text, action):
    assert parse_action(text) == action


def test_first_observation_is_the_task_description_and_a_look_around(env):
    observation = env.reset(FIND_NON_LIVING_0)
    assert observation.startswith(
        "Your task is to find a(n) non-living thing. First, focus on the thing. Then, move it to the red box "
        "in the kitchen.\nThis room is called the hallway. In it, you see: \n\tthe agent\n\ta substance called air\n"
    )
    assert observation.endswith("\tA door to the workshop (that is closed)")


@pytest.mark.slow
def test_steps_match_the_upstream_servers_wrapper_path(env):
    """Upstream's server resets and steps through ScienceWorldEnv (its own JVM); here the
    simulator is called directly. Same observations, scores and done flags."""
    actions = ["Action: open door to kitchen", "Action: go to kitchen", "blah", "Action: wait1",
               "Action: focus on lighter", "Action: look around", "Action: move lighter to red box"]
    wrapper = ScienceWorldEnv()
    try:
        wrapper.load("find-non-living-thing", 0)
        upstream = [wrapper.get_task_description() + "\n" + wrapper.step("look around")[0]]
        for text in actions:
            observation, _, done, info = wrapper.step(parse_action(text))
            upstream.append((observation, float(info["score"]), done))
    finally:
        wrapper.close()
        wrapper._gateway.java_process.wait(timeout=10)
    ours = [env.reset(FIND_NON_LIVING_0)]
    for text in actions:
        result = env.step(text)
        ours.append((result.observation, result.reward, result.done))
    assert ours == upstream
    assert ours[-1][1:] == (100.0, True)


# ----------------------------------------------------------------------------------------------
# Rewards and episode ends


# (one category in the fast subset, the other 22 with the slow tests: 2-4 s each, the subset's longest tests)
@pytest.mark.parametrize("task_id", [pytest.param(i, marks=() if k == 0 else pytest.mark.slow) for k, i in enumerate(
    sorted({sciworld.category(i): i for i in reversed(TEST_IDS)}.values()))], ids=lambda i: sciworld.category(i))
def test_gold_path_reaches_100_through_text(env, task_id):
    """The first test variation of every task, solved by the oracle's text through env.step."""
    result = play_gold(env, task_id)
    assert result.reward == 100.0 and result.done
    assert result.info["success"] and not result.info["failed"]
    again = env.step("Action: look around")
    assert again.done and again.reward == 100.0 and again.observation == "The task is already finished."


def test_wrong_focus_ends_with_minus_100(env):
    env.reset(BOIL_0)
    result = env.step("Thought:\nAir is a substance.\n\nAction:\nfocus on air")
    assert result.observation == "You focus on the air."
    assert result.reward == -100.0 and result.done and result.info["failed"] and not result.info["success"]


def test_normalized_reward_option():
    env = envs.make("sciworld", reward="normalized")
    env.reset(BOIL_0)
    assert env.step("Action: focus on air").reward == 0.0
    assert play_gold(env, FIND_NON_LIVING_0).reward == 1.0
    env.reset(FIND_NON_LIVING_0)
    assert env.step("Action: open door to kitchen").reward == pytest.approx(0.08)
    env.close()
    assert env.options["reward"] == "normalized" and envs.make("sciworld").options == {
        "reward": "score", "pool_size": 16, "heap": "576m", "timeout": 60.0, "step_limit": 100}
    with pytest.raises(ValueError, match="reward must be one of"):
        envs.make("sciworld", reward="delta")


@pytest.mark.parametrize("text", ["", "I will just think.", "Action: fly to the moon", "Action: \x00\x01",
                                  "Action: " + "x" * 5000, "Action: é ü 中文"])
def test_garbage_text_gives_an_observation(env, text):
    env.reset(FIND_NON_LIVING_0)
    result = env.step(text)
    assert result.observation == "No known action matches that input."
    assert result.reward == 0.0 and not result.done and result.info["valid"] is False  # an invalid action (metrics)
    opened = env.step("Action: open door to kitchen")
    assert opened.observation == "The door is now open." and opened.info["valid"] is True


def test_step_limit_ends_the_episode():
    env = envs.make("sciworld", step_limit="10")  # options may arrive as strings
    env.reset(FIND_NON_LIVING_0)
    first = env.step("Action: wait1")
    assert not first.done and first.info["moves"] <= 2
    result = env.step("Action: wait")  # ten more iterations
    assert result.done and result.info["moves"] > 10 and result.reward == 0.0 and not result.info["success"]
    env.close()


def test_valid_actions_only_when_asked(env):
    env.reset(FIND_NON_LIVING_0)
    valid = env.valid_actions()
    assert "open door to kitchen" in valid and "focus on picture" in valid and len(valid) > 50


# ----------------------------------------------------------------------------------------------
# Many envs, one JVM


@pytest.mark.slow
def test_concurrent_envs_on_one_jvm_stay_independent(env):
    """Envs stepped from threads, as the rollout does, see exactly what each sees alone.
    (Without the per-JVM lock the simulator hands envs each other's rooms.) Only task families
    whose simulation replays identically are used: most others vary between any two runs."""
    task_ids = [FIND_NON_LIVING_0, FIRST_IDS[13] + 7, FIRST_IDS[14] + 5, FIRST_IDS[9] + 7, FIRST_IDS[9] + 100,
                FIRST_IDS[18], FIRST_IDS[19] + 3, FIRST_IDS[20] + 2]
    assert {sciworld.category(t) for t in task_ids} <= DETERMINISTIC
    plans = []
    for task_id in task_ids:
        env.reset(task_id)
        plans.append([f"Action: {a}" for a in env.gold_actions()][:30])

    def play(e, task_id, plan):
        return [e.reset(task_id)] + [(r.observation, r.reward, r.done) for r in map(e.step, plan)]

    alone = [play(env, t, p) for t, p in zip(task_ids, plans)]
    many = [envs.make("sciworld") for _ in task_ids]
    with ThreadPoolExecutor(len(many)) as pool:
        for _ in range(2):
            together = list(pool.map(lambda e, t: [e.reset(t)], many, task_ids))
            for turn in range(30):  # one step of every env per round, like the rollout
                steps = pool.map(lambda e, p: e.step(p[turn]) if turn < len(p) else None, many, plans)
                for record, r in zip(together, steps):
                    if r is not None:
                        record.append((r.observation, r.reward, r.done))
            assert together == alone
    assert len({id(e.jvm) for e in many + [env]}) == 1
    for e in many:
        e.close()


def test_killing_the_jvm_mid_episode_is_survived(env):
    first = envs.make("sciworld")
    second = envs.make("sciworld")
    first.reset(FIND_NON_LIVING_0)
    second.reset(BOIL_0)
    first.step("Action: open door to kitchen")
    dead = first.jvm
    os.kill(dead.process.pid, signal.SIGKILL)
    for e in (first, second):
        with pytest.raises(SimulatorError, match="died|dead"):
            e.step("Action: go to kitchen")
    assert dead.process.poll() is not None
    assert play_gold(first, FIND_NON_LIVING_0).reward == 100.0  # the next reset starts a new JVM
    assert first.jvm is not dead and first.jvm.alive
    assert second.reset(BOIL_0).startswith("Your task is to boil water.")
    assert second.jvm is first.jvm
    assert dead not in first.pool.jvms
    first.close()
    second.close()


@pytest.mark.slow
def test_a_hung_jvm_is_killed_after_the_timeout():
    env = envs.make("sciworld", timeout=5)  # a pool of its own; its first load takes a second or two
    env.reset(FIND_NON_LIVING_0)
    hung = env.jvm
    os.kill(hung.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(SimulatorError, match="no answer within 5 s and was killed"):
            env.step("Action: open door to kitchen")
    finally:
        if hung.process.poll() is None:
            os.kill(hung.process.pid, signal.SIGKILL)
    assert hung.process.poll() is not None
    assert env.reset(FIND_NON_LIVING_0).startswith("Your task is to find a(n) non-living thing.")
    assert env.step("Action: open door to kitchen").observation == "The door is now open."
    env.close()


def test_a_jvm_out_of_heap_says_so():
    env = envs.make("sciworld", heap="16m", pool_size=1)
    with pytest.raises(SimulatorError, match="died .*OutOfMemoryError"):
        env.reset(BOIL_0)
    assert not env.jvm.alive
    with pytest.raises(ValueError, match="such as 512m"):
        envs.make("sciworld", heap="lots")


@pytest.mark.slow
def test_no_jvm_survives_the_process():
    """A child that makes envs, then exits normally or is killed, leaves no JVM behind."""
    code = ("import envs, os, sys; e = envs.make('sciworld'); e.reset(0); print(e.jvm.process.pid, flush=True); "
            "os.kill(os.getpid(), 9) if sys.argv[1] == 'kill' else None")
    for how in ("exit", "kill"):
        out = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[1])
        pid = int(out.stdout.split()[0])
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text():
                break
            subprocess.run(["sleep", "0.1"])
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the JVM {pid} outlived its Python process ({how})")


# ----------------------------------------------------------------------------------------------
# Splits


@pytest.mark.slow
def test_default_splits_are_the_simulators_train_and_test_variations(env):
    split = envs.splits("sciworld")
    env.reset(0)
    assert simulator_splits(env) == (split["train"], split["test"])
    assert (len(split["train"]), len(split["test"])) == (2312, 1171)
    assert not set(split["train"]) & set(split["test"])
    assert {envs.category("sciworld", i) for i in split["test"]} == {task for task, _ in TASKS}


# ----------------------------------------------------------------------------------------------
# The training loop and eval on SciWorld (the embedded model, tiny settings)


@pytest.mark.slow
def test_training_loop_and_eval_run_on_sciworld(tiny_run):
    import eval as eval_script

    run_dir, records, results = tiny_run("sciworld", "--env-options", "reward", "normalized")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["env_options"] == {"reward": "normalized"} and config["env_settings"]["reward"] == "normalized"
    assert len(records) == 2 * 2
    train_ids = set(envs.splits("sciworld")["train"])
    env = envs.make("sciworld", reward="normalized")
    for record in records:
        prefix, _, number = record["item_id"].rpartition("_")
        assert prefix == "sciworld" and int(number) in train_ids
        assert record["error"] is None and 1 <= record["turns"] <= 2 and 0.0 <= record["reward"] <= 1.0
        messages = record["messages"]
        assert [m["content"] for m in messages[:2]] == [env.instruction, env.ack]
        first = env.reset(int(number))
        if envs.category("sciworld", int(number)) in DETERMINISTIC:
            # replaying the model's turns through a fresh env gives the logged observations
            assert messages[2]["content"] == first
            for turn, observation in zip(messages[3::2], messages[4::2]):
                assert observation["content"] == env.step(turn["content"]).observation
    env.close()

    assert results["env"] == "sciworld" and results["tasks"] == 4
    test_ids = eval_script.spread(envs.splits("sciworld")["test"], 4)
    assert set(results["categories"]) == {envs.category("sciworld", i) for i in test_ids}
