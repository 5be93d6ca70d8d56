"""MCP tools as ours (envs/tools.py), each call one canonical JSON line: what the OpenEnv adapter (an MCPEnvironment's
tools) and the verifiers adapter (a taskset's toolsets) share, so that both read and write a call the same way.

    tool_of(listed)      an MCP tool ({"name", "description", "input_schema"}) as our Tool, or why it is skipped: its
                         parameters are the schema's where each is a string, integer, number or boolean (description,
                         enum and required kept); a tool with any other parameter (an object, an array, `int | None`) is
                         skipped
    call_line(name, a)   a call as its action: {"tool": NAME, "arguments": {...}} (the arguments in the schema's order,
                         as json.dumps writes them, non-ASCII kept); `Action: ` before it is the env's REPLY
    read_call(action)    the (name, arguments) an action's line calls, or CALL_FORMAT where it is no such line
    IMAGE                an image in a tool's result, as its observation's line (both adapters)
    guide(listed)        the reply guide of an env with tools, for a react agent: each tool (its arguments and their
                         types), then the call line with an example (--agent tools is given the schemas themselves)
"""

from __future__ import annotations

import functools
import json
import re
import sys

from envs.tools import TYPES, Param, Tool

# How a call's arguments are spelled in its JSON line, for the pattern that reads a call back (envs/tools.call_of): a
# string only where json.dumps writes it as it is (no quote, backslash or control character: one that needs an escape
# reads back as no call, though step takes it)
JSON_SPELLINGS = {"string": r'"(?P<{}>[^"\\\x00-\x1f]*)"', "integer": "(?P<{}>0|[1-9][0-9]*)",
                  "number": r"(?P<{}>-?[0-9]+(?:\.[0-9]+)?)", "boolean": "(?P<{}>true|false)"}
CALL_FORMAT = 'Error: call a tool as one JSON object, {"tool": NAME, "arguments": {...}}.'
# An image in a tool's result, as one line of the observation (its media type): its base64 would be thousands of tokens
IMAGE = "[an image ({}), not shown: the model here reads text]"
EXAMPLES = {"string": "...", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}  # (guide's)


def tool_of(listed: dict) -> Tool | str:
    """An MCP tool (name, description, input_schema) as our Tool, or the sentence that says why it is skipped."""
    name, schema = listed["name"], listed.get("input_schema") or {}
    params = {}
    for key, spec in schema.get("properties", {}).items():
        if spec.get("type") not in TYPES or not key.isidentifier():
            return (f"the tool {name} is skipped: its argument {key} is {json.dumps(spec)}, and a tool's arguments "
                    "here are strings, integers, numbers or booleans")
        enum = tuple(spec["enum"]) if "enum" in spec else None
        params[key] = Param(spec["type"], spec.get("description", ""), enum, key in schema.get("required", []))
    reads = re.escape(f'{{"tool": {json.dumps(name, ensure_ascii=False)}, "arguments": {{')
    for key, param in params.items():  # (each `"key": value` ends with ", " before the next or at the "}")
        segment = f'{re.escape(json.dumps(key, ensure_ascii=False))}: {JSON_SPELLINGS[param.type].format(key)}(?:, (?=")|(?=\}}))'
        reads += f"(?:{segment}){'' if param.required else '?'}"
    return Tool(name, listed.get("description") or "", params, functools.partial(call_line, name), reads + r"\}\}")


def tools_of(spec: str, listed: list[dict]) -> tuple[Tool, ...]:
    """The listed MCP tools of the env `spec` as ours, each skipped one said in one line on stderr; a ValueError, in one
    sentence, where every tool is skipped."""
    ours = []
    for one in listed:
        tool = tool_of(one)
        if isinstance(tool, str):
            print(f"{spec}: {tool}", file=sys.stderr)
        else:
            ours.append(tool)
    if not ours:
        raise ValueError(f"{spec} lists no tool whose arguments are all strings, integers, numbers or booleans, so it "
                         "cannot be played with --agent tools")
    return tuple(ours)


def call_line(name: str, arguments: dict) -> str:
    """A tool call as its action: one JSON line, the arguments in the order given (envs/tools: the schema's)."""
    return json.dumps({"tool": name, "arguments": arguments}, ensure_ascii=False)


def read_call(action: str) -> tuple[str, dict] | str:
    """The (tool, arguments) of an action that is a call's JSON line; CALL_FORMAT, what to write instead, else."""
    try:
        call = json.loads(action)
    except json.JSONDecodeError:
        call = None
    if not (isinstance(call, dict) and call.keys() == {"tool", "arguments"} and isinstance(call["tool"], str)
            and isinstance(call["arguments"], dict)):
        return CALL_FORMAT
    return call["tool"], call["arguments"]


def guide(listed: list[dict]) -> str:
    """How a react agent calls the listed MCP tools: each tool's signature and description, then the reply's format
    with the first tool's call line as the example (the line envs.standards' action_of and read_call read back)."""
    lines = ["You act by calling one of these tools in each reply:"]
    for tool in listed:
        schema = tool.get("input_schema") or {}
        required = schema.get("required", [])
        params = [f"{key}: {spec.get('type', 'any')}{'' if key in required else ', optional'}"
                  for key, spec in schema.get("properties", {}).items()]
        description = (tool.get("description") or "").strip()
        lines.append(f"- {tool['name']}({'; '.join(params)})" + (f": {description}" if description else ""))
        lines += [f"    {key}: {spec['description']}" for key, spec in schema.get("properties", {}).items()
                  if spec.get("description")]
    first = listed[0].get("input_schema") or {}
    example = {key: spec["enum"][0] if spec.get("enum") else EXAMPLES.get(spec.get("type"), "...")
               for key, spec in first.get("properties", {}).items() if key in first.get("required", [])}
    return "\n".join([*lines, "Reply with your reasoning, then one call as one line of JSON, {\"tool\": NAME, "
                      "\"arguments\": {...}}, in this format:", "Thought: I think ...",
                      f"Action: {call_line(listed[0]['name'], example)}"])
