"""Each env's actions as native tools, in OpenAI's function-calling format, and the bridge between a tool
call and the env's text protocol.

A model that acts through tool calls (`tools` in the prompt, `tool_calls` in the reply) still plays the
same env: a call becomes the exact text a ReAct reply would send, and env.step() takes it as it takes any
reply. So the env, its rewards and its remote servers stay as upstream has them, and an expert's text
transcript converts to tool calls and back without changing one step.

    schemas("babyai")                                     -> [{"type": "function", "function": {...}}, ...]
    action_text("babyai", "go_to", {"object": "red ball 1"})  -> "Action: go to red ball 1"
    call_of("babyai", "Thought: ...\\nAction:\\ngo to red ball 1")  -> ("go_to", {"object": "red ball 1"})

An env module opts in with three names (envs/__init__.py):
    TOOLS                  tuple of Tool: each renders its call as the env's action ("go to {object}")
    REPLY                  how a reply carries one action ("Action: {action}")
    read_action(text)      the action a reply sends, spelled as the env reads it ("" or None when none)

call_of reads a reply with the env's own parser (read_action), so whatever else the reply holds (a
thought, a <think> block) is ignored as the env ignores it, then finds the first tool whose pattern
matches the whole action. It is exact: the call renders back the same action, or another spelling that
the env takes alike (where a tool's `reads` says so), so stepping its action_text does what stepping the
reply does.

Argument types follow JSON Schema: an integer may arrive as an integer-valued float (2.0, which JSON
Schema counts as an integer) and is rendered as 2; a bool is never a number; null for an optional
argument means it is absent. Anything else wrong is a ToolCallError whose message, one sentence, is meant
to be shown to the model as the observation. action_text is total: whatever a model's call holds (any
JSON value, or any Python value), it returns the action or raises ToolCallError, never anything else.
Beyond JSON Schema, and because an argument becomes text in an action: an integer is a count or an id,
0 to 18 digits (the actions spell no sign, SPELLINGS, so -1 would be read as 1; 401 digits is no count);
a number is finite (NaN and Infinity, which Python's json reads, are not); a string is Unicode text (no
lone surrogate, which JSON's "\\ud800" can carry and no tokenizer, JVM or browser takes) of at most
MAX_CHARS characters. A message quotes at most QUOTED characters of what the model wrote.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from typing import Callable

from envs import _module

TYPES = {"string": (str,), "integer": (int, float), "number": (int, float), "boolean": (bool,)}
# What a value of each type looks like inside an action, for the patterns read from format strings.
# Integers without leading zeros: "get 01 stick" renders back as "get 1 stick", which the env answers differently.
SPELLINGS = {"string": ".*", "integer": "0|[1-9][0-9]*", "number": "-?[0-9]+(?:\\.[0-9]+)?", "boolean": "True|False"}
ARTICLES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean"}
MAX_DIGITS = 18  # an integer or number argument has at most this many digits (int64 holds them all)
# the longest string argument: far above what a turn samples, and a call of three such stays within envs.serve's
# 1 MiB request body even where JSON escapes every character (6 bytes)
MAX_CHARS = 32_768
QUOTED = 40  # characters of a model's string quoted in a message


@dataclass(frozen=True)
class Param:
    type: str  # JSON Schema type: string, integer, number or boolean
    description: str
    enum: tuple | None = None
    required: bool = True


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: dict[str, Param]  # in the order the schema lists them
    # The env's action for a call: a format string over the params (all required), or a function of the
    # validated arguments (where an optional param is absent, it is not in the dict).
    action: str | Callable[[dict], str]
    # A regex whose full match on an action reads the call back (named groups = params); by default the
    # format string's own shape. Needed where the env reads a call spelled otherwise (SciWorld's "drop" for put down).
    reads: str | None = None

    def pattern(self) -> re.Pattern:
        if self.reads is not None:
            return re.compile(self.reads, re.DOTALL)
        pattern = ""
        for literal, name, _, _ in string.Formatter().parse(self.action):
            pattern += re.escape(literal) + (f"(?P<{name}>{SPELLINGS[self.params[name].type]})" if name else "")
        return re.compile(pattern, re.DOTALL)


class ToolCallError(ValueError):
    """A tool call the env cannot take; the message says what was wrong, in one sentence."""


def tools(env_name: str) -> tuple[Tool, ...]:
    module = _module(env_name)
    if not hasattr(module, "TOOLS"):
        raise ValueError(f"the {env_name} env declares no TOOLS, so it cannot be played with --agent tools")
    return module.TOOLS


def schemas(env_name: str) -> list[dict]:
    """The env's tools as OpenAI function schemas, for the prompt's `tools`."""
    def schema(param: Param) -> dict:
        enum = {"enum": list(param.enum)} if param.enum else {}
        return {"type": param.type, "description": param.description, **enum}

    return [{"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": {"type": "object", "properties": {name: schema(p) for name, p in tool.params.items()},
                       "required": [name for name, p in tool.params.items() if p.required]},
    }} for tool in tools(env_name)]


# ----------------------------------------------------------------------------------------------
# A call -> the reply text the env takes


def action_text(env_name: str, name: str, arguments: dict) -> str:
    """The raw text env.step() takes for the call `name(**arguments)`, as a ReAct reply would send it.
    Raises ToolCallError for an unknown tool, missing, unknown or mistyped arguments, or a value outside
    its enum or the bounds above; nothing else, whatever `name` and `arguments` are."""
    by_name = {tool.name: tool for tool in tools(env_name)}
    if not isinstance(name, str) or name not in by_name:
        raise ToolCallError(f"there is no tool {quoted(name)}; the tools are {', '.join(by_name)}")
    tool = by_name[name]
    arguments = checked(tool, arguments)
    action = tool.action.format(**arguments) if isinstance(tool.action, str) else tool.action(arguments)
    return _module(env_name).REPLY.format(action=action)


def checked(tool: Tool, arguments) -> dict:
    """The arguments, type-checked against the tool's params, without nulls, integers as int (ToolCallError where they
    do not fit: action_text's checks, which an adapter that reads calls itself makes too)."""
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {tool.name} must be a JSON object, not {_described(arguments)}")
    unknown = [key for key in arguments if key not in tool.params]
    if unknown:
        takes = f"its arguments are {', '.join(tool.params)}" if tool.params else "it takes none"
        raise ToolCallError(f"{tool.name} has no argument {quoted(unknown[0])}; {takes}")
    checked = {}
    for key, param in tool.params.items():
        value = arguments.get(key)
        if value is None:
            if param.required:
                raise ToolCallError(f"{tool.name} needs the argument {key!r}")
            continue
        what = f"the argument {key!r} of {tool.name}"
        if (not isinstance(value, TYPES[param.type]) or (isinstance(value, bool) and param.type != "boolean")
                or (param.type == "integer" and isinstance(value, float) and not value.is_integer())):
            raise ToolCallError(f"{what} must be {ARTICLES[param.type]}, not {_described(value)}")
        if param.type == "integer" and (value < 0 or _digits(value) > MAX_DIGITS):
            raise ToolCallError(f"{what} must be an integer of 0 or more with at most {MAX_DIGITS} digits, "
                                f"not {_described(value)}")
        if param.type == "number" and _digits(value) > MAX_DIGITS:
            raise ToolCallError(f"{what} must be a finite number with at most {MAX_DIGITS} digits, not {_described(value)}")
        if param.type == "string" and len(value) > MAX_CHARS:
            raise ToolCallError(f"{what} is {len(value):,} characters long, and an argument holds at most {MAX_CHARS:,}")
        if param.type == "string" and (at := _surrogate(value)) >= 0:
            raise ToolCallError(f"{what} is not Unicode text: it holds a lone surrogate at character {at}")
        if param.enum is not None and value not in param.enum:
            raise ToolCallError(f"{what} must be one of {', '.join(map(str, param.enum))}, not {quoted(value)}")
        checked[key] = int(value) if param.type == "integer" else value
    return checked


def _digits(number: int | float) -> int | float:
    """The digits of a number's integer part, counted without converting it to text (Python refuses to write an
    int of more than 4,300 digits); a non-finite float counts as endless."""
    if isinstance(number, float):
        if not math.isfinite(number):
            return math.inf
        number = int(number)
    number = abs(number)
    digits = max(1, math.floor(number.bit_length() * math.log10(2)))  # a lower bound
    while number >= 10 ** digits:
        digits += 1
    return digits


def _surrogate(text: str) -> int:
    """The index of the first lone surrogate in `text`, -1 when there is none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return -1


def _described(value) -> str:
    """A JSON value in a few words: "a string", "the number 2.5", "NaN", "an integer of 401 digits"."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"  # (as Python's json spells them)
    if isinstance(value, (int, float)) and _digits(value) > MAX_DIGITS:
        return f"{'an integer' if isinstance(value, int) else 'a number'} of {_digits(value):,} digits"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    words = {str: "a string", list: "an array", dict: "an object", type(None): "null"}
    return words.get(type(value), type(value).__name__)


def quoted(value) -> str:
    """What a model wrote, for a message: a string's repr (lone surrogates and control characters escaped) cut at
    QUOTED characters, its length said when cut; anything else in a few words."""
    if not isinstance(value, str):
        return _described(value)
    if len(value) <= QUOTED:
        return repr(value)
    return f"{value[:QUOTED]!r}... ({len(value):,} characters)"


# ----------------------------------------------------------------------------------------------
# A reply -> the call that stands for it


def call_of(env_name: str, text: str) -> tuple[str, dict]:
    """The tool call that does what the reply `text` does: env.step(action_text(env_name, *call_of(env_name,
    text))) acts as env.step(text). The reply is read by the env's own parser, so its thoughts are ignored.
    Raises ValueError when the reply sends no action or one that no tool spells."""
    module = _module(env_name)
    action = module.read_action(text)
    if not action:
        raise ValueError(f"the reply sends no {env_name} action, so no tool call stands for it")
    for tool in tools(env_name):
        if match := tool.pattern().fullmatch(action):
            return tool.name, {key: _value(tool.params[key], spelled) for key, spelled in match.groupdict().items()
                               if spelled is not None}
    raise ValueError(f"the {env_name} action {action!r} matches no tool")


def _value(param: Param, spelled: str):
    """An argument as the action spells it -> its JSON value (a boolean is spelled True, true or 1)."""
    if param.type == "integer":
        return int(spelled)
    if param.type == "number":
        return float(spelled)
    if param.type == "boolean":
        return spelled in ("True", "true", "1")
    return spelled
