"""BabyAI as text: AgentGym's BabyAI environment, in process, on the real `minigrid` package.

Task id -> game exactly as AgentGym: level = LEVELS[id % 40], seed = id // 40. The agent sees the
7x7 egocentric view described in words ("There is a red ball 1 2 steps in front of you and 1 steps
to your left.") plus the list of available macro actions; each macro ("go to red ball 1",
"pickup blue key 1", "toggle and go through red locked door 1", ...) is compiled into primitive
MiniGrid actions by breadth-first search over the visible cells, and the primitives run until one
of them leaves the view unchanged. The reward is MiniGrid's success reward 1 - 0.9 * steps /
max_steps, counted in primitive steps.

The state key (Env.state_key, GiGPO's anchor groups) is a digest of canonical_state(): the whole grid in
MiniGrid's encoding (so a moved object or a door opened or unlocked anywhere counts, not only in view), the
agent's cell, heading and load, and the halves of a sequenced mission already done, which only the verifier
remembers. The whole grid rather than the 7x7 view, since two episodes that see the same view may differ behind
the agent. It is computed when the game changes (reset, a macro's primitives); an action the game never sees
(invalid, "check available actions") leaves it.

Default data: the splits in envs/data/babyai_{train,test}.json are ours: test = ids 0-119 (seeds
0-2 of every level), train = ids 120-4,119 (seeds 3-102). The paper's sets are AgentGym-RL-Data-ID's
files; run them with `python train.py --env babyai --train-tasks babyai_train.json` and
`python eval.py --env babyai --tasks babyai_test.json`. Eval categories are the level families in
_CATEGORY_BOUNDS (upstream's category files are not published).

Where this port deliberately differs from upstream. These change rewards (upstream bugs):
- Upstream keeps an episode running after a "slow" success (reward <= 0.5) and adds every later
  reward to a cumulative score, so an agent can farm reward by re-satisfying its goal. Here the
  first success ends the episode with its reward; so does a MiniGrid failure (reward 0) or
  MiniGrid's own step limit, after which no success could score.
- Upstream runs all primitives of a macro even after one of them completed the task, and then
  reports the last primitive's reward, which can throw a success away. Here a macro stops at the
  primitive that ends the task.
These change which macro actions are offered and the paths they take (upstream bugs):
- Path search is a plain shortest-path BFS (forward, then left, then right), where upstream's
  queue could rewrite a visited state's parent and return a longer path.
- Path search stays inside the 7x7 view. Upstream's search area is off by one for three of the
  four headings (facing east or south it includes the line of cells behind the agent; facing south
  or west, a line past the view's right edge), so it offered paths through cells the agent cannot
  see, e.g. "go to blue closed door 1" on task 34, where no visible path leads.
And these are small:
- "pick up <obj> <id>", the instruction's spelling, is accepted for upstream's "pickup <obj> <id>"
  (upstream answers "The action is not recognized").
- A step after the episode ended answers "The task is already finished." with the final reward,
  where upstream's server returns an error that its client turns into an exception.
- minigrid 3.2 instead of upstream's pinned minigrid < 2.5 (2.3.1), where upstream's level 4,
  GoToObjS6-v0, no longer exists; its twin GoToObjS4-v0 stands in (LEVELS below). Checked against
  minigrid 2.3.1 on seeds 0-49 of all 40 levels, a seed gives the same game except tasks 155 and
  156 (SynthLoc and SynthSeq, seed 3): the same layout with a differently worded mission.
"""

from __future__ import annotations

import copy
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI levels)
import numpy as np
from minigrid.core.constants import DIR_TO_VEC, IDX_TO_COLOR, IDX_TO_OBJECT
from minigrid.core.world_object import WorldObj
from minigrid.envs.babyai.core import roomgrid_level
from minigrid.envs.babyai.core.verifier import GoToInstr, OpenInstr, PickupInstr, SeqInstr
from minigrid.utils.baby_ai_bot import BabyAIBot

from envs import REACT_ONLY_ONE, Env, StepResult, canonical_key, react_action
from envs.tools import Param, Tool

# MiniGrid prints "Sampling rejected: ..." to stdout for every rejected level layout. Silence that
# module's print itself: redirecting sys.stdout is not safe while envs reset in parallel threads.
roomgrid_level.print = lambda *args, **kwargs: None

# AgentGym's 40 levels, in its order (level k of upstream's 1-based table is LEVELS[k - 1]).
# Upstream's level 4, GoToObjS6-v0, was registered with room_size 4 by mistake (minigrid < 2.5,
# which upstream pins); minigrid 3 retired it for GoToObjS6-v1, a 6x6 room. GoToObjS4-v0 is the
# game upstream actually served: the same mission, layout and step limit for every seed.
LEVELS = [f"BabyAI-{name}-v0" for name in (
    "GoToRedBallGrey GoToRedBall GoToRedBallNoDists GoToObjS6 GoToLocalS8N7 GoToObjMazeS7 "
    "GoToImpUnlock GoToSeqS5R2 GoToRedBlueBall GoToDoor GoToObjDoor Open OpenRedDoor OpenDoorLoc "
    "OpenRedBlueDoorsDebug OpenDoorsOrderN4Debug Pickup UnblockPickup PickupLoc PickupDistDebug "
    "PickupAbove PutNextLocalS6N4 PutNextS7N4Carrying Unlock UnlockLocalDist KeyInBox "
    "UnlockPickupDist BlockedUnlockPickup UnlockToUnlock ActionObjDoor FindObjS7 KeyCorridorS6R3 "
    "OneRoomS20 MoveTwoAcrossS8N9 SynthS5R2 SynthLoc SynthSeq MiniBossLevel BossLevel "
    "BossLevelNoUnlock"
).split()]
LEVELS[3] = "BabyAI-GoToObjS4-v0"

# Eval categories by level family (upstream's category files are not published).
_CATEGORY_BOUNDS = [  # (first level index, category)
    (0, "GoTo"), (11, "Open"), (16, "Pickup"), (21, "PutNext"), (23, "Unlock"), (29, "AOD"),
    (30, "Find"), (32, "Room"), (34, "Synth"), (37, "Boss"),
]

INSTRUCTION = (
    "You are an exploration master that wants to finish every goal you are given. Every round I "
    "will give you an observation, and you have to respond an action and your thought based on the "
    "observation to finish the given task. You are placed in a room and you need to accomplish the "
    "given goal with actions.\n\nYou can use the following actions: \n\n- turn right \n\n- turn left "
    "\n\n- move forward \n\n- go to <obj> <id> \n\n- pick up <obj> <id> \n\n- go through <door> <id>: "
    "<door> must be an open door. \n\n- toggle and go through <door> <id>: <door> can be a closed "
    "door or a locked door. If you want to open a locked door, you need to carry a key that is of "
    "the same color as the locked door. \n\n- toggle: there is a closed or locked door right in "
    "front of you and you can toggle it.\nYour response should use the following format:\n"
    "Thought:\n<Your Thought>\n\nAction:\n<Your Action>"
)
ACK = "OK. I'll follow your instructions and try my best to solve the task."

# The same actions as native tools (envs/tools.py), each call the `Action:` line a reply would write. Also
# "drop", which the instruction leaves out but upstream offers and the expert uses.
OBJECT = Param("string", "An object and its number, e.g. red ball 1")
DOOR = Param("string", "A door and its number, e.g. red locked door 1")
TOOLS = (
    Tool("turn_left", "Turn left.", {}, "turn left"),
    Tool("turn_right", "Turn right.", {}, "turn right"),
    Tool("move_forward", "Move one step forward.", {}, "move forward"),
    Tool("go_to", "Go to an object.", {"object": OBJECT}, "go to {object}"),
    Tool("pick_up", "Pick up an object.", {"object": OBJECT}, "pick up {object}", reads="pickup (?P<object>.*)"),
    Tool("drop", "Drop what you carry in front of you.", {}, "drop"),
    Tool("go_through", "Go through an open door.", {"door": DOOR}, "go through {door}"),
    Tool("toggle_and_go_through", "Open a closed or locked door and go through it.", {"door": DOOR},
         "toggle and go through {door}"),
    Tool("toggle", "Toggle the door right in front of you.", {}, "toggle"),
    Tool("check_available_actions", "List the actions you can take.", {}, "check available actions",
         reads=".*check.*"),  # step() lists them for any action that mentions "check"
)
REPLY = "Action: {action}"


def read_action(text: str) -> str | None:
    """The action a reply sends, as step() reads it: upstream's ReAct parsing, then spelled()."""
    action = react_action(text)
    return None if action is None else spelled(action)


def spelled(action: str) -> str:
    """An action as step() reads it: in lower case, and the instruction's "pick up <obj> <id>" as upstream's
    "pickup <obj> <id>" (see above: upstream does not recognise the instruction's spelling)."""
    action = action.lower().strip()
    return "pickup " + action[len("pick up "):] if action.startswith("pick up ") else action

LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE = range(6)
DOOR_STATES = {0: "open", 1: "closed", 2: "locked"}
# What path search may not walk through, and what blocks a drop: matched on the object's name.
BLOCKING = ("wall", "box", "lava", "ball", "key")


def category(task_id: int) -> str:
    level = task_id % len(LEVELS)
    return [name for first, name in _CATEGORY_BOUNDS if level >= first][-1]


def level_and_seed(task_id: int) -> tuple[str, int]:
    return LEVELS[task_id % len(LEVELS)], task_id // len(LEVELS)


def _cross(a, b) -> int:
    return int(a[0] * b[1] - a[1] * b[0])


def _shortest_path(start, direction, target, blocked, area, arrive):
    """Primitive actions from (start, direction) until standing on `target` (arrive) or facing it.
    Breadth-first over (cell, direction); None when the visible area has no such path."""
    start = (int(start[0]), int(start[1]))
    parent = {(start, direction): None}
    frontier = [(start, direction)]
    while frontier:
        next_frontier = []
        for state in frontier:
            pos, d = state
            vec = DIR_TO_VEC[d]
            reached = pos == target if arrive else (pos[0] + vec[0], pos[1] + vec[1]) == target
            if reached:
                path = []
                while parent[state] is not None:
                    state, action = parent[state]
                    path.append(action)
                return path[::-1]
            for action in (FORWARD, LEFT, RIGHT):
                if action == FORWARD:
                    nxt = ((pos[0] + vec[0], pos[1] + vec[1]), d)
                    if nxt[0] not in area or nxt[0] in blocked:
                        continue
                else:
                    nxt = (pos, (d - 1) % 4 if action == LEFT else (d + 1) % 4)
                if nxt not in parent:
                    parent[nxt] = (state, action)
                    next_frontier.append(nxt)
        frontier = next_frontier
    return None


def canonical_state(game) -> str:
    """The state the next action acts on, as text: every cell of the grid in MiniGrid's encoding (object type, colour
    and state: where each object lies, doors open, closed or locked; a carried object is off the grid), the agent's
    cell, heading and what it carries, and which halves of a sequenced mission ("... and then ...") are done, which
    the verifier remembers and the grid does not show. Not the step count (the next action's effect does not depend
    on it, except through MiniGrid's step limit)."""
    x, y = (int(c) for c in game.agent_pos)
    carrying = f"{game.carrying.color} {game.carrying.type}" if game.carrying else "nothing"
    return (f"grid {game.grid.encode().tobytes().hex()} agent {x},{y} heading {int(game.agent_dir)} "
            f"carrying {carrying} done {_progress(game.instrs)}")


def _progress(instr) -> str:
    """Which parts of a mission's sequence are done, e.g. "(10 (11) )" for "A and B, then C" with A and B done."""
    if not isinstance(instr, SeqInstr):
        return ""
    done = f"{int(instr.a_done == 'success')}{int(instr.b_done == 'success')}"
    return f"({done} {_progress(instr.instr_a)} {_progress(instr.instr_b)})"


@dataclass
class _Seen:
    """An object in view, named as the text names it ("red ball", "blue locked door"), its cell, and its distance
    (grid steps from the agent)."""
    name: str
    pos: tuple[int, int]
    dist: int


@dataclass
class _View:
    """What describe() reads off the 7x7 view: the agent's cell, heading and forward and right unit vectors, the
    cells in view (path search's area), the objects in view nearest first, the walls and boxes straight ahead
    nearest first (`barriers`: name and steps ahead), the cells path search may not enter, what the agent carries."""
    pos: np.ndarray
    heading: int
    fwd: np.ndarray
    right: np.ndarray
    area: set[tuple[int, int]]
    objects: list[_Seen]
    barriers: list[tuple[str, int]]
    blocked: set[tuple[int, int]]
    carrying: WorldObj | None

    def path_to(self, obj: _Seen, arrive: bool = False) -> list[int] | None:
        return _shortest_path(self.pos, self.heading, obj.pos, self.blocked, self.area, arrive)


@dataclass
class _Menu:
    """The available macro actions (name -> primitive actions; insertion order is the order the agent sees), the
    error message for each action that is not available, and the cell each object macro leads to."""
    actions: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    targets: dict[str, tuple[int, int]] = field(default_factory=dict)


def describe(game, image) -> tuple[str, dict[str, list[int]], dict[str, str], dict[str, tuple[int, int]]]:
    """AgentGym's text view of the agent's 7x7 egocentric `image`: the description, the available
    macro actions (name -> primitive actions, in upstream's order), the fine-grained error message
    for each action that is not available, and the cell each object macro leads to."""
    view = _scan(game, image)
    menu = _Menu()
    # The action families in upstream's order.
    _move(view, menu)
    if view.carrying is None:
        _object_macros(view, menu, "pickup", ("wall", "door", "goal"), [PICKUP])
    _drop(view, menu)
    _doors(view, menu)
    _goal(view, menu)
    _object_macros(view, menu, "go to", ("wall", "goal"), [])
    menu.actions["check available actions"] = []
    return _description(view), menu.actions, menu.errors, menu.targets


def _scan(game, image) -> _View:
    """The visible things, scanned row by row from the far edge, then sorted (stably) by distance."""
    view = game.agent_view_size
    pos = np.array(game.agent_pos)
    d = game.agent_dir
    fwd, right = DIR_TO_VEC[d], DIR_TO_VEC[(d + 1) % 4]
    top_left = pos + fwd * (view - 1) - right * (view // 2)
    objects, barriers, area = [], [], set()
    for j in range(view):
        for i in range(view):
            cell = top_left - fwd * j + right * i
            area.add((int(cell[0]), int(cell[1])))
            rel = cell - pos
            if cell[0] < 0 or cell[1] < 0 or not rel.any():
                continue
            kind = IDX_TO_OBJECT[image[i, j, 0]]
            color = IDX_TO_COLOR[image[i, j, 1]]
            if kind in ("door", "key", "ball", "box", "goal", "lava", "wall"):
                name = f"{color} {DOOR_STATES[image[i, j, 2]]} door" if kind == "door" else f"{color} {kind}"
                objects.append(_Seen(name, (int(cell[0]), int(cell[1])), int(abs(rel).sum())))
            if kind in ("box", "wall") and _cross(fwd, rel) == 0:
                barriers.append((kind, int(np.dot(fwd, rel))))
    objects.sort(key=lambda o: o.dist)
    barriers.sort(key=lambda b: b[1])
    blocked = {o.pos for o in objects if any(b in o.name for b in BLOCKING)}
    return _View(pos, d, fwd, right, area, objects, barriers, blocked, game.carrying)


def _description(view: _View) -> str:
    """The observation's text: every object in view but walls, numbered by name, where it lies; the barrier
    straight ahead; what the agent carries."""
    if view.objects:
        text = "In front of you in this room, you can see several objects: "
        seen: dict[str, int] = {}
        for obj in view.objects:
            if "wall" in obj.name:
                continue
            rel = np.array(obj.pos) - view.pos
            ahead, side = int(np.dot(view.fwd, rel)), int(np.dot(view.right, rel))
            if side == 0:
                where = f"right in front of you {ahead} steps away. "
            else:
                where = f"{ahead} steps in front of you and {abs(side)} steps to your {'right' if side > 0 else 'left'}. "
            seen[obj.name] = seen.get(obj.name, 0) + 1
            text += f"There is a {obj.name} {seen[obj.name]} {where} "
    else:
        text = "You cannot see any objects within sight."
    text += "The room has walls around you. "
    if view.barriers:
        name, dist = view.barriers[0]
        text += f"You are facing a {name} {dist} steps away. "
    carrying = view.carrying
    text += f"You are carrying a {carrying.color} {carrying.type}." if carrying else "You are not carrying anything."
    return text


def _move(view: _View, menu: _Menu) -> None:
    menu.actions["turn left"] = [LEFT]
    menu.actions["turn right"] = [RIGHT]
    if not view.barriers or view.barriers[0][1] > 1:
        menu.actions["move forward"] = [FORWARD]
    else:
        menu.errors["move forward"] = "There is a barrier in front of you, you can't move forward."


def _object_macros(view: _View, menu: _Menu, verb: str, skip: tuple[str, ...], last: list[int]) -> None:
    """"<verb> <object> <n>" for each object in view not named by `skip`: the path to face it, then `last`.
    Numbering counts only reachable objects of a name, as upstream does."""
    count: dict[str, int] = {}
    for obj in view.objects:
        if any(k in obj.name for k in skip):
            continue
        path = view.path_to(obj)
        key = f"{verb} {obj.name} {count.get(obj.name, 0) + 1}"
        if path is None:
            menu.errors[key] = f"You cannot {key}, as there is no path leading to it."
        else:
            count[obj.name] = count.get(obj.name, 0) + 1
            menu.actions[key] = path + last
            menu.targets[key] = obj.pos


def _drop(view: _View, menu: _Menu) -> None:
    if view.carrying is None:
        menu.errors["drop"] = "You cannot drop the object, as you are not carrying anything."
        return
    ahead = (int(view.pos[0] + view.fwd[0]), int(view.pos[1] + view.fwd[1]))
    if ahead in view.blocked:
        menu.errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
    else:
        menu.actions["drop"] = [DROP]


def _doors(view: _View, menu: _Menu) -> None:
    """"go through" an open door (walking onto it); "toggle and go through" a closed door, or a locked one with the
    key of its colour, and "toggle" when such a door is right ahead."""
    carrying = view.carrying
    doors: dict[str, int] = {}
    for obj in view.objects:
        if "door" not in obj.name:
            continue
        doors[obj.name] = doors.get(obj.name, 0) + 1
        name = f"{obj.name} {doors[obj.name]}"
        if "open door" in obj.name:
            path = view.path_to(obj, arrive=True)
            if path is None:
                menu.errors[f"go through {name}"] = f"You cannot go through {name}, as there is no path leading to it."
            else:
                menu.actions[f"go through {name}"] = path
                menu.targets[f"go through {name}"] = obj.pos
            continue
        key = f"toggle and go through {name}"
        if "locked door" in obj.name:
            if carrying is None or carrying.type != "key":
                menu.errors[key] = f"You cannot {key}, as you are not carrying a key."
                continue
            if carrying.color != obj.name.split(" ")[0]:
                menu.errors[key] = (f"You cannot {key}, as the color of the key you are carrying does not match "
                                    "the color of door.")
                continue
        path = view.path_to(obj)
        if path is None:
            menu.errors[key] = f"You cannot {key}, as there is no path leading to it."
        else:
            menu.actions[key] = path + [TOGGLE, FORWARD]
            menu.targets[key] = obj.pos
            if not path:
                menu.actions["toggle"] = [TOGGLE]
        if "closed door" in obj.name:
            menu.errors[f"go through {name}"] = (f"You cannot go through {name}, as it is closed. "
                                                 "You should toggle it first.")


def _goal(view: _View, menu: _Menu) -> None:
    for obj in view.objects:
        if "goal" in obj.name:
            path = view.path_to(obj, arrive=True)
            if path is None:
                menu.errors["go to goal"] = "You cannot go to the goal, as there is no path leading to it."
            else:
                menu.actions["go to goal"] = path


class BabyAI(Env):
    name = "babyai"
    instruction = INSTRUCTION
    ack = ACK

    def __init__(self):
        self._games: dict[str, object] = {}  # one MiniGrid env per level, reused across resets
        self.game = None
        self.key: str | None = None  # state_key(), computed where the game changes

    def reset(self, task_id: int) -> str:
        level, seed = level_and_seed(task_id)
        if level not in self._games:
            self._games[level] = gymnasium.make(level).unwrapped
        self.game = self._games[level]
        obs, _ = self.game.reset(seed=seed)
        self.task_id, self.level, self.seed = task_id, level, seed
        self.goal = self.game.mission.replace("then", "and").replace("after you", "and")
        self.image = obs["image"]
        self.description, self.actions, self.errors, self.targets = describe(self.game, self.image)
        self.score, self.done = 0.0, False
        self.key = canonical_key(canonical_state(self.game))
        return f"Your goal: {self.goal}\n{self.description}{self._action_list()}"

    def state_key(self) -> str | None:
        """The digest of canonical_state() after the last reset or macro (an invalid action leaves it)."""
        return self.key

    def fork(self) -> BabyAI:
        """An independent copy (Env.fork): the game deep-copied, its grid, agent and random generator with it; the
        other levels' cached games stay behind (a reset of the copy makes them anew)."""
        twin = copy.deepcopy(self, {id(self._games): {}})
        twin._games = {self.level: twin.game} if self.game is not None else {}
        return twin

    def _action_list(self) -> str:
        return "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in self.actions) + "]"

    def step(self, text: str) -> StepResult:
        action = react_action(text)
        if action is None and self.game is not None and not self.done:
            return StepResult(REACT_ONLY_ONE, self.score, False, {"valid": False})
        return self.act(action or "")

    def act(self, action: str) -> StepResult:
        """Upstream's server step on an action its client already parsed (what envs/serve.py calls)."""
        if self.game is None:
            raise RuntimeError("call reset(task_id) before step()")
        if self.done:
            return StepResult("The task is already finished.", self.score, True, {"valid": False})
        action = spelled(action)
        info = {"action": action, "valid": True, "primitives": []}
        if "check" in action:
            observation = "You can take the following actions: " + ", ".join(self.actions)
        elif action not in self.actions:
            info["valid"] = False
            if action == "":
                observation = "No change in state."
            else:
                observation = self.errors.get(action, "The action is not recognized. Please check valid actions.")
        elif not self.actions[action]:
            observation = "No change in state."
        else:
            observation = self._run(self.actions[action], info)
        return StepResult(observation + self._action_list(), self.score, self.done, info)

    def _run(self, primitives: list[int], info: dict) -> str:
        reward, terminated, truncated = 0.0, False, False
        for primitive in primitives:
            obs, reward, terminated, truncated, _ = self.game.step(primitive)
            info["primitives"].append(primitive)
            changed = not np.array_equal(obs["image"], self.image)
            self.image = obs["image"]
            if terminated or truncated or not changed:
                break
        if terminated or truncated:
            self.done = True
            self.score = float(reward) if terminated else 0.0
        info["success"] = self.score > 0
        self.description, self.actions, self.errors, self.targets = describe(self.game, self.image)
        self.key = canonical_key(canonical_state(self.game))
        return self.description + ("\n The task is completed." if self.score > 0 else "")


def make() -> BabyAI:
    return BabyAI()


def picture(env: BabyAI) -> bytes:
    """The game as a PNG: MiniGrid's own rendering of the whole grid, the agent's 7x7 view highlighted (what
    envs/serve.py's /render answers and the trajectory viewer draws)."""
    rgb = env.game.get_frame(highlight=True, tile_size=32)
    height, width, _ = rgb.shape
    rows = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _text_action(env: BabyAI, primitive: int) -> str:
    """The text action whose macro is exactly this one primitive."""
    for name, primitives in env.actions.items():
        if primitives == [primitive] and not name.startswith("go through"):
            return name
    raise RuntimeError(f"BabyAIBot chose primitive {primitive}, which no text action performs here ({env.level})")


class _BoundedStack(list):
    """BabyAIBot's plan stack, counting reads: the bot's replanning loop never ends on some tasks
    (UnlockToUnlock seed 84 spins forever on the raw game too), so a replan that reads its stack
    more than `limit` times is stopped with an error."""

    def __init__(self, items, limit=10_000):
        super().__init__(items)
        self.reads, self.limit = 0, limit

    def __getitem__(self, index):
        self.reads += 1
        if self.reads > self.limit:
            raise RuntimeError("BabyAIBot's replanning does not terminate here")
        return super().__getitem__(index)


def _finishing_macro(env: BabyAI) -> str | None:
    """For a mission that is a single go-to, pick-up or open instruction: the macro that walks to a
    matching object in view and completes it, if there is one."""
    instr = env.game.instrs
    if isinstance(instr, GoToInstr):
        prefix, cells = "go to ", {tuple(int(c) for c in pos) for pos in instr.desc.obj_poss}
    elif isinstance(instr, (PickupInstr, OpenInstr)):
        prefix = "pickup " if isinstance(instr, PickupInstr) else "toggle and go through "
        cells = {tuple(int(c) for c in obj.cur_pos) for obj in instr.desc.obj_set if obj.cur_pos is not None}
    else:
        return None
    return next((name for name, cell in env.targets.items() if name.startswith(prefix) and cell in cells), None)


def oracle(env: BabyAI, macros: bool = True) -> Callable[[str], str]:
    """A scripted expert through the text interface. When the mission is a single go-to, pick-up or
    open instruction and a matching object is in view, it uses the macro that completes it in one
    turn (as a good agent would); otherwise it plays BabyAIBot's plan, one primitive action per
    turn (`macros=False`: always the bot's plan, step for step). Raises RuntimeError where the bot
    cannot play (KeyInBox and PutNext*Carrying, as its docstring says; a few tasks where its
    replanning never ends) or where its plan needs an action that upstream's text interface lacks
    (closing an open door to reopen it)."""
    state = {"bot": None}

    def act(observation: str) -> str:
        macro = _finishing_macro(env) if macros else None
        if macro is not None:
            state["bot"] = None  # the macro moves the agent behind the bot's back: replan afresh after it
            return f"Thought:\nI can see where to {env.goal}.\n\nAction:\n{macro}"
        if state["bot"] is None:
            state["bot"] = BabyAIBot(env.game)
            state["bot"].stack = _BoundedStack(state["bot"].stack)
        bot = state["bot"]
        bot.stack.reads = 0
        try:
            primitive = int(bot.replan())
        except Exception as error:  # the bot's own asserts on levels it cannot play
            raise RuntimeError(f"BabyAIBot cannot play {env.level} seed {env.seed}: {error!r}") from error
        action = _text_action(env, primitive)
        return f"Thought:\nI need to {env.goal}.\n\nAction:\n{action}"

    return act
