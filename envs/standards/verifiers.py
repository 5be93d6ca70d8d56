"""A verifiers (0.4, `verifiers.v1`) environment as one of our envs: `--env verifiers:TASKSET`.

TASKSET is the id verifiers loads a taskset by (an installed package exporting its Taskset subclass, `my-taskset` or
`owner/my-taskset`); the env is what vf.load_environment makes of it: the taskset's own Env subclass where its package
exports one (a game that answers each reply, as TextArena's), else vf's SingleAgentEnv (one reply, then scored).
--env-options are the taskset config's fields, but `env` (a verifiers env id to play the taskset in, e.g.
single_agent), `instruction`, `ack` and `whole_reply` (envs/standards); a taskset field of one of those names goes in
`taskset`, a dict of fields (agentgym-rl's own `env`: `--env-options taskset "{'env': 'textcraft'}"`).

verifiers runs an episode itself, asking a model for each reply through its harness; here the adapter is that model.
The Env's run(task, agents) plays in an event loop of the adapter's own, on seats (agents) whose interaction(task).turn
hands each user message out as our observation and waits for our next reply, which it returns as the agent's segment:

    reset(task_id)  starts run() on the task's row; the observation is the first thing said to the agent: the task's
                    prompt (after its system prompt where that is not the instruction's), or the Env's first message
    step(text)      sends the reply's action (envs/standards.action_of; whole_reply True: the reply, for a taskset whose
                    env parses replies, as agentgym-rl's) as the assistant message; the observation is
                    the Env's next message (reward 0), or, when run() ends, END and the reward: the task scored by its
                    rubric (its @vf.reward functions and judges, Task.score) over the episode's messages, plus what
                    run() recorded on the trace (a game's reward), each weighted, summed as verifiers sums them

The task id is the row's position in the taskset's load() order (its `idx`). Default splits (a taskset has no
train/test of its own): the last tenth of a finite taskset's rows (at least one) is the test split, the rest train;
an infinite one (INFINITE, as seeded games) or one that cannot load without options: train rows 0-999, test rows
1000-1099 (ENDLESS_TEST: not a seed's 1000000 on, since an env reaches row k by reading the k rows before it). The
instruction is the first row's system prompt, else the generic one (envs/standards).

Not covered, and refused with one sentence: an Env with more than one seat (user-sim, a judge agent), tasks with tool
servers (Task.toolsets and Taskset.toolsets are MCP servers a harness would launch). Not run: the Env's finalize (it
judges a whole vf Episode across seats) and the rewards that need a runtime (a sandbox; Task.score skips them).
A taskset that needs the network (a dataset from the Hub, nltk data) or a package not installed fails to load: the
guard stops the run with its error in one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import itertools
import math
import queue
import threading

import verifiers.v1 as vf
from verifiers.v1.agent import Segment
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.dialects.chat import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import content_text

from envs import REACT_ONLY_ONE, Env, StepResult
from envs import standards

END = "The episode is over."
TEST_SHARE = 10  # the last 1/TEST_SHARE of a finite taskset's rows is its default test split
ENDLESS_TEST = list(range(1000, 1100))  # an infinite taskset's default test rows: the hundred after the train rows


def check(target: str) -> None:
    """Raise where `target` names no taskset verifiers can import."""
    registered(target)
    vf.import_taskset(target)


def registered(target: str) -> None:
    """Register our own taskset (envs/standards/verifiers_env.py) where `target` is its id, agentgym-rl, which
    verifiers resolves only in a process that has imported that module."""
    if target.replace("_", "-") == "agentgym-rl":
        importlib.import_module("envs.standards.verifiers_env")


def load(target: str, env: str | None = None, fields: dict | None = None):
    """vf.load_environment on the taskset `target` with its config's `fields`, in the env `env` (None: its own)."""
    registered(target)
    return vf.load_environment(vf.resolve_env_config({"id": env or "", "taskset": {"id": target, **(fields or {})}}))


def default_splits(target: str) -> dict[str, list[int]]:
    """The rows of the taskset's default train and test splits (the module docstring says which)."""
    try:
        taskset = load(target).taskset
        rows = None if taskset.INFINITE else sum(1 for _ in taskset)
    except Exception:  # noqa: BLE001 - a taskset that needs options (or the network) to load: as an endless one
        rows = None
    if rows is None:
        return {"train": standards.TRAIN_IDS, "test": ENDLESS_TEST}
    test = max(1, rows // TEST_SHARE)
    return {"train": list(range(rows - test)), "test": list(range(rows - test, rows))}


def make(name: str, target: str, url: str | None = None, instruction: str | None = None, ack: str = standards.ACK,
         env: str | None = None, whole_reply: bool = False, taskset: dict | None = None, **options) -> VerifiersEnv:
    if url is not None:
        raise ValueError(f"{name} runs in this process (a verifiers taskset); --env-url is for OpenEnv servers")
    environment = load(target, env, options | (taskset or {}))
    seats = list(agent_config_fields(environment.config))
    if len(seats) != 1:
        raise ValueError(f"the verifiers env {type(environment).__name__} has {len(seats)} seats ({', '.join(seats)}); "
                         "only an env of one seat (the agent trained here) is played")
    if environment.taskset.toolsets(environment.taskset.config) or environment._task_cls.toolsets(
            environment.taskset.config.task):
        raise ValueError(f"the taskset {target} gives its tasks tool servers (toolsets), which are not offered here")
    return VerifiersEnv(name, environment, {"instruction": instruction} if instruction else {}, ack, whole_reply)


class VerifiersEnv(Env):
    def __init__(self, name: str, environment, options: dict, ack: str, whole_reply: bool = False):
        self.name, self.environment, self.ack, self.whole_reply = name, environment, ack, whole_reply
        self.rows, self.unread = [], iter(environment.taskset)  # the taskset's tasks, read as far as needed
        first = self._task(0).data.system_prompt
        self.system_prompt = None if options else first  # (what the instruction says: a row's own that differs is
        self.instruction = standards.instruction(first, options)  # said before its prompt)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="verifiers-env").start()
        self.episode = None  # (concurrent future of the episode's coroutine, what it says, where replies go)

    def _task(self, task_id: int):
        if task_id < 0:
            raise IndexError(f"task id {task_id} is not a row of the taskset")
        self.rows += itertools.islice(self.unread, max(0, task_id + 1 - len(self.rows)))
        if task_id >= len(self.rows):
            raise IndexError(f"task id {task_id} is not a row of the taskset ({len(self.rows)} rows)")
        return self.rows[task_id]

    def reset(self, task_id: int) -> str:
        self._stop()
        said, replies = queue.Queue(), asyncio.Queue()
        future = asyncio.run_coroutine_threadsafe(self._play(self._task(int(task_id)), said, replies), self.loop)
        self.episode = (future, said, replies)
        kind, value = said.get()
        if kind != "observe":
            raise RuntimeError(value if kind == "error" else "the episode ended before the agent's first turn")
        return value

    def step(self, text: str) -> StepResult:
        action = standards.action_of(text, self.whole_reply)
        if action is None:
            return StepResult(REACT_ONLY_ONE, 0.0, False, {"valid": False})
        if self.episode is None:
            raise RuntimeError("no episode is under way: reset the env first")
        _, said, replies = self.episode
        self.loop.call_soon_threadsafe(replies.put_nowait, action)
        kind, value = said.get()
        if kind != "observe":
            self.episode = None  # (over: its coroutine has returned)
        if kind == "error":
            raise RuntimeError(value)
        return StepResult(value, 0.0, False, {}) if kind == "observe" else StepResult(END, value, True, {})

    def _stop(self) -> None:
        if self.episode is not None:
            self.episode[0].cancel()
            self.episode = None

    def close(self) -> None:
        # (the episode's task is cancelled, then run to its end before the loop stops: a task left pending is said
        # on stderr, "Task was destroyed but it is pending!", when the loop is collected)
        self._stop()
        settling = asyncio.run_coroutine_threadsafe(settled(), self.loop)
        concurrent.futures.wait([settling], timeout=standards.CALL_TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)

    # ------------------------------------------------------------------------------------------
    # The episode, in the adapter's loop

    async def _play(self, task, said: queue.Queue, replies: asyncio.Queue) -> None:
        """run() on the task with our seat, then the scored trace's reward; what happens is put on `said`."""
        seat = Seat(self, said, replies)
        try:
            await self.environment.setup(Seats(seat))
            await self.environment.run(task, Seats(seat))
            if seat.trace is None:
                raise RuntimeError("the env's run() never asked the agent")
            await seat.task.score(seat.trace)
            if not math.isfinite(seat.trace.reward):  # (a NaN would skip the whole step's update, every env's)
                raise ValueError(f"{self.name} gave the reward {seat.trace.reward}, which is not a finite number")
            said.put(("done", seat.trace.reward))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the env's failure is the step's, which the rollout records
            said.put(("error", f"the verifiers env failed: {type(error).__name__}: {error}"))


async def settled() -> None:
    """Wait for the loop's other tasks (a cancelled episode's) to end."""
    await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}), return_exceptions=True)


class Seats:
    """What an Env's run() reads its agents from: every seat name is the one agent (make allows one)."""

    def __init__(self, seat: Seat):
        self.seat = seat

    def __getattr__(self, name: str) -> Seat:
        return self.seat


class Seat:
    """The agent's seat: its interactions hand the Env's messages out and our replies in."""

    trainable = True

    def __init__(self, env: VerifiersEnv, said: queue.Queue, replies: asyncio.Queue):
        self.env, self.said, self.replies = env, said, replies
        self.task, self.trace = None, None

    async def run(self, task, **_) -> None:
        """A single-agent episode: the task's prompt, one reply."""
        async with self.interaction(task) as exchange:
            await exchange.turn()

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_):
        self.task = task
        self.trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                              agent=AgentInfo(config=vf.AgentConfig()))
        yield Exchange(self)


class Exchange:
    """One interaction (verifiers' Interaction, as an Env's run() uses it): turn(message) says it, returns our reply."""

    def __init__(self, seat: Seat):
        self.seat, self.started = seat, False

    @property
    def trace(self):
        return self.seat.trace

    def _add(self, message, sampled: bool = False) -> None:
        nodes = self.trace.nodes
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=message, sampled=sampled))

    async def turn(self, message=None):
        data = self.seat.task.data
        if not self.started and data.prompt is not None:
            if data.system_prompt:
                self._add(vf.SystemMessage(content=data.system_prompt))
            for one in messages_of(data.prompt):
                self._add(one)
            own = data.system_prompt if data.system_prompt and data.system_prompt != self.seat.env.system_prompt else ""
            observation = f"{own}\n\n{data.prompt_text}".strip()
        else:
            messages = messages_of(message)
            for one in messages:
                self._add(one)
            observation = "\n\n".join(content_text(one.content) for one in messages)
        self.started = True
        self.seat.said.put(("observe", observation))
        reply = vf.AssistantMessage(content=await self.seat.replies.get())
        self._add(reply, sampled=True)
        return Segment(messages=[reply])


def messages_of(said) -> list:
    """A user turn (a str, or messages typed or as wire dicts) as typed messages."""
    if isinstance(said, str):
        return [vf.UserMessage(content=said)]
    return [parse_message(one) if isinstance(one, dict) else one for one in said or []]
