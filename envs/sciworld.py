"""SciWorld: AgentGym's ScienceWorld environment, in process, on the real `scienceworld` package.

Task id -> game exactly as AgentGym's server: the flat list of (task, variation) over the
simulator's 30 tasks in their order, minus the 7 AgentGym leaves out (grow-plant, grow-fruit,
the three inclined-plane and the two mendelian-genetics tasks): 4,639 ids with scienceworld 1.2.3
(TASKS below; a test checks it against the simulator). Reset loads the variation and answers the
task description plus "look around"; a step sends everything after the model's last "Action:" to
the simulator and answers its raw output. The reward is upstream's: the task's progress score
0-100, or -100 once the task is failed (focusing on the wrong thing); the episode ends on
completion, failure or more than `step_limit` moves. `make(reward="normalized")` gives
score / 100 with failure as 0 instead.

The state key (Env.state_key, GiGPO's anchor groups) is a digest of canonical_state(): the progress score, the
room the agent is in as "look around" describes it (its objects, their contents and states, the doors) and the
inventory as "inventory" does, lines and listed parts sorted since the simulator lists objects in an order that
changes between runs. The simulator's free look and inventory (no move) read them at the end of each reset and
step, inside the same JVM call, and the key is cached: about 0.2 ms on a step of about 9 ms (372 gold-path steps of
5 tasks). What it leaves out: rooms the agent is not in (only getObjectTree, which writes the whole world to files,
describes them), so episodes that differ only there share a key. The score is in it because focusing on the right
object raises the score and changes nothing in view.

The simulator is Scala on a JVM reached through py4j. Upstream starts one JVM per env (2 s and
0.3-2.6 GiB each) and steps through the Python wrapper, whose `step()` also rebuilds the ~2,900
valid actions, the room, the inventory and the task description for its `info` (about 200 ms).
Here a pool runs many per-env simulator objects (`PythonInterface`) inside one JVM with a bounded
heap, `pool_size` envs per JVM, and a step is the simulator's own step/getScore/getCompleted/
getNumMoves calls (a few ms); valid actions are computed only when `valid_actions()` asks.

The simulator keeps shared static state: two envs stepping at the same time in one JVM get each
other's rooms (measured). So every call into one JVM holds that JVM's lock; envs on different
JVMs run in parallel. A JVM that dies, runs out of heap or answers nothing for `timeout` seconds
is killed; the calls of every env on it raise SimulatorError (the rollout ends those trajectories
with the error) and the next reset of such an env starts on a fresh JVM. JVMs are killed at
interpreter exit, and die on their own when this process does (py4j's die-on-broken-pipe).

Options are make()'s keywords, e.g. `python train.py --env sciworld --env-options reward normalized
pool_size 32`: reward ("score" or "normalized"), pool_size (envs per JVM, default 16), heap (-Xmx,
default 320m + 16m per env), timeout (seconds, default 60), step_limit (moves, default 100).

The simulator itself does not replay exactly: the same actions on the same variation can give
other observations (the order of objects in a room, a temperature, the move at which a circuit
lights up) in most tasks, in a fresh JVM as in a used one, upstream as here.

Default data: the splits in envs/data/sciworld_{train,test}.json are the simulator's own train
and test variations of each task (2,312 and 1,171 ids; its dev variations are in neither;
scripts/sciworld_splits.py), not AgentGym-RL-Data-ID's 200-task eval file. The paper's sets:
`python train.py --env sciworld --train-tasks sciworld_train.json` and `python eval.py --env
sciworld --tasks sciworld_test.json` with AgentGym-RL-Data-ID's files. Ids mean the same
(task, variation) as upstream's server only on the same simulator: its flat list follows the
installed scienceworld's task order and variation counts, and upstream does not pin a version
(1.2.3 here; its server's list, rebuilt on 1.2.3, equals TASKS). Eval categories are the task
names (upstream's category files are not published).

Where this port deliberately differs from upstream:
- Upstream's client strips a trailing "</s>" with a slice that also eats the character before
  it; here exactly "</s>" is stripped.
- A step after the episode ended answers "The task is already finished." with the final reward,
  where upstream's server returns an error that its client turns into an exception.
- A lone surrogate in an action (not UTF-8, which py4j writes) reaches the simulator as "?";
  upstream's py4j call raised on it (here it would have cost the JVM and every env on it).
- A response without "Action:" sends "" to the simulator; upstream's shared ReAct parser sends the
  whole response instead when it contains "search[" or "click[" (a WebShop rule).
- The oracle needs the simulator's gold path, which a load must ask for; it reloads the task with
  it, so its episode may differ in such details from the first observation the env gave.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import re
import subprocess
import threading
from collections import deque
from typing import Callable

from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
from py4j.protocol import Py4JError, Py4JJavaError
from scienceworld.constants import BASEPATH, JAR_PATH

from envs import Env, StepResult, canonical_key
from envs.tools import Param, Tool

# (task name, number of variations) in the simulator's task order, without AgentGym's exclusions
# {5-1, 5-2, 9-1, 9-2, 9-3, 10-1, 10-2}; scienceworld 1.2.3.
TASKS = [
    ("boil", 30), ("melt", 30), ("freeze", 30), ("change-the-state-of-matter-of", 30),
    ("use-thermometer", 540), ("measure-melting-point-known-substance", 436),
    ("measure-melting-point-unknown-substance", 300), ("power-component", 20),
    ("power-component-renewable-vs-nonrenewable-energy", 20), ("test-conductivity", 900),
    ("test-conductivity-of-unknown-substances", 600), ("find-living-thing", 300),
    ("find-non-living-thing", 300), ("find-plant", 300), ("find-animal", 300),
    ("chemistry-mix", 32), ("chemistry-mix-paint-secondary-color", 36),
    ("chemistry-mix-paint-tertiary-color", 36), ("lifespan-longest-lived", 125),
    ("lifespan-shortest-lived", 125), ("lifespan-longest-lived-then-shortest-lived", 125),
    ("identify-life-stages-1", 14), ("identify-life-stages-2", 10),
]
FIRST_IDS = list(itertools.accumulate([n for _, n in TASKS], initial=0))  # first id of each task
NUM_TASK_IDS = FIRST_IDS[-1]

INSTRUCTION = (
    'You are an agent for science world. Every round I will give you an observation, you have to '
    'respond an action based on the observation to finish the given task. Here are the actions you '
    'may take: [{"action": "open/close OBJ", "description": "open/close a container"}, {"action": '
    '"de/activate OBJ", "description": "activate/deactivate a device"}, {"action": "connect OBJ to '
    'OBJ", "description": "connect electrical components"}, {"action": "disconnect OBJ", '
    '"description": "disconnect electrical components"}, {"action": "use OBJ [on OBJ]", '
    '"description": "use a device/item"}, {"action": "look around", "description": "describe the '
    'current room"}, {"action": "look at OBJ", "description": "describe an object in detail"}, '
    '{"action": "look in OBJ", "description": "describe a container\'s contents"}, {"action": '
    '"read OBJ", "description": "read a note or book"}, {"action": "move OBJ to OBJ", '
    '"description": "move an object to a container"}, {"action": "pick up OBJ", "description": '
    '"move an object to the inventory"}, {"action": "put down OBJ", "description": "drop an '
    'inventory item"}, {"action": "pour OBJ into OBJ", "description": "pour a liquid into a '
    'container"}, {"action": "dunk OBJ into OBJ", "description": "dunk a container into a '
    'liquid"}, {"action": "mix OBJ", "description": "chemically mix a container"}, {"action": '
    '"go to LOC", "description": "move to a new location"}, {"action": "eat OBJ", "description": '
    '"eat a food"}, {"action": "flush OBJ", "description": "flush a toilet"}, {"action": "focus on '
    'OBJ", "description": "signal intent on a task object"}, {"action": "wait", "description": '
    '"take no action for 10 iterations"}, {"action": "wait1", "description": "take no action for 1 '
    'iteration"}, {"action":"examine OBJ","description":"provides a description of the objects '
    'present on or in a receptacle."}, {"action": "task", "description": "describe current '
    'task"}, {"action": "inventory", "description": "list your inventory"}]\nYour response should '
    'use the following format:\nThought:\nyour thoughts.\n\nAction:\nyour next action'
)
ACK = "OK. I'll follow your instructions and try my best to solve the task."
REWARDS = ("score", "normalized")
NO_MATCH = "No known action matches that input."  # the simulator's answer to an action it cannot parse

# The instruction's actions as native tools (envs/tools.py), each call the `Action:` line a reply would write.
# Pour and dunk are written with "in", the simulator's own template, and read with "in" or "into", which it
# takes alike. The expert writes both, and an object's name may hold "in" ("cup containing red paint in art
# studio in jug"): no reading can tell where such a name ends, but written back with "in" the reply is the same
# text whatever the split. "drop" reads as put down, the same action.
OBJECT = Param("string", "An object")
TARGET = Param("string", "The other object")
TOOLS = (
    Tool("open", "Open a container.", {"object": OBJECT}, "open {object}"),
    Tool("close", "Close a container.", {"object": OBJECT}, "close {object}"),
    Tool("activate", "Activate a device.", {"object": OBJECT}, "activate {object}"),
    Tool("deactivate", "Deactivate a device.", {"object": OBJECT}, "deactivate {object}"),
    Tool("connect", "Connect electrical components.", {"object": OBJECT, "target": TARGET},
         "connect {object} to {target}"),
    Tool("disconnect", "Disconnect electrical components.", {"object": OBJECT}, "disconnect {object}"),
    Tool("use", "Use a device or item, on another object if given.",
         {"object": OBJECT, "target": Param("string", "What to use it on", required=False)},
         lambda a: f"use {a['object']}" + (f" on {a['target']}" if "target" in a else ""),
         reads="use (?P<object>.*?)(?: on (?P<target>.*))?"),
    Tool("look_around", "Describe the current room.", {}, "look around"),
    Tool("look_at", "Describe an object in detail.", {"object": OBJECT}, "look at {object}"),
    Tool("look_in", "Describe a container's contents.", {"object": OBJECT}, "look in {object}"),
    Tool("read", "Read a note or book.", {"object": OBJECT}, "read {object}"),
    Tool("move", "Move an object to a container.", {"object": OBJECT, "target": TARGET}, "move {object} to {target}"),
    Tool("pick_up", "Move an object to the inventory.", {"object": OBJECT}, "pick up {object}"),
    Tool("put_down", "Drop an inventory item.", {"object": OBJECT}, "put down {object}",
         reads="(?:put down|drop) (?P<object>.*)"),
    Tool("pour", "Pour a liquid into a container.", {"object": OBJECT, "target": TARGET}, "pour {object} in {target}",
         reads="pour (?P<object>(?:(?! into ).)*) in(?:to)? (?P<target>.*)"),  # at " into " where there is one
    Tool("dunk", "Dunk a container into a liquid.", {"object": OBJECT, "target": TARGET}, "dunk {object} in {target}",
         reads="dunk (?P<object>(?:(?! into ).)*) in(?:to)? (?P<target>.*)"),
    Tool("mix", "Chemically mix a container.", {"object": OBJECT}, "mix {object}"),
    Tool("go_to", "Move to a new location.", {"location": Param("string", "A room, e.g. kitchen")},
         "go to {location}"),
    Tool("eat", "Eat a food.", {"object": OBJECT}, "eat {object}"),
    Tool("flush", "Flush a toilet.", {"object": OBJECT}, "flush {object}"),
    Tool("focus_on", "Signal intent on a task object.", {"object": OBJECT}, "focus on {object}"),
    Tool("wait", "Take no action for 10 iterations.", {}, "wait"),
    Tool("wait1", "Take no action for 1 iteration.", {}, "wait1"),
    Tool("examine", "Describe the objects on or in a receptacle.", {"object": OBJECT}, "examine {object}"),
    Tool("task", "Describe the current task.", {}, "task"),
    Tool("inventory", "List your inventory.", {}, "inventory"),
)
REPLY = "Action: {action}"


def canonical_state(look: str, inventory: str, score: int) -> str:
    """The state key's canonical form (module docstring): the progress score, then the room's description and the
    inventory, each with its lines and the comma-separated parts of each line sorted, as the simulator lists
    objects in an order that changes from run to run ("On the desk is: a tin cup (containing red paint), ...")."""
    def order_free(text: str) -> str:
        return "\n".join(sorted(", ".join(sorted(line.strip().split(", "))) for line in text.split("\n") if line.strip()))

    return f"score {score}\n{order_free(look)}\ninventory\n{order_free(inventory)}"


def _seen(sim) -> tuple[str, str]:
    """The room and the inventory as "look around" and "inventory" describe them, without a move (inside a JVM
    call: the state key is made of them)."""
    return sim.freeActionLook(), sim.freeActionInventory()


def task_and_variation(task_id: int) -> tuple[str, int]:
    if not 0 <= task_id < NUM_TASK_IDS:
        raise ValueError(f"sciworld task ids run from 0 to {NUM_TASK_IDS - 1}, got {task_id}")
    index = bisect.bisect_right(FIRST_IDS, task_id) - 1
    return TASKS[index][0], task_id - FIRST_IDS[index]


def category(task_id: int) -> str:
    return task_and_variation(task_id)[0]


def parse_action(text: str) -> str:
    """Upstream's ReAct parsing: everything after the last "Action:", stripped ("" without one)."""
    if text.endswith("</s>"):
        text = text[: -len("</s>")]
    _, found, action = text.rpartition("Action:")
    return action.strip() if found else ""


def read_action(text: str) -> str:
    """The action a reply sends, as the simulator reads it: it ignores case and repeated spaces."""
    return re.sub(" +", " ", parse_action(text).lower())


# ----------------------------------------------------------------------------------------------
# JVMs and the pool that shares them


class SimulatorError(RuntimeError):
    """The simulator could not answer (its JVM died, hung or raised): an infrastructure failure."""


class JVM:
    """One simulator JVM. Every call into it goes through `call`, one at a time."""

    def __init__(self, heap: str, timeout: float):
        self.output: deque[str] = deque(maxlen=20)  # py4j appends the JVM's output lines on the left
        options = [f"-Xmx{heap}", "-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError"]
        try:
            port, self.process = launch_gateway(
                classpath=JAR_PATH, javaopts=options, die_on_exit=True, cwd=BASEPATH,
                redirect_stdout=self.output, redirect_stderr=self.output, return_proc=True,
            )
        except FileNotFoundError:
            raise RuntimeError("SciWorld needs a Java runtime on PATH; install one, e.g. "
                               "`apt-get install openjdk-17-jre-headless`") from None
        except ValueError:  # py4j read no port number: java exited at once
            raise RuntimeError(f"the ScienceWorld JVM did not start (java options {options})") from None
        self.gateway = JavaGateway(
            gateway_parameters=GatewayParameters(port=port, read_timeout=timeout),
            java_process=self.process,
        )
        self.timeout = timeout
        self.lock = threading.Lock()
        self.envs = 0  # envs holding a simulator object in this JVM (the pool's count)
        self.killed = False

    @property
    def alive(self) -> bool:
        return not self.killed and self.process.poll() is None

    def call(self, fn: Callable):
        with self.lock:
            if not self.alive:
                raise SimulatorError(f"the ScienceWorld JVM (pid {self.process.pid}) is dead{self._last_words()}; "
                                     "the next reset starts a new one")
            try:
                return fn()
            except Py4JJavaError as error:  # the simulator raised; its JVM is fine
                raise SimulatorError(f"ScienceWorld raised {error.java_exception}") from None
            except Py4JError as error:  # no answer: the JVM died or hung past the timeout
                try:  # a JVM that died closes its sockets a moment before it can be reaped
                    self.process.wait(timeout=1)
                    hung = False
                except subprocess.TimeoutExpired:
                    hung = True
                self.kill()
                why = f"gave no answer within {self.timeout:g} s and was killed" if hung else "died"
                raise SimulatorError(f"the ScienceWorld JVM (pid {self.process.pid}) {why}{self._last_words()}; "
                                     f"the next reset starts a new one ({type(error).__name__})") from None

    def new_simulator(self):
        return self.call(lambda: self.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface())

    def _last_words(self) -> str:
        lines = [line.strip() for line in self.output if line.strip()]
        return f" (its last output: {lines[0]!r})" if lines else ""

    def kill(self) -> None:
        self.killed = True
        # Without this, py4j's finalizers of this JVM's objects would try to reconnect to it, and log
        # the failure from inside the garbage collector.
        self.gateway._gateway_client.is_connected = False
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.gateway.close(keep_callback_server=True)  # (there is none; False only warns)


class Pool:
    """JVMs holding at most `pool_size` envs each; a new JVM starts when all are full, and dead
    ones are dropped. Idle JVMs stay up (warm) for the next env that needs one."""

    def __init__(self, pool_size: int, heap: str, timeout: float):
        self.pool_size, self.heap, self.timeout = pool_size, heap, timeout
        self.jvms: list[JVM] = []
        self.lock = threading.Lock()

    def acquire(self) -> tuple[JVM, object]:
        with self.lock:
            for jvm in [j for j in self.jvms if not j.alive]:
                jvm.kill()
                self.jvms.remove(jvm)
            free = [j for j in self.jvms if j.envs < self.pool_size]
            jvm = min(free, key=lambda j: j.envs) if free else None
            if jvm is None:
                jvm = JVM(self.heap, self.timeout)
                self.jvms.append(jvm)
            jvm.envs += 1
        try:
            return jvm, jvm.new_simulator()
        except BaseException:
            self.release(jvm, None)
            raise

    def release(self, jvm: JVM, simulator) -> None:
        with self.lock:
            jvm.envs -= 1
        if simulator is not None and jvm.alive:
            try:  # let the JVM collect this env's world
                jvm.call(lambda: jvm.gateway.detach(simulator))
            except SimulatorError:
                pass

    def close(self) -> None:
        with self.lock:
            for jvm in self.jvms:
                jvm.kill()
            self.jvms.clear()


_POOLS: dict[tuple, Pool] = {}
_POOLS_LOCK = threading.Lock()


def pool(pool_size: int, heap: str, timeout: float) -> Pool:
    """The process-wide pool for these JVM settings (envs made with the same settings share it)."""
    with _POOLS_LOCK:
        key = (pool_size, heap, timeout)
        if key not in _POOLS:
            _POOLS[key] = Pool(*key)
        return _POOLS[key]


@atexit.register
def shutdown() -> None:
    """Kill every simulator JVM of this process (also runs at interpreter exit)."""
    with _POOLS_LOCK:
        for p in _POOLS.values():
            p.close()


# ----------------------------------------------------------------------------------------------
# The environment


class SciWorld(Env):
    name = "sciworld"
    instruction = INSTRUCTION
    ack = ACK

    def __init__(self, reward: str, pool_size: int, heap: str, timeout: float, step_limit: int):
        self.options = {"reward": reward, "pool_size": pool_size, "heap": heap, "timeout": timeout,
                        "step_limit": step_limit}  # every setting in effect, for a run's config
        self.pool = pool(pool_size, heap, timeout)
        self.reward_mode, self.step_limit = reward, step_limit
        self.jvm: JVM | None = None
        self.simulator = None  # this env's PythonInterface inside self.jvm
        self.task_id = None  # None until a reset succeeds
        self.key: str | None = None  # state_key(), read from the simulator at the end of each call that moves it

    def call(self, fn: Callable):
        """fn(this env's simulator), run under its JVM's lock (for what the methods below do not offer)."""
        return self.jvm.call(lambda: fn(self.simulator))

    def reset(self, task_id: int) -> str:
        task, variation = task_and_variation(int(task_id))
        self.task_id, self.key = None, None
        if self.jvm is not None and not self.jvm.alive:
            self.close()
        if self.jvm is None:
            self.jvm, self.simulator = self.pool.acquire()

        def load(sim):
            sim.load(task, variation, "", False)
            return sim.getTaskDescription(), sim.step("look around"), _seen(sim)

        description, look, seen = self.call(load)
        self.task_id, self.task, self.variation = int(task_id), task, variation
        self.score, self.done, self.steps, self.info = 0, False, 0, {}
        self.key = canonical_key(canonical_state(*seen, self.score))
        return f"{description}\n{look}"

    def state_key(self) -> str | None:
        """The digest of canonical_state() as the last reset or step left the simulator; None after a failed one."""
        return self.key

    def reward(self) -> float:
        if self.reward_mode == "normalized":
            return max(self.score, 0) / 100
        return float(self.score)

    def step(self, text: str) -> StepResult:
        return self.act(parse_action(text))

    def act(self, action: str) -> StepResult:
        """Upstream's server step: `action` (already parsed by the client) goes to the simulator as it is."""
        if self.task_id is None:
            raise RuntimeError("call reset(task_id) before step()")
        if self.done:
            return StepResult("The task is already finished.", self.reward(), True, {**self.info, "action": None})
        # py4j writes UTF-8: a lone surrogate (a JSON client can send "\ud800") would break the socket
        # and with it the JVM and every env on it. The simulator gets "?" in its place.
        action = action.encode("utf-8", "replace").decode("utf-8")

        def send(sim):
            return sim.step(action), sim.getScore(), sim.getCompleted(), sim.getNumMoves(), _seen(sim)

        self.key = None
        observation, score, completed, moves, seen = self.call(send)
        self.steps += 1
        self.score = int(round(100 * score))
        self.key = canonical_key(canonical_state(*seen, self.score))
        failed = self.score < 0
        self.done = bool(completed) or failed or moves > self.step_limit
        self.info = {"action": action, "score": self.score, "moves": moves, "valid": observation != NO_MATCH,
                     "success": bool(completed) and not failed, "failed": failed}
        return StepResult(observation, self.reward(), self.done, self.info)

    def valid_actions(self) -> list[str]:
        """The simulator's valid action-object combinations here (thousands; tens of ms)."""
        return self.call(lambda sim: list(sim.getValidActionObjectCombinations()))

    def gold_actions(self) -> list[str]:
        """Reload the current task with the simulator's gold path, look around, and return it."""
        def load(sim):
            sim.load(self.task, self.variation, "", True)
            sim.step("look around")
            return list(sim.getGoldActionSequence()), _seen(sim)

        self.key = None
        gold, seen = self.call(load)
        self.score, self.done, self.steps, self.info = 0, False, 0, {}
        self.key = canonical_key(canonical_state(*seen, self.score))
        return gold

    def fork(self) -> Env:
        """Refused (Env.fork): the simulator's state lives in a JVM, which offers no way to copy one."""
        raise NotImplementedError("a sciworld env cannot copy its state: its simulator runs in a JVM, which offers no "
                                  "copy of a loaded task")

    def close(self) -> None:
        if self.jvm is not None:
            self.pool.release(self.jvm, self.simulator)
        self.jvm = self.simulator = self.task_id = self.key = None


def score_max(reward: str = "score", **_) -> float:
    """An episode's best score under make's `reward` (envs.score_max)."""
    return 100.0 if reward == "score" else 1.0


def make(reward: str = "score", pool_size: int = 16, heap: str | None = None, timeout: float = 60.0,
         step_limit: int = 100) -> SciWorld:
    """reward: "score" (upstream: progress 0-100, -100 on failure) or "normalized" (score / 100,
    failure 0). pool_size: envs per JVM. heap: the JVM's -Xmx, by default 320 MiB + 16 MiB per env
    (a loaded task keeps about 10 MiB alive; generating a gold path, which only the oracle does,
    takes up to about 250 MiB for a moment). timeout: seconds a simulator call may take before its
    JVM counts as hung. step_limit: moves after which an episode ends (upstream's envStepLimit)."""
    if reward not in REWARDS:
        raise ValueError(f"sciworld reward must be one of {REWARDS}, got {reward!r}")
    pool_size = int(pool_size)
    heap = str(heap) if heap else f"{320 + 16 * pool_size}m"
    if not re.fullmatch(r"[0-9]+[kmgKMG]?", heap):
        raise ValueError(f"sciworld heap is a Java -Xmx size such as 512m or 2g, got {heap!r}")
    return SciWorld(reward, pool_size, heap, float(timeout), int(step_limit))


def oracle(env: SciWorld) -> Callable[[str], str]:
    """The simulator's gold action sequence for the current task, one action per turn. Call it
    right after env.reset: it reloads the task to get the gold path."""
    if env.steps:
        raise RuntimeError("call oracle(env) right after env.reset(task_id), before any step")
    plan = iter(env.gold_actions())

    def act(observation: str) -> str:
        action = next(plan, None)
        if action is None:
            raise RuntimeError(f"the gold path of {env.task} variation {env.variation} is used up")
        return f"Thought:\nThe next step towards the goal is: {action}.\n\nAction:\n{action}"

    return act
