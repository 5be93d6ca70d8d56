"""Environments in a standard shape, played as our envs: `--env PREFIX:TARGET` in train.py and eval.py.

    --env gym:mypkg.games:Guess                   a Gymnasium env: a module:callable that returns one
    --env gym:CartPoleText-v0                     ... or an id registered with Gymnasium (gymnasium.make)
    --env openenv:mypkg.server:CounterEnvironment an OpenEnv Environment subclass, in process
    --env openenv:http://127.0.0.1:8000           an OpenEnv server, through OpenEnv's WebSocket client
    --env verifiers:my-taskset                    a verifiers (0.4, `verifiers.v1`) taskset, by the id vf loads it by

A spec is one env name like `babyai`: in a mix (`--env babyai gym:mypkg.games:Guess`), in task files
(`{"item_id": "gym:mypkg.games:Guess_12"}`: the id after the last underscore), in scoped options (`--env-options
gym:mypkg.games:Guess.size 8`: the key after the last dot) and in `--env-timeout` and `--env-url` (`SPEC=...`).
module(spec) gives the rest of the code what an env module gives (make, category, oracle, INSTRUCTION, ACK,
default splits), so envs.make, envs.splits and the rollout need nothing else; registration(spec) its ENVS line.

What every standard lacks, filled here by a stated default (each adapter says what it fills in its own way):
    task ids     the seed of reset for Gymnasium and OpenEnv; a row of the taskset for verifiers (envs/standards/
                 verifiers.py), so that a group (n episodes of one task id) and a resumed run replay exact episodes
    splits       train: ids 0-999, test: ids 1000000-1000099, disjoint (verifiers: its rows, 1000-1099 for an endless
                 taskset: see there); task files (--train-tasks, --test-tasks) choose others
    instruction  the standard env's own description where it has one, else GENERIC; followed by REPLY_GUIDE.
                 --env-options instruction TEXT replaces both, ack TEXT the ack (ACK)
    action       the reply's text after its one `Action:` (stripped, several lines kept: JSON, code), or the whole
                 reply where it has none (action_of); a reply with two `Action:` is answered envs.REACT_ONLY_ONE and
                 the env is not stepped, as AgentGym does. --env-options whole_reply True sends the reply as it is,
                 for an env that reads its action out of the reply itself (ours, served by openenv_server.py or
                 verifiers_env.py: stripped of its `Action:`, a reply is no action to them)
    reward       each StepResult's reward is the episode's return so far (the sum of the standard's step rewards),
                 since our trajectory's outcome is its last step's reward; success: a done episode with return > 0
    call_timeout 60 s a reset or step (--env-timeout SPEC=SECONDS changes it, an OpenEnv client's wait too); eval's
                 agentgym protocol: 30 turns of 512 tokens (UPSTREAM)
    expert       none: the object has no oracle, so envs.oracle raises LookupError with one sentence and scripts
                 that need one (scripts/make_expert_data.py) stop on envs.has_oracle
    state_key    None (no standard says when two states are equal, so GiGPO's step term is 0 on them)
    category     one for every task: the target's last name (Guess, CounterEnvironment, my-taskset, the host)
    tools        an OpenEnv MCP environment's tools (envs/standards/openenv.py) and a verifiers taskset's toolsets'
                 (envs/standards/verifiers.py): each call one JSON line, `Action: ` before it (tool_calls.py), which the
                 instruction shows a react agent; Gymnasium envs declare none, so --agent tools refuses them
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

STANDARDS = {"gym": "envs.standards.gym", "openenv": "envs.standards.openenv", "verifiers": "envs.standards.verifiers"}
PACKAGES = {"gym": "gymnasium", "openenv": "openenv-core", "verifiers": "verifiers"}  # what pip installs each from

CALL_TIMEOUT = 60.0
UPSTREAM = {"upstream_horizon": 30, "upstream_max_new_tokens": 512}
TRAIN_IDS = list(range(1000))
TEST_IDS = list(range(1_000_000, 1_000_100))

GENERIC = "You are an agent in an environment. Each turn you read what the environment says and act on it."
REPLY_GUIDE = ("Reply with your reasoning, then the action to take, in this format:\n"
               "Thought: I think ...\nAction: the action")
ACK = "OK. I'll follow your instructions and try my best to solve the task."


def is_spec(name: str) -> bool:
    """Whether `name` is a spec of a standard env (PREFIX:TARGET with a known prefix and a target); nothing imported."""
    prefix, colon, target = str(name).partition(":")
    return bool(colon and target) and prefix in STANDARDS


def action_of(text: str, whole_reply: bool = False) -> str | None:
    """The action a reply sends to a standard env: what follows its one `Action:` (stripped; the rest of the reply,
    so an action may span lines), the whole reply stripped where it has no `Action:`, None where it has several.
    `whole_reply`: the reply as it is (the env parses it)."""
    if whole_reply:
        return text
    parts = re.split(r"Action:", text)
    if len(parts) > 2:
        return None
    return (parts[1] if len(parts) == 2 else text).strip()


def instruction(description: str | None, options: dict, reply_guide: str = REPLY_GUIDE) -> str:
    """The first user turn: --env-options instruction where given, else the env's description (or GENERIC) and how
    to reply (an env with tools: which tools there are and how a reply calls one, envs/standards/tool_calls.guide)."""
    return options.get("instruction") or f"{(description or GENERIC).strip()}\n\n{reply_guide}"


@dataclass(frozen=True)
class Standard:
    """What an env module gives, for one spec: make(**options) builds the adapter's env on the target."""

    name: str  # the spec, as --env gives it
    prefix: str
    target: str
    adapter: object  # envs/standards/<prefix>.py

    INSTRUCTION = instruction(None, {})  # (a remote env's; an instance's own is its env's description)
    ACK = ACK

    REPLY = "Action: {action}"  # (envs/tools.py: how a reply carries a tool call's action, where there are TOOLS)

    @property
    def TOOLS(self):
        """The adapter's tools for the target (envs/tools.py); none (AttributeError, so hasattr is False) where it
        has none."""
        try:
            tools = self.adapter.tools(self.target) if hasattr(self.adapter, "tools") else None
        except AttributeError as error:  # (not to be read as "no tools" by hasattr)
            raise RuntimeError(f"{self.name}: listing its tools failed: {error}") from error
        if tools is None:
            raise AttributeError(f"{self.name} declares no tools")
        return tools

    @property
    def takes_timeout(self) -> bool:
        """Whether the adapter's make takes `timeout`, the seconds its own client waits for a call (OpenEnv's), which
        the guard then gives it (--env-timeout)."""
        return "timeout" in inspect.signature(self.adapter.make).parameters

    def read_action(self, text: str) -> str | None:
        return action_of(text)

    def make(self, url: str | None = None, **options):
        return self.adapter.make(self.name, self.target, url=url, **options)

    def category(self, task_id: int) -> str:
        if "://" in self.target:
            return urlsplit(self.target).netloc
        return re.split(r"[.:/]", self.target)[-1] or self.target

    def default_splits(self) -> dict[str, list[int]]:
        if hasattr(self.adapter, "default_splits"):  # (verifiers: a taskset's rows)
            return self.adapter.default_splits(self.target)
        return {"train": TRAIN_IDS, "test": TEST_IDS}


class MissingPackage(LookupError):
    """A spec whose standard's package is not installed; the message says what to install, in one sentence."""


@functools.cache
def module(name: str) -> Standard:
    """The module-like object of spec `name`; MissingPackage where its standard's package is not installed."""
    prefix, _, target = name.partition(":")
    try:
        adapter = importlib.import_module(STANDARDS[prefix])
    except ImportError as error:
        raise MissingPackage(f"--env {name} needs {PACKAGES[prefix]}, which is not installed here ({error}): "
                             "pip install -r requirements-standards.txt") from None
    return Standard(name, prefix, target, adapter)


def check(name: str) -> None:
    """Stop early, with one sentence, on a spec whose package is missing or whose target cannot be found (an
    OpenEnv server is reached only when an env is made: the guard says it when it cannot be)."""
    try:
        standard = module(name)
        standard.adapter.check(standard.target)
    except MissingPackage as error:
        raise SystemExit(str(error)) from None
    except (ImportError, AttributeError, ValueError, TypeError) as error:
        raise SystemExit(f"--env {name}: {error}") from None
