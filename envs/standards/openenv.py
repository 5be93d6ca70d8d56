"""An OpenEnv (openenv-core 0.3) environment as one of our envs: `--env openenv:TARGET`.

TARGET is an Environment subclass, `module.Class` or `module:Class`, made in this process with --env-options as its
keyword arguments; or the URL of an OpenEnv server (`openenv:http://127.0.0.1:8000`), played through OpenEnv's own
client (GenericEnvClient(...).sync()) on the server's WebSocket session (/ws): its HTTP /reset and /step make a fresh
environment for every request, so they keep no episode. `--env openenv:module.Class --env-url URL` plays the class on
the servers at URL (round robin, as our own servers): the class then only names the env. A server serves as
many sessions at once as its max_concurrent_envs (create_app's; an env that is not SUPPORTS_CONCURRENT_SESSIONS: one),
which bounds the instances a run may make there.

    task id     the seed of reset(seed=task_id): the same task id replays the same episode (groups, resume), where
                the environment draws only from that seed; --env-options task_key KEY: reset(KEY=task_id), for an
                environment whose reset takes a task by another keyword (ours served: task_id)
    action      the reply's action (envs/standards.action_of; whole_reply True: the reply) in the Action class's one
                field (found from its JSON schema, `metadata` aside; pydantic converts it to the field's type); an
                Action of several fields takes the action as a JSON object of them. One that does not validate is
                answered with the error, the environment not stepped (valid False), in the same words in process and
                from a server
    observation the Observation's one field as text (`done`, `reward`, `metadata` aside); several: them as JSON, or
                the one --env-options observation FIELD names (the others left out)
    reward      the return so far (the sum of the observations' rewards, None as 0; --env-options reward return: the
                observation's reward is already the return so far, as ours served send it); done: the observation's done
    instruction get_metadata().description (a server's /metadata), but for the default "<Class> environment"; then
                how to reply (an MCP environment's: its tools and the call line, below)

An MCP environment (MCPEnvironment's subclass, or a server whose Action is CallToolAction) is played through its
tools, listed once a process with ListToolsAction (in process: from an instance made without --env-options; a server:
on a session of its own), so `--agent tools` plays it (envs/tools.py):

    tools       each MCP tool is a Tool of ours; its input schema's parameters are its Params where each is a string,
                integer, number or boolean (with its description, enum and required), and a tool with any other
                parameter (an object, an array, a union such as `int | None`) is skipped, said in one line on stderr
    action      a call is one canonical JSON line, the reply's action: {"tool": NAME, "arguments": {...}} (the
                arguments in the schema's order, as json.dumps writes them, non-ASCII kept), which step reads back
                into CallToolAction(tool_name=NAME, arguments=...); a react reply writes the same line itself, as
                the instruction says: each tool's arguments and types, the line and an example (tool_calls.guide).
                Anything else is answered with the line's format, the environment not stepped (valid False)
    observation the tool result's text (its text contents, one a line), or `Error: ` and the message where the call
                failed (an unknown tool, arguments the tool does not take); reward and done: the observation's, as
                any (an MCPEnvironment sets them in its own step: tests/guess_mcp.py)

Not covered: a server in production mode (no simulation reset/step; MCP over /mcp alone), rubrics read from outside
(the reward is what each observation carries).

Our own envs served by envs/standards/openenv_server.py play as they do in process with `--env-options whole_reply
True observation text task_key task_id` (scripts/bench/env.py replays the expert so): their Action is the
reply as our env's step takes it, their Observation carries the task id, instruction, ack and info beside the text,
their reset(seed=s) plays the train split's task s % len (reset(task_id=i): task i), and their reward is a step's
(the change in our env's score, which the `score` field carries: that server's docstring), summed here as any.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import math

import httpx
import pydantic
import websockets
from openenv.core import GenericEnvClient
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
from openenv.core.env_server.types import Action

from envs import REACT_ONLY_ONE, Env, StepResult
from envs import standards
from envs.standards import tool_calls
from envs.tools import Tool

SKIPPED = {"done", "reward", "metadata"}  # what an Observation has besides what it says


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def check(target: str) -> None:
    """Raise where an in-process target names no Environment subclass (a URL is reached only when an env is made)."""
    if not is_url(target):
        _classes(target)


def make(name: str, target: str, url: str | None = None, instruction: str | None = None, ack: str = standards.ACK,
         timeout: float = standards.CALL_TIMEOUT, whole_reply: bool = False, observation: str | None = None,
         task_key: str = "seed", reward: str = "step", **options) -> Env:
    given = {"instruction": instruction} if instruction else {}
    shape = Shape(whole_reply, observation, task_key, reward)
    if is_url(target) or url is not None:
        if options:
            raise ValueError(f"{', '.join(options)}: options of the environment itself, which runs on the server; "
                             "give them to the server")
        return ServedEnv(name, url or target, given, ack, float(timeout), shape)
    environment, action = _classes(target)
    return LocalEnv(name, environment(**options), action, given, ack, shape)


class Shape:
    """What the options whole_reply, observation, task_key and reward say: what a reply sends, which field of an
    Observation is shown, which keyword of reset takes the task id, whether a reward is a step's or the return so far."""

    def __init__(self, whole_reply: bool = False, observation: str | None = None, task_key: str = "seed",
                 reward: str = "step"):
        if reward not in ("step", "return"):
            raise ValueError(f"--env-options reward {reward}: say step (a step's reward, summed) or return (the return "
                             "so far)")
        self.whole_reply, self.observation, self.task_key, self.reward = whole_reply, observation, task_key, reward

    def check(self, fields: list[str]) -> None:
        """Raise, with the fields there are, where the observation option names none of the Observation's `fields`."""
        if self.observation is not None and self.observation not in fields:
            raise ValueError(f"--env-options observation {self.observation}: the observation has no such field "
                             f"(it has {', '.join(field for field in fields if field not in SKIPPED)})")

    def text(self, fields: dict) -> str:
        return str(fields[self.observation]) if self.observation is not None else observation_text(fields)


def _classes(target: str) -> tuple[type, type]:
    """The Environment subclass `target` names and its Action class (the first type argument of Environment[...])."""
    module, colon, attribute = target.rpartition(":") if ":" in target else target.rpartition(".")
    if not module:
        raise ValueError(f"{target}: give module.Class (an Environment subclass) or an http(s):// server URL")
    environment = getattr(importlib.import_module(module), attribute)
    if not (isinstance(environment, type) and issubclass(environment, Environment)):
        raise TypeError(f"{target} is not an OpenEnv Environment subclass")
    if issubclass(environment, MCPEnvironment):
        return environment, CallToolAction
    for cls in environment.__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            arguments = getattr(base, "__args__", ())
            if arguments and isinstance(arguments[0], type) and issubclass(arguments[0], Action):
                return environment, arguments[0]
    raise TypeError(f"{target} does not say its Action class: declare it as Environment[MyAction, MyObservation, ...]")


def description_of(metadata: dict) -> str | None:
    """What the environment says it is, but for the default description ("<Class> environment")."""
    description = metadata.get("description")
    return None if description == f"{metadata.get('name')} environment" else description


def fields_of(schema: dict) -> list[str]:
    """The fields an action sets, from its JSON schema."""
    return [name for name in schema.get("properties", {}) if name != "metadata"]


def action_payload(text: str, fields: list[str], whole_reply: bool = False) -> dict | str:
    """The action's fields for a reply: {field: action} for one field, the action's JSON object for several; a str
    that says what is wrong where the reply gives no action the Action can take."""
    action = standards.action_of(text, whole_reply)
    if action is None:
        return REACT_ONLY_ONE
    if len(fields) == 1:
        return {fields[0]: action}
    try:
        payload = json.loads(action)
    except json.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict):
        return f"Error: the action takes the fields {', '.join(fields)}: write it as a JSON object of them."
    return payload


def observation_text(fields: dict) -> str:
    """An observation's fields (done, reward and metadata aside) as text."""
    shown = {key: value for key, value in fields.items() if key not in SKIPPED}
    if len(shown) == 1:
        return str(next(iter(shown.values())))
    return json.dumps(shown, default=str)

# ----------------------------------------------------------------------------------------------
# MCP tools: listed once, each call one JSON line (envs/standards/tool_calls.py)


def is_mcp(fields: list[str]) -> bool:
    """Whether an Action of these fields is MCP's CallToolAction (a server that serves an MCPEnvironment)."""
    return {"tool_name", "arguments"} <= set(fields)


@functools.cache
def listed(target: str) -> tuple[dict, ...] | None:
    """The MCP tools the environment `target` names lists ({"name", "description", "input_schema"} each); None for one
    that is no MCP environment."""
    if is_url(target):
        with httpx.Client(base_url=target.rstrip("/"), timeout=standards.CALL_TIMEOUT) as http:
            if not is_mcp(fields_of(http.get("/schema").raise_for_status().json()["action"])):
                return None
        client = GenericEnvClient(base_url=target.rstrip("/"), connect_timeout_s=standards.CALL_TIMEOUT,
                                  message_timeout_s=standards.CALL_TIMEOUT).sync()
        with client:
            return tuple(client.step({"type": "list_tools"}).observation.get("tools", []))
    environment, action = _classes(target)
    if action is not CallToolAction:
        return None
    instance = environment()
    try:
        return tuple(tool.model_dump() for tool in instance.step(ListToolsAction()).tools)
    finally:
        instance.close()


@functools.cache
def tools(target: str) -> tuple[Tool, ...] | None:
    """The MCP tools of the environment `target` names, as ours (envs/tools.py); None for one without MCP tools. A
    ValueError, in one sentence, where every tool is skipped."""
    listing = listed(target)
    return None if listing is None else tool_calls.tools_of(f"openenv:{target}", listing)


def call_payload(text: str, whole_reply: bool = False) -> dict | str:
    """CallToolAction's fields for a reply whose action is a call's JSON line; a str that says what is wrong else."""
    action = standards.action_of(text, whole_reply)
    if action is None:
        return REACT_ONLY_ONE
    call = tool_calls.read_call(action)
    if isinstance(call, str):
        return call
    return {"type": "call_tool", "tool_name": call[0], "arguments": call[1]}


def result_text(fields: dict) -> str:
    """A CallToolObservation's fields as text: the result's contents, one a line (an image as tool_calls.IMAGE, not its
    base64), or the error's message."""
    if fields.get("error"):
        return f"Error: {fields['error']['message']}"
    result = fields.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        return "\n".join(map(content_line, result["content"]))
    return result if isinstance(result, str) else json.dumps(result, default=str)


def content_line(item: dict) -> str:
    """An MCP content item as a line of the observation: its text, an image as tool_calls.IMAGE, else its JSON."""
    if item.get("type") == "text":
        return item["text"]
    if item.get("type") == "image":
        return tool_calls.IMAGE.format(item.get("mimeType") or item.get("mime_type"))
    return json.dumps(item, default=str)


class OpenEnvEnv(Env):
    def __init__(self, name: str, options: dict, ack: str, description: str | None, shape: Shape,
                 listing: tuple[dict, ...] | None):
        self.name, self.ack, self.shape = name, ack, shape
        self.mcp = listing is not None  # (its tools, named with the call line in the instruction: a react reply's)
        self.instruction = standards.instruction(description, options, tool_calls.guide(listing) if self.mcp
                                                 else standards.REPLY_GUIDE)
        self.score = 0.0

    @property
    def invalid(self) -> str:
        """The answer to an action the Action class does not validate (the same in process and from a server, which
        says no more than that)."""
        return f"Error: that is not a valid action (it sets {', '.join(self.fields)})."

    def _payload(self, text: str) -> dict | str:
        """The Action's fields for a reply (an MCP environment's: CallToolAction's), or what is wrong with it."""
        if self.mcp:
            return call_payload(text, self.shape.whole_reply)
        return action_payload(text, self.fields, self.shape.whole_reply)

    def _text(self, fields: dict) -> str:
        """An observation's fields as text (a tool's result, where it answers a call)."""
        return result_text(fields) if self.mcp and "tool_name" in fields else self.shape.text(fields)

    def _result(self, observation: str, reward, done: bool, valid: bool = True) -> StepResult:
        # (a NaN would skip the whole step's update, every env's: it fails this episode alone, an env error)
        if reward is not None and not math.isfinite(float(reward)):
            raise ValueError(f"{self.name} gave the reward {reward}, which is not a finite number")
        if self.shape.reward == "return":
            self.score = self.score if reward is None else float(reward)
        else:
            self.score += float(reward or 0.0)
        return StepResult(observation, self.score, bool(done), {"valid": valid})


class LocalEnv(OpenEnvEnv):
    """An Environment instance in this process."""

    def __init__(self, name: str, environment: Environment, action: type, options: dict, ack: str, shape: Shape):
        listing = (tuple(tool.model_dump() for tool in environment.step(ListToolsAction()).tools)
                   if action is CallToolAction else None)
        super().__init__(name, options, ack, description_of(environment.get_metadata().model_dump()), shape, listing)
        self.environment, self.action = environment, action
        self.fields = fields_of(action.model_json_schema())

    def reset(self, task_id: int) -> str:
        self.score = 0.0
        observation = self.environment.reset(**{self.shape.task_key: int(task_id)}).model_dump()
        self.shape.check(list(observation))
        return self.shape.text(observation)

    def step(self, text: str) -> StepResult:
        payload = self._payload(text)
        if isinstance(payload, str):
            return self._result(payload, None, False, valid=False)
        try:
            action = self.action(**payload)
        except pydantic.ValidationError:
            return self._result(self.invalid, None, False, valid=False)
        observation = self.environment.step(action)
        return self._result(self._text(observation.model_dump()), observation.reward, observation.done)

    def close(self) -> None:
        self.environment.close()


class ServedEnv(OpenEnvEnv):
    """A session on an OpenEnv server: its action schema read from /schema, then one WebSocket session."""

    def __init__(self, name: str, url: str, options: dict, ack: str, timeout: float, shape: Shape):
        url = url.rstrip("/")
        try:
            with httpx.Client(base_url=url, timeout=timeout) as http:
                schema = http.get("/schema").raise_for_status().json()
                description = description_of(http.get("/metadata").raise_for_status().json())
        except httpx.HTTPError as error:
            raise ConnectionError(f"no OpenEnv server answers at {url} ({type(error).__name__}: {error})") from None
        self.fields = fields_of(schema["action"])
        super().__init__(name, options, ack, description, shape, listed(url) if is_mcp(self.fields) else None)
        shape.check(list(schema["observation"].get("properties", {})))
        self.url = url
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout).sync()
        self.client.connect()

    def reset(self, task_id: int) -> str:
        self.score = 0.0
        try:
            return self.shape.text(self.client.reset(**{self.shape.task_key: int(task_id)}).observation)
        except websockets.ConnectionClosed:
            self._say_if_full()
            raise

    def _say_if_full(self) -> None:
        """Raise, in one sentence, where the server closed the session because it was full: openenv-core 0.3 accepts
        the socket, sends its SessionCapacityError as an error message and closes, so the client's first call meets a
        closed socket (ConnectionClosedOK) with the message still unread on it."""
        try:
            said = json.loads(self.client._run(asyncio.wait_for(self.client._async._ws.recv(), 1.0)))
        except Exception:  # noqa: BLE001 - nothing said before it closed: the closed socket is the error
            return
        data = said.get("data", {}) if isinstance(said, dict) else {}
        if data.get("code") == "CAPACITY_REACHED":
            raise ConnectionError(f"the OpenEnv server at {self.url} is full (its max sessions at once, "
                                  f"max_concurrent_envs, is {data.get('max_sessions')}): make fewer env instances "
                                  "(a smaller batch, more --env-url servers) or serve more sessions (openenv_server "
                                  "--max-sessions)") from None

    def step(self, text: str) -> StepResult:
        payload = self._payload(text)
        if isinstance(payload, str):
            return self._result(payload, None, False, valid=False)
        try:
            result = self.client.step(payload)
        except RuntimeError as error:  # (the server's answer to an action that does not validate)
            if "VALIDATION" not in str(error).upper():
                raise
            return self._result(self.invalid, None, False, valid=False)
        return self._result(self._text(result.observation), result.reward, result.done)

    def close(self) -> None:
        self.client.close()
