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

A taskset with tools (Task.toolsets, each episode's own servers; Taskset.toolsets, shared ones) is played through them,
so `--agent tools` plays it too (envs/tools.py). verifiers launches each tool server (a vf.Toolset: an MCP server of its
@vf.tool methods) as a process of its own (`python -m <its module>`, mcp/launch.py) that its harness calls inside the
agent's turn, and syncs the server's state with the rollout's trace.state over a signed HTTP channel. Here the adapter
is the harness, in this process: it builds the servers from the taskset's config, sets each up as that process would
(setup, and setup_task(task) for a task's own; a shared one once an env, with no task), registers its tools on an MCP
server (mcp.server.mcpserver.MCPServer, as its process does) and calls them through an in-memory MCP client
(mcp.Client), each call's state read from and written back to the episode's trace.state (bind: the channel's pull and push, direct):

    tools       each tool, named as verifiers' harnesses name it (`<server>_<tool>`, or bare for TOOL_PREFIX None), as
                a Tool of ours (envs/standards/tool_calls.py: a string, integer, number or boolean parameter each; a
                tool of others is skipped for --agent tools, said on stderr), then FINAL: final_answer(answer), whose
                call is the reply without a tool call that ends the agent's turn in verifiers (the rubric reads it:
                trace.last_reply). Listed from the taskset built without --env-options (tools(target)); a react agent
                is told them and the call line in its instruction (tool_calls.guide)
    action      a call's one JSON line, {"tool": NAME, "arguments": {...}} after `Action: `, as an OpenEnv MCP env's;
                anything else, or arguments that do not fit the tool, is answered with one sentence, the episode not
                stepped (valid False)
    observation the tool result's text (its content, as a harness gives it: a failed call's error too, in MCP's words,
                `Error executing tool guess: ...`), an image in it one line (tool_calls.IMAGE: its base64 would be
                thousands of tokens to a text model), which the trace holds whole as verifiers' harness gives it;
                the task's @vf.stop hooks on the trace run before each observation,
                as verifiers runs them before each model call, and one that fires ends the episode
    reward      at the end (final_answer, or a stop), the rubric's as for any taskset: tool calls, their results and
                the state the servers wrote are on the trace it scores

Not covered, and refused with one sentence: an Env with more than one seat (user-sim, a judge agent), a tool server in
a sandbox runtime (docker, prime, ...; the default runtime is a subprocess, here this process) or at a url of its own.
Not run: the Env's finalize (it judges a whole vf Episode across seats), the rewards that need a runtime (a sandbox;
Task.score skips them), @vf.stop hooks on a model's Request or Response.
A taskset that needs the network (a dataset from the Hub, nltk data) or a package not installed fails to load: the
guard stops the run with its error in one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib
import itertools
import json
import math
import queue
import threading

import verifiers.v1 as vf
from mcp import Client
from mcp.server.mcpserver import MCPServer
from verifiers.v1.agent import Segment
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.dialects.chat import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
from verifiers.v1.session import call_hook, hook_boundary
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import ImageUrlContentPart

from envs import REACT_ONLY_ONE, Env, StepResult
from envs import standards
from envs import tools as env_tools
from envs.standards import tool_calls

END = "The episode is over."
FINAL = "final_answer"  # the tool whose call is a reply without a tool call, in a taskset with tools (its `answer`)
FINAL_TOOL = {"name": FINAL, "description": "Give your final answer, which the task is scored on; it ends your turn.",
              "input_schema": {"type": "object", "properties": {"answer": {"type": "string", "description": "your "
                               "final answer"}}, "required": ["answer"]}}
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
    per_task, shared = servers(environment)
    listing = awaited(listed_of(per_task + shared)) if per_task or shared else None
    return VerifiersEnv(name, environment, {"instruction": instruction} if instruction else {}, ack, whole_reply,
                        listing, shared)


# ----------------------------------------------------------------------------------------------
# Tool servers (toolsets), in this process


def servers(environment) -> tuple[list, list]:
    """The taskset's tool servers, as its config builds them: the per-task ones (Task.toolsets: built again for each
    episode) and the shared ones (Taskset.toolsets). A ValueError, in one sentence, for one that cannot run here."""
    taskset = environment.taskset
    per_task, shared = environment._task_cls.toolsets(taskset.config.task), taskset.toolsets(taskset.config)
    for server in per_task + shared:
        runtime = getattr(getattr(server.config, "runtime", None), "type", "subprocess")
        if getattr(server.config, "url", None):
            raise ValueError(f"the tool server {server.server_name} runs at {server.config.url}, outside verifiers (a "
                             "toolset's url), which is not offered here: a taskset's tool servers run in this process")
        if runtime != "subprocess":
            raise ValueError(f"the tool server {server.server_name} runs in a {runtime} runtime (a sandbox), which is "
                             "not offered here: a taskset's tool servers run in this process")
    return per_task, shared


def qualified(server, tool: str) -> str:
    """A server's tool as the model is given it: `<server>_<tool>`, as verifiers' harnesses name it (connect_mcp)."""
    return f"{server.server_name}_{tool}" if server.server_name else tool


def mcp_server(server) -> MCPServer:
    """An MCP server with the verifiers server's tools on it (register, as its own process serves them)."""
    mcp = MCPServer(server.server_name or type(server).__name__)
    server.register(mcp)
    return mcp


async def listed_of(servers_: list) -> list[dict]:
    """The tools of `servers_` ({"name", "description", "input_schema"} each, named as the model is given them), then
    FINAL's; a ValueError, in one sentence, where two share a name."""
    listing = [{"name": qualified(server, tool.name), "description": tool.description or "", "input_schema":
                tool.input_schema} for server in servers_ for tool in await mcp_server(server).list_tools()]
    names = [tool["name"] for tool in listing] + [FINAL]
    if len(set(names)) < len(names):
        twice = sorted({one for one in names if names.count(one) > 1})
        raise ValueError(f"the taskset's tool servers give more than one tool the name {', '.join(twice)} (the "
                         f"adapter's own {FINAL} among them): give a server a distinct TOOL_PREFIX")
    return [*listing, FINAL_TOOL]


@functools.cache
def tools(target: str) -> tuple | None:
    """The taskset's tools (built from its config without --env-options) and FINAL as ours (envs/tools.py); None for a
    taskset without tool servers. A ValueError, in one sentence, where they cannot be listed."""
    try:
        per_task, shared = servers(load(target))
        listing = awaited(listed_of(per_task + shared)) if per_task or shared else None
    except Exception as error:  # noqa: BLE001 - a taskset's load or a server's own code may raise anything
        raise ValueError(f"verifiers:{target}: its tools cannot be listed: {type(error).__name__}: {error}") from None
    return None if listing is None else tool_calls.tools_of(f"verifiers:{target}", listing)


def awaited(coroutine):
    """What `coroutine` returns, run on a loop of its own in a thread of its own (whether or not the caller's thread
    runs a loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def bind(server, trace_of) -> None:
    """Run `server`'s calls on the episode's trace.state: verifiers' ServerBase pulls a rollout's state before each call
    and pushes it back after one that changed it (_with_state), over an HTTP channel to the rollout's trace; here its
    pull and push read and write the trace (`trace_of()`) directly, through JSON as the channel does."""
    adapter = server._state_adapter

    async def pull():
        return adapter.validate_json(trace_of().state.model_dump_json())

    async def push(before: bytes) -> None:
        after = adapter.dump_json(server.state)
        if after != before:
            trace = trace_of()
            trace.state = type(trace.state).model_validate_json(after)

    server._pull_state, server._push_state = pull, push


class Toolbox:
    """An episode's tools: each server's MCP server called through an in-memory MCP client (mcp.Client) of its own,
    opened for the episode; a call's result is its content's text, as verifiers' harnesses hand it to the model."""

    def __init__(self):
        self.dispatch = {}  # the model's name of a tool -> (client, the server's name of it)

    async def open(self, stack: contextlib.AsyncExitStack, server, mcp: MCPServer) -> None:
        client = await stack.enter_async_context(Client(mcp))
        for tool in (await client.list_tools()).tools:
            self.dispatch[qualified(server, tool.name)] = (client, tool.name)

    async def call(self, name: str, arguments: dict) -> str | list[dict]:
        """The call's result as verifiers' harness hands it to the model: text, or content parts where it holds an
        image (text_of: the observation)."""
        if name not in self.dispatch:
            names = ", ".join([*self.dispatch, FINAL])
            return f"Error: there is no tool {env_tools.quoted(name)}; the tools are {names}."
        client, tool = self.dispatch[name]
        result = await client.call_tool(tool, arguments)
        return mcp_content_to_chat_content(result.content)


def text_of(content) -> str:
    """A message's content as our observation: its text, each image one line (tool_calls.IMAGE: its media type or
    link)."""
    if isinstance(content, str):
        return content
    lines = []
    for part in content:
        if isinstance(part, ImageUrlContentPart):
            url = part.image_url.url
            media = url.split(";")[0].removeprefix("data:") if url.startswith("data:") else url
            lines.append(tool_calls.IMAGE.format(media))
        else:
            lines.append(part.text)
    return "\n".join(lines)


class VerifiersEnv(Env):
    def __init__(self, name: str, environment, options: dict, ack: str, whole_reply: bool = False,
                 listing: list[dict] | None = None, shared: list = ()):
        self.name, self.environment, self.ack, self.whole_reply = name, environment, ack, whole_reply
        self.rows, self.unread = [], iter(environment.taskset)  # the taskset's tasks, read as far as needed
        first = self._task(0).data.system_prompt
        self.system_prompt = None if options else first  # (what the instruction says: a row's own that differs is
        self.instruction = standards.instruction(  # said before its prompt); a taskset with tools: they and the line
            first, options, tool_calls.guide(listing) if listing else standards.REPLY_GUIDE)
        self.listing = listing  # (None: no tools, a reply's action is the agent's message)
        self.checks = {tool.name: tool for tool in map(tool_calls.tool_of, listing or []) if not isinstance(tool, str)}
        self.shared, self.shared_mcp, self.shared_stack = list(shared), None, contextlib.AsyncExitStack()
        self.seat = None  # (the episode's, whose trace the shared servers' calls read and write)
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
        if self.listing is not None:  # a call's line: (tool, its arguments checked where the tool is one of ours)
            action = tool_calls.read_call(action)
            try:
                if isinstance(action, str):
                    return StepResult(action, 0.0, False, {"valid": False})
                if action[0] in self.checks:
                    action = (action[0], env_tools.checked(self.checks[action[0]], action[1]))
            except env_tools.ToolCallError as error:
                return StepResult(f"Error: {error}", 0.0, False, {"valid": False})
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
        settling = asyncio.run_coroutine_threadsafe(settled(self.shared_stack), self.loop)
        concurrent.futures.wait([settling], timeout=standards.CALL_TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)

    # ------------------------------------------------------------------------------------------
    # The episode, in the adapter's loop

    async def _play(self, task, said: queue.Queue, replies: asyncio.Queue) -> None:
        """run() on the task with our seat, then the scored trace's reward; what happens is put on `said`."""
        seat = self.seat = Seat(self, said, replies)
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


    async def toolbox(self, stack: contextlib.AsyncExitStack, task, seat: Seat) -> Toolbox:
        """The episode's tools: the task's own servers built, set up for the task and opened on `stack` (closed with
        the episode), and the shared ones, set up once an env (closed with it), each on the episode's trace.state."""
        if self.shared_mcp is None:
            for server in self.shared:  # (verifiers sets a shared server up once, never for a task)
                bind(server, lambda: self.seat.trace)
                await self.shared_stack.enter_async_context(server._exit_stack)
                await server.setup()
            self.shared_mcp = [mcp_server(server) for server in self.shared]
        box = Toolbox()
        for server in task.toolsets(task.config):
            bind(server, lambda: seat.trace)
            await stack.enter_async_context(server._exit_stack)
            await server.setup()
            await server.setup_task(task)
            await box.open(stack, server, mcp_server(server))
        for server, mcp in zip(self.shared, self.shared_mcp):
            await box.open(stack, server, mcp)
        return box


async def settled(shared: contextlib.AsyncExitStack) -> None:
    """Wait for the loop's other tasks (a cancelled episode's) to end, then close the shared tool servers."""
    await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}), return_exceptions=True)
    await shared.aclose()


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
        self.task, self.trace, self.tools, self.stops = None, None, None, []

    async def run(self, task, **_) -> None:
        """A single-agent episode: the task's prompt, one reply."""
        async with self.interaction(task) as exchange:
            await exchange.turn()

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_):
        self.task = task
        self.trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                              state=state_cls(type(task))(), agent=AgentInfo(config=vf.AgentConfig()))
        # (the task's @vf.stop hooks on the trace, which verifiers runs before each model call; those on a model's
        # Request or Response judge what there is none of here)
        self.stops = [hook for hook in task.hooks("stop") if hook_boundary(hook, allow_trace=True) is vf.Trace]
        async with contextlib.AsyncExitStack() as stack:
            self.tools = None if self.env.listing is None else await self.env.toolbox(stack, task, self)
            yield Exchange(self)

    async def stopped(self) -> bool:
        """Whether a @vf.stop hook ends the episode now (the trace records which)."""
        for hook in self.stops:
            result = await call_hook(hook, {vf.Trace: self.trace})
            if not isinstance(result, bool):
                raise TypeError(f"the @vf.stop hook {hook.__name__} returned {type(result).__name__}, not a bool")
            if result:
                self.trace.stop(hook.__name__)
                return True
        return False


class Exchange:
    """One interaction (verifiers' Interaction, as an Env's run() uses it): turn(message) says it, returns our reply
    (with tools: our calls and their results up to our final answer, a segment as verifiers' harness runs one)."""

    def __init__(self, seat: Seat):
        self.seat, self.started, self.over = seat, False, False

    @property
    def trace(self):
        return self.seat.trace

    def _add(self, message, sampled: bool = False) -> None:
        nodes = self.trace.nodes
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=message, sampled=sampled))

    async def turn(self, message=None):
        if self.over:  # (a @vf.stop ended the exchange: verifiers' terminated segment)
            return Segment(messages=[], terminated=True)
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
            observation = "\n\n".join(text_of(one.content) for one in messages)
        self.started, produced = True, []
        while True:
            if await self.seat.stopped():
                self.over = True
                return Segment(messages=produced, terminated=not produced)
            self.seat.said.put(("observe", observation))
            reply = await self.seat.replies.get()  # (the action's text; with tools: a call, (tool, arguments))
            if isinstance(reply, str) or reply[0] == FINAL:
                produced.append(vf.AssistantMessage(content=reply if isinstance(reply, str) else reply[1]["answer"]))
                self._add(produced[-1], sampled=True)
                return Segment(messages=produced)
            call = vf.ToolCall(id=f"call_{len(self.trace.nodes)}", name=reply[0], arguments=json.dumps(reply[1]))
            result = vf.ToolMessage(tool_call_id=call.id, content=await self.seat.tools.call(*reply), name=call.name)
            observation = text_of(result.content)
            produced += [vf.AssistantMessage(tool_calls=[call]), result]
            self._add(produced[-2], sampled=True)
            self._add(produced[-1])


def messages_of(said) -> list:
    """A user turn (a str, or messages typed or as wire dicts) as typed messages."""
    if isinstance(said, str):
        return [vf.UserMessage(content=said)]
    return [parse_message(one) if isinstance(one, dict) else one for one in said or []]
