"""BabyAI port: task mapping, upstream's text protocol, the oracle through the text interface."""

import gymnasium
import pytest
from minigrid.utils.baby_ai_bot import BabyAIBot

import envs
from envs.babyai import LEVELS, level_and_seed, oracle

# Levels whose bot plan cannot be expressed in upstream's text actions: the bot fails KeyInBox and
# PutNext*Carrying outright, and in the Synth/Boss levels it sometimes closes an open door to
# reopen it, which the text interface (like upstream's) has no action for.
UNSUPPORTED = {"BabyAI-KeyInBox-v0", "BabyAI-PutNextS7N4Carrying-v0"}


def bot_reward(level: str, seed: int) -> float | None:
    """What BabyAIBot scores playing the raw MiniGrid game, or None if it cannot play it."""
    game = gymnasium.make(level).unwrapped
    game.reset(seed=seed)
    bot = BabyAIBot(game)
    for _ in range(game.max_steps):
        try:
            _, reward, terminated, truncated, _ = game.step(bot.replan())
        except Exception:
            return None
        if terminated or truncated:
            return reward
    return None


def test_task_id_maps_to_level_and_seed():
    assert len(LEVELS) == 40
    assert level_and_seed(0) == ("BabyAI-GoToRedBallGrey-v0", 0)
    assert level_and_seed(41) == ("BabyAI-GoToRedBall-v0", 1)
    assert level_and_seed(39 + 40 * 7) == ("BabyAI-BossLevelNoUnlock-v0", 7)
    env = envs.make("babyai")
    env.reset(40 * 5 + 16)
    assert (env.level, env.seed) == ("BabyAI-Pickup-v0", 5)
    assert envs.category("babyai", 40 * 5 + 16) == "Pickup"
    assert envs.category("babyai", 29) == "AOD"


def test_reset_matches_a_fresh_minigrid_game():
    env = envs.make("babyai")
    for task_id in (3, 43, 123):
        env.reset(task_id)
        level, seed = level_and_seed(task_id)
        ref = gymnasium.make(level).unwrapped
        ref.reset(seed=seed)
        assert tuple(env.game.agent_pos) == tuple(ref.agent_pos)
        assert env.game.mission == ref.mission


def test_level_4_is_the_4x4_room_upstream_served():
    """Upstream's GoToObjS6-v0 had room_size 4 (a registry slip of minigrid < 2.5, which it pins).
    The text is what AgentGym's own BabyAI server answers for task 3 on minigrid 2.3.1."""
    env = envs.make("babyai")
    assert env.reset(3) == (
        "Your goal: go to the blue key\nIn front of you in this room, you can see several objects: There is a "
        "blue key 1 1 steps in front of you and 1 steps to your right.  The room has walls around you. You are "
        "facing a wall 2 steps away. You are not carrying anything.\nAvailable actions: [\"turn left\", "
        "\"turn right\", \"move forward\", \"pickup blue key 1\", \"go to blue key 1\", \"check available actions\"]")
    assert env.game.max_steps == 16


def test_first_observation_is_upstreams_text():
    env = envs.make("babyai")
    obs = env.reset(1)  # GoToRedBall, seed 0
    assert obs.startswith(
        "Your goal: go to the red ball\nIn front of you in this room, you can see several objects: "
        "There is a yellow key 1 1 steps in front of you and 1 steps to your left.  "
        "There is a grey ball 1 1 steps in front of you and 1 steps to your right.  "
    )
    assert "There is a red ball 1 4 steps in front of you and 3 steps to your right.  The room has walls " \
           "around you. You are facing a wall 6 steps away. You are not carrying anything.\n" in obs
    assert obs.endswith('"go to green key 1", "go to red ball 1", "check available actions"]')
    assert '\nAvailable actions: ["turn left", "turn right", "move forward", "pickup yellow key 1", ' in obs


def test_macro_action_reaches_the_goal_with_minigrid_reward():
    env = envs.make("babyai")
    env.reset(1)
    result = env.step("Thought:\nThe red ball is ahead on my right.\n\nAction:\ngo to red ball 1")
    assert result.done and result.info["success"]
    steps = len(result.info["primitives"])
    assert result.reward == pytest.approx(1 - 0.9 * steps / env.game.max_steps)
    assert "\n The task is completed.\nAvailable actions: [" in result.observation
    again = env.step("Action: turn left")
    assert again.done and again.reward == result.reward


def test_pick_up_spelling_from_the_prompt_is_accepted():
    env = envs.make("babyai")
    env.reset(1)
    result = env.step("Thought:\nTake the key.\n\nAction:\npick up yellow key 1")
    assert result.info["valid"]
    assert "You are carrying a yellow key." in result.observation
    assert '"drop"' in result.observation


@pytest.mark.parametrize("text, expected", [
    ("I will just think.", "No change in state."),
    ("Action: fly to the moon", "The action is not recognized. Please check valid actions."),
    ("Action: go to\nAction: turn left", "Error: Only one 'Action' is allowed per response. Please adjust your response."),
    ("Action: drop", "You cannot drop the object, as you are not carrying anything."),
    ("Action:\x00\x01 turn   left!!", None),  # cleaned to "turn left", a valid action
    ("", "No change in state."),
])
def test_malformed_output_is_an_observation(text, expected):
    env = envs.make("babyai")
    env.reset(1)
    result = env.step(text)
    assert not result.done and result.reward == 0.0
    if expected is None:
        assert result.info["valid"] and result.info["primitives"] == [0]
    else:
        assert result.observation.startswith(expected)


def test_check_available_actions_lists_them():
    env = envs.make("babyai")
    env.reset(1)
    result = env.step("Action: check available actions")
    assert result.observation.startswith("You can take the following actions: turn left, turn right, move forward, ")


def test_blocked_move_gives_upstreams_error():
    env = envs.make("babyai")
    env.reset(1)
    for _ in range(6):
        env.step("Action: move forward")  # walk into the wall 6 steps ahead
    result = env.step("Action: move forward")
    assert result.observation.startswith("There is a barrier in front of you, you can't move forward.")


def play(env, act, observation):
    for _ in range(env.game.max_steps):
        result = env.step(act(observation))
        observation = result.observation
        if result.done:
            return result
    return result


# (the fast subset plays each level's seed 0; seeds 1-3, 0.2 s each and 15 s in all, run with the slow tests)
@pytest.mark.parametrize("task_id", [pytest.param(t, marks=[pytest.mark.slow] if t >= len(LEVELS) else [])
                                     for t in range(0, 160) if level_and_seed(t)[0] not in UNSUPPORTED])
def test_oracle_solves_through_text_with_the_bots_reward(task_id):
    level, seed = level_and_seed(task_id)
    expected = bot_reward(level, seed)
    if expected is None or expected <= 0:
        pytest.skip(f"BabyAIBot itself does not solve {level} seed {seed}")
    env = envs.make("babyai")
    observation = env.reset(task_id)
    try:
        step_for_step = play(env, oracle(env, macros=False), observation)
    except RuntimeError as error:  # a plan step with no text action (closing an open door)
        pytest.skip(str(error))
    assert step_for_step.done and step_for_step.reward == pytest.approx(expected)

    # the default expert also takes finishing macros ("go to red ball 1") when the target is in view
    observation = env.reset(task_id)
    result = play(env, envs.oracle(env), observation)
    assert result.done and result.reward > 0


def test_oracle_finishes_a_visible_goal_with_one_macro():
    env = envs.make("babyai")
    observation = env.reset(1)  # "go to the red ball", the ball in view
    text = envs.oracle(env)(observation)
    assert text.endswith("Action:\ngo to red ball 1")
    result = env.step(text)
    assert result.done and result.reward == pytest.approx(1 - 0.9 * len(result.info["primitives"]) / 64)


def test_oracle_stops_where_the_bot_never_finishes_planning():
    env = envs.make("babyai")
    observation = env.reset(28 + 40 * 84)  # UnlockToUnlock seed 84: the raw bot spins forever here
    act = envs.oracle(env)
    with pytest.raises(RuntimeError, match="does not terminate"):
        for _ in range(64):
            observation = env.step(act(observation)).observation


def test_the_tiny_agents_task_sets_hold_out_their_test_tasks():
    """The embedded agent's BabyAI tasks (scripts/babyai_splits.py): short, 13 levels its expert finishes in 6
    turns; tiny, 5 of those (the tiny preset's). Test tasks from seeds no split trains on (the test split's 0-2,
    and 103 on), more than 100 of them."""
    from envs.babyai import level_and_seed

    train_split = set(envs.splits("babyai")["train"])
    for name, count, seeds in (("short", 13, [0, 1, 2, *range(103, 108)]), ("tiny", 5, [0, 1, 2, *range(103, 121)])):
        train = envs.load_task_ids(envs.DATA_DIR / f"babyai_{name}_train.json", "babyai")
        test = envs.load_task_ids(envs.DATA_DIR / f"babyai_{name}_test.json", "babyai")
        levels = {level_and_seed(t)[0] for t in train}
        assert len(levels) == count and {level_and_seed(t)[0] for t in test} == levels
        assert "BabyAI-GoToRedBall-v0" in levels and "BabyAI-BossLevel-v0" not in levels
        assert len(train) == 100 * count and not set(test) & set(train)
        assert (set(train) <= train_split) == (name == "short")  # tiny: seeds 121-220, which no SFT saw
        assert not set(test) & train_split and len(test) > 100
        assert {level_and_seed(t)[1] for t in test} == set(seeds)
    short = {level_and_seed(t)[0] for t in envs.load_task_ids(envs.DATA_DIR / "babyai_short_train.json", "babyai")}
    assert levels <= short
