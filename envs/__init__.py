"""In-process ports of the AgentGym environments, behind one small interface.

    env = envs.make("babyai")
    first_observation = env.reset(task_id)          # task ids map to tasks as in AgentGym
    result = env.step(model_text)                   # raw model text in, StepResult out
    key = env.state_key()                           # the state the next action acts on (GiGPO), or None
    env.close()

    env = envs.make("babyai", url="http://127.0.0.1:36001")   # the same, on an AgentGym env server

`python -m envs.serve --env babyai --port 36001` serves any of them over AgentGym's HTTP protocol
(envs/serve.py); envs/remote.py is the client that make() returns for a url.

An environment never raises on bad model output: a malformed action is an observation that
says what was wrong, as upstream does. It may raise for infrastructure failures (a dead JVM or
browser); the rollout then ends that one trajectory and records the error.

An environment is one module `envs/<name>.py` (or package `envs/<name>/`) and one line in ENVS below,
which says where the module is and what callers need before they make an env: how long its calls may take
and the limits of upstream's evaluation (eval.py's `agentgym` protocol). The module defines

    make(**options) -> Env                   one instance; many may live in one process
    category(task_id) -> str                 the eval category of a task id
    oracle(env) -> Callable[[str], str]      a scripted expert for the env's current task:
                                             observation in, full response text out
    INSTRUCTION, ACK                         its Env's instruction and ack (a remote env reads them here)
    TOOLS, REPLY, read_action(text)          optional: its actions as native tools, how a reply carries one
                                             action, and the action a reply sends (envs/tools.py); an env
                                             without them cannot be played with --agent tools
    Env.state_key() -> str | None            optional: a short string equal exactly when two episodes of the same
                                             task are in the same env state (Env.state_key below); GiGPO's step-level
                                             anchor groups are the turns that start from one key. An env without it
                                             (None) leaves every turn alone in its group: GiGPO's step term is 0
    Env.fork() -> Env                        optional: an independent copy of the env's state (Env.fork below);
                                             an env without it cannot play train.py --group-start fork

and ships default splits as `envs/data/<name>_{train,test}.json` in AgentGym-RL-Data-ID's
format: `[{"item_id": "<name>_<int>"}, ...]` (a module may point elsewhere with
`default_split_files() -> (train_path, test_path)`). Modules are imported lazily, so one env's
optional dependencies never break another. train.py, eval.py, envs/serve.py and envs/remote.py need
nothing else (docs/environments.md: "Add an environment"; tests/test_add_env.py follows the recipe).

An env in a standard shape needs neither: a spec `gym:...`, `openenv:...` or `verifiers:...` is an env name too
(envs/standards: an adapter per standard gives what a module gives, with stated defaults for what the standard
lacks). known(name) says whether a name is an env, check_env(name) stops a script on one it cannot play.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from envs import standards

DATA_DIR = Path(__file__).parent / "data"


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class Env:
    """What rollout.py relies on. `instruction` is the fixed first user turn and `ack` the canned
    assistant reply, both verbatim from AgentGym; `reward` in a StepResult is the value to optimise
    (upstream's client-side reward), and the trajectory's outcome is the last step's reward."""

    name: str
    instruction: str
    ack: str

    def reset(self, task_id: int) -> str:
        raise NotImplementedError

    def step(self, text: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def state_key(self) -> str | None:
        """A short string equal exactly when two episodes of the same task are in the same env state (the state the
        next action acts on), or None when the env cannot say. The rollout calls it in the env call's thread right
        after a reset or step returned, so it is cheap and never calls into a browser, a JVM or the network: an env
        computes it from Python state it holds, caching at reset and step time what it needs. It never raises for a
        live env (one that does is read as None: state_key_of); after a failed or closed one it may be None. It holds no step count and no history: the same state reached at
        another turn, or by actions in another order, has the same key. canonical_key() keeps it short."""
        return None

    def fork(self) -> Env:
        """An independent copy of the env as it is now, between calls (train.py --group-start fork plays a group's
        episodes on copies of one after their shared turns): the copy's state, and its own random generator, are the
        original's, its state_key() equals the original's, and no call on either ever changes the other; what no
        call changes (a crafting tree, a search index) may be shared. Closing one leaves the other. An env that
        cannot copy its state (a JVM's simulator, a browser's page, an instance on an env server) raises
        NotImplementedError with one sentence that says why, without starting anything."""
        raise NotImplementedError(f"the {self.name} env cannot copy its state (it defines no Env.fork)")


def state_key_of(env: Env) -> str | None:
    """env.state_key(), or None when it raises: a key only groups turns for GiGPO (a turn without one stands alone),
    so an env whose key fails still plays, in the rollout's env threads (rollout.py) and behind envs/serve.py alike."""
    try:
        return env.state_key()
    except Exception:  # noqa: BLE001 - see above
        return None


KEY_CHARS = 100  # a canonical form longer than this is keyed by its digest


def canonical_key(canonical: str) -> str:
    """An env state's key from its canonical form (a text equal exactly when the states are): the form itself when
    it is at most KEY_CHARS characters, readable in logs ("1 oak planks|2 stick"), else its 16-hex blake2b digest."""
    if len(canonical) <= KEY_CHARS:
        return canonical
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Registration:
    """An env's line in ENVS: its module, and what callers need before they make an env."""

    module: str  # where make, category, oracle, INSTRUCTION and ACK are (imported on first use)
    call_timeout: float  # seconds a reset or step may take before the caller gives up on it
    upstream_horizon: int  # the turn cap of upstream's evaluation (max_rounds of AgentGym-RL's examples/eval)
    upstream_max_new_tokens: int = 512  # the tokens a turn of upstream's evaluation (its max_tokens)


# The envs by name. call_timeout: the rollout ends a trajectory whose call takes longer, envs/serve.py answers
# 504. Generous against measured times: BabyAI and TextCraft take milliseconds; a SciWorld reset can start a
# JVM (about 2 s) and its own simulator calls time out at 60 s; a SearchQA search is milliseconds with bm25 and
# the remote retriever waits up to 60 s; a WebArena step waits up to its own 120 s browser limit plus page
# loads, and a `stop` also runs the evaluators. The upstream limits are those of AgentGym-RL's eval scripts.
ENVS = {
    "babyai": Registration("envs.babyai", call_timeout=30.0, upstream_horizon=20),
    "textcraft": Registration("envs.textcraft", call_timeout=30.0, upstream_horizon=30),
    "sciworld": Registration("envs.sciworld", call_timeout=120.0, upstream_horizon=30, upstream_max_new_tokens=200),
    "searchqa": Registration("envs.searchqa", call_timeout=120.0, upstream_horizon=30),
    "webarena": Registration("envs.webarena", call_timeout=600.0, upstream_horizon=15),
}


def known(name: str) -> bool:
    """Whether `name` names an env: one of ENVS, or a spec of an env in a standard shape (envs/standards: gym:...,
    openenv:..., verifiers:...). Nothing is imported."""
    return name in ENVS or standards.is_spec(name)


def choices() -> str:
    """What --env takes, for a message that names an unknown env."""
    return f"{', '.join(ENVS)}, or {' '.join(f'{prefix}:...' for prefix in standards.STANDARDS)} (envs/standards)"


def check_env(name: str) -> None:
    """Stop early with one sentence on an env name a script cannot play: unknown, or a spec whose package is
    missing or whose target cannot be found."""
    if not known(name):
        raise SystemExit(f"unknown env {name!r}; choose one of: {choices()}")
    if standards.is_spec(name):
        standards.check(name)


def registration(name: str) -> Registration:
    if standards.is_spec(name):
        return Registration(name, call_timeout=standards.CALL_TIMEOUT, **standards.UPSTREAM)
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose one of: {choices()}")
    return ENVS[name]


def _module(name: str):
    """The env's module, or a spec's module-like object (envs/standards.module)."""
    if standards.is_spec(name):
        return standards.module(name)
    return importlib.import_module(registration(name).module)


def score_max(name: str, options: dict | None = None) -> float:
    """The best score an episode of env `name` gets under its make `options`: 1, but where the env's module says
    otherwise (SciWorld's upstream progress scores: 100). What a macro average over envs divides Avg@k by."""
    module = _module(name)
    return float(module.score_max(**(options or {}))) if hasattr(module, "score_max") else 1.0


def make(name: str, url: str | None = None, **options) -> Env:
    """One env instance: in process, or with `url` a remote one on an AgentGym env server (ours,
    envs/serve.py, or upstream's), behind the same interface (envs/remote.py). A spec's env takes `url` itself
    (an OpenEnv server's; envs/standards)."""
    if standards.is_spec(name):
        return standards.module(name).make(url=url, **options)
    if url is not None:
        from envs.remote import RemoteEnv

        return RemoteEnv(name, url, **options)
    return _module(name).make(**options)


def call_timeout(name: str) -> float:
    """Seconds a reset or step of env `name` may take by default (its registration's call_timeout)."""
    return registration(name).call_timeout


def parse_options(options: dict[str, str], words: bool = False) -> dict:
    """Command-line option strings (--env-options, --chat-template-kwargs: KEY VALUE ...) to Python values where
    they parse as literals (numbers, True/False/None, lists); anything else, and a value that is not a string,
    stays as it is. `words` (--chat-template-kwargs): true, false, none and null in any case are True, False and
    None too, as a template's variables (enable_thinking) mean them; an env's options keep them as strings, which
    an env may read as its own words (WebArena's `map_services none`)."""
    named = {"true": True, "false": False, "none": None, "null": None}
    out = {}
    for key, value in options.items():
        if not isinstance(value, str):
            out[key] = value
        elif words and value.strip().lower() in named:
            out[key] = named[value.strip().lower()]
        else:
            try:
                out[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                out[key] = value
    return out


def scope_of(key: str) -> tuple[str | None, str]:
    """An --env-options key's env and own key: ENV.KEY (sciworld.simplification) is env ENV's, split on the last dot
    so that a spec's dots stay its own (gym:mypkg.games:Guess.size); a plain KEY is every env's (None)."""
    scope, dot, own = key.rpartition(".")
    return (scope, own) if dot and known(scope) else (None, key)


def own_options(options: dict, name: str) -> dict:
    """The --env-options of env `name`: plain KEY VALUE entries are every env's, ENV.KEY VALUE entries
    (sciworld.simplification easy) only env ENV's (a run of several envs), over a plain entry of the same KEY."""
    scoped = {scope_of(key)[1]: value for key, value in options.items() if scope_of(key)[0] == name}
    return {key: value for key, value in options.items() if scope_of(key)[0] is None} | scoped


def category(name: str, task_id: int) -> str:
    return _module(name).category(task_id)


def has_oracle(name: str) -> bool:
    """Whether env `name` has a scripted expert (an env in a standard shape has none: envs/standards)."""
    return hasattr(_module(name), "oracle")


def oracle(env: Env) -> Callable[[str], str]:
    """The env's scripted expert; LookupError with one sentence for an env without one (has_oracle)."""
    if not has_oracle(env.name):
        raise LookupError(f"the {env.name} env has no scripted expert (an env in a standard shape has none), so "
                          "nothing can play it as an oracle: collect its episodes with a model instead")
    return _module(env.name).oracle(env)


def oracle_episode(env: Env, task_id: int, horizon: int = 100) -> StepResult:
    """The env's oracle plays task `task_id` through the text interface (reset, then its response to each
    observation) until done or `horizon` turns. Returns the last step's result."""
    result = StepResult(env.reset(task_id), 0.0, False, {})
    agent = oracle(env)
    for _ in range(horizon):
        result = env.step(agent(result.observation))
        if result.done:
            break
    return result


class TaskFileError(ValueError):
    """A task id file that is missing or malformed; the message names the file and the fault."""


def load_task_ids(path: str | Path, name: str) -> list[int]:
    """Task ids from an AgentGym-RL-Data-ID file (`[{"item_id": "babyai_12"}, ...]`).
    As upstream, the id is the integer after the last underscore. A file that is missing, not JSON,
    not a list or holds another env's tasks raises TaskFileError."""
    return load_tasks(path, (name,))[name]


def task_files(path: str | Path) -> list[str]:
    """The files of a task-id path: itself where it is one (a name with a `:` too), else those joined by os.pathsep."""
    return [str(path)] if Path(path).is_file() else [one for one in str(path).split(os.pathsep) if one] or [str(path)]


def load_tasks(path: str | Path, names: Sequence[str]) -> dict[str, list[int]]:
    """The task ids of an AgentGym-RL-Data-ID file by env, for a run on the envs `names`: each item's env is its
    prefix (`babyai_12`), an item without one (`12`) the run's env where it has one. The envs that the file names
    none of get no entry; a file that is missing, not JSON or not a list, or holds an item of another env or without
    an env where the run has several, raises TaskFileError. Several files joined by os.pathsep
    (`mine.json:theirs.json`) give each env the tasks of the first that names it (so a preset's task file keeps the
    envs a given one leaves out)."""
    if len(files := task_files(path)) > 1:
        tasks = {}
        for one in files:
            for name, ids in load_tasks(one, names).items():
                if ids and name not in tasks:
                    tasks[name] = ids
        return {names[0]: tasks.get(names[0], [])} if len(names) == 1 else tasks
    path = Path(files[0])
    if not path.is_file():
        raise TaskFileError(f"task id file {path} does not exist")
    try:
        rows = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TaskFileError(f"task id file {path} is not JSON ({error})") from None
    if not isinstance(rows, list):
        raise TaskFileError(f"task id file {path} holds a JSON {type(rows).__name__}, not a list of task ids "
                            f'([{{"item_id": "{names[0]}_12"}}, ...])')
    tasks: dict[str, list[int]] = {}
    for row in rows:
        if isinstance(row, dict) and "item_id" not in row:
            raise TaskFileError(f"task id file {path}: entry {sum(map(len, tasks.values()))} has no item_id")
        item = row["item_id"] if isinstance(row, dict) else row
        prefix, _, number = str(item).rpartition("_")
        if prefix and prefix not in names:
            raise TaskFileError(f"task id file {path}: item {item!r} is not a {' or '.join(names)} task")
        if not prefix and len(names) > 1:
            raise TaskFileError(f"task id file {path}: item {item!r} names no env, and the run has several "
                                f"({', '.join(names)}): write it {names[0]}_{item}")
        try:
            tasks.setdefault(prefix or names[0], []).append(int(number))
        except ValueError:
            raise TaskFileError(f"task id file {path}: item {item!r} is not a task id ({names[0]}_<number>)") from None
    if len(names) == 1:
        tasks.setdefault(names[0], [])
    return tasks


def save_task_ids(path: str | Path, name: str, ids: list[int]) -> None:
    rows = ",\n".join(json.dumps({"item_id": f"{name}_{i}"}) for i in ids)
    Path(path).write_text(f"[\n{rows}\n]\n")


def splits(name: str, train: str | Path | None = None, test: str | Path | None = None) -> dict[str, list[int]]:
    """Train/test task ids: the files given, else the env's defaults (envs/data/<name>_{train,test}.json
    unless the module's `default_split_files()` says otherwise, as WebArena's does for the real sites, or its
    `default_splits()` gives the ids themselves, as a standard env's seeds: envs/standards)."""
    module = _module(name)
    if hasattr(module, "default_splits"):
        ids = module.default_splits()
        return {"train": load_task_ids(train, name) if train else ids["train"],
                "test": load_task_ids(test, name) if test else ids["test"]}
    default = getattr(module, "default_split_files", lambda: (DATA_DIR / f"{name}_train.json", DATA_DIR / f"{name}_test.json"))()
    return {"train": load_task_ids(train or default[0], name), "test": load_task_ids(test or default[1], name)}


REACT_ONLY_ONE = "Error: Only one 'Action' is allowed per response. Please adjust your response."


def react_action(text: str) -> str | None:
    """AgentGym's client-side parsing for TextCraft and BabyAI: the single `Action:` line, cleaned
    to letters, digits, commas and single spaces. None when there is more than one `Action:`
    (the caller answers REACT_ONLY_ONE without touching the game); "" when there is none."""
    matches = re.findall(r"Action:\s*(.*?)(?=\n|$)", text, re.DOTALL)
    if len(matches) > 1:
        return None
    action = matches[-1] if matches else ""
    action = re.sub(r"[^A-Za-z0-9, ]+", "", action)
    return " ".join(action.split())
