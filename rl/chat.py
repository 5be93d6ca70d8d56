"""The chat layout: how messages (and tool schemas) become tokens, the reasoning block of a reply, and the tool
calls in it. ChatFormat is the only place that turns messages into tokens; rollout.py appends what it returns.

    fmt = ChatFormat(tokenizer)                                   # read off the tokenizer's own chat template
    ids = fmt.prompt(messages, tools=schemas)                    # an episode's first prompt
    ids = fmt.observation(text, role="tool")                      # the scaffolding around an env's answer
    answer = fmt.answer(reply)                                    # the reply after its reasoning (None: cut inside)
    calls = fmt.parse_calls(answer)                               # [(name, arguments)], or CallError

Reasoning. Models that think before they act (Qwen3, R1 distills, QwQ) open their reply with a block between two
tags; what an env parses is the reply after that block, and the tokens stay exactly as sampled. The rule, in
Reasoning.split for every engine: the answer is the text after the last closing tag (not counting one inside a
<tool_call> block: an argument's text), the reasoning everything before it, with or without an opening tag. The
tags are read off the chat template where it names them (`</think>` in Qwen3's and R1's), are `<think>` and
`</think>` where there is no template to read (a model behind an API whose server returns its reasoning inline;
APIFormat), and come from --reasoning-tags otherwise. A template whose generation prompt opens the block itself (R1
distills, Qwen3-Thinking: "<|im_start|>assistant\\n<think>\\n") makes every reply start inside it, so the reply
holds only the closing tag. A reply that never closes its block
(cut off by --max-new-tokens: an opening tag, or under such a template any text, without a closing tag after it)
has no answer: the rollout answers it as an invalid action and the episode goes on. Without a template to read
(an API model) a reply with no tag at all is the answer. The conversation keeps a local model's reply whole, as
sampled (R1's and Qwen3's templates render it without everything up to its last closing tag); an API model's
reasoning is kept apart, as the message's reasoning_content (rl/engines/api.py).

Earlier reasoning (--reasoning). Such templates drop the reasoning of earlier turns when they render a conversation,
so a new turn's rendering is no longer the last one's plus the reply. `keep` (the default): the trajectory's own
tokens are the context, every turn's reasoning stays in what the model sees; on-policy and exact, and longer than
what the template renders at inference by the earlier turns' reasoning (docs/reasoning-and-tools.md: "Reasoning
models and tool calling"). `drop`: each turn's prompt is the template's rendering of the conversation so far, what an
inference server would show, each turn a sequence of its own, exact from its prompt on: a mode of the context policy
(rl/context.py), which decides where a prompt is rendered; this module renders it.

Tool calls. `--agent tools` gives the model the env's actions as tools (OpenAI's function format, envs/tools.py),
rendered by the template (`tools=`), and reads the calls in the reply in the template's own format: Hermes'
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3 and most open models) or Llama 3.1's bare
JSON object `{"name": ..., "parameters": {...}}` (after an optional <|python_tag|>). The env's answer to a call
comes back as a `tool` message, wrapped in what the template renders around one. A template that never reads `tools`
(SmolLM2's, Llama 3's: no schemas rendered), or renders neither format, is refused with one sentence. Llama 3.1's
template writes a tool result as a JSON string (its content `| tojson`), so its results are wrapped the same way;
Llama 3's templates trim every message, so an observation is trimmed too (a sampled reply stays as sampled). Calls
are read as strict JSON: NaN, Infinity and numbers beyond a float (1e999), which Python's json would take, are
refused, as is nesting deeper than MAX_DEPTH (a call's arguments are flat; deeper values would later be written back
into the conversation by recursive encoders). Whatever a reply holds, reading it gives calls or a CallError, never
another exception.

Harmony (gpt-oss) is refused at start: a reply there is several messages (reasoning on the analysis channel, then the
answer on the final channel or a call on the commentary channel) ending in <|return|> or <|call|>, which the
template rewrites as <|end|> in history, and a tool result's header names its tool; a turn here is one assistant
message closed by one end-of-turn token, around a fixed scaffolding.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from envs.tools import quoted

DEFAULT_REASONING = ("<think>", "</think>")
# reasoning tags known in open models' templates: (opening, closing)
KNOWN_REASONING = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("<reasoning>", "</reasoning>"))
CALL_STYLES = ("hermes", "llama")
MAX_DEPTH = 32  # the deepest nesting of arrays and objects read in a tool call
# a Hermes tool call's text in a reply: its block, to its end (or to the end of a reply cut off inside it; another
# block's opening tag leaves it unclosed). A closing tag of reasoning inside one is the call's (an argument's string).
CALL_BLOCK = re.compile(r"<tool_call>(?:(?!<tool_call>).)*?(?:</tool_call>|\Z)", re.DOTALL)
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


class CallError(ValueError):
    """A reply whose tool calls cannot be read; the message, one sentence, is the observation the model gets."""


@dataclass(frozen=True)
class Reasoning:
    """A reasoning block between `open` and `close` at the start of a reply."""

    open: str
    close: str

    def split(self, reply: str, opened: bool = False) -> tuple[str, str | None]:
        """(reasoning, answer). The answer is the text after the last closing tag (`end`), the reasoning everything
        before it, with or without an opening tag (a generation prompt that opened the block, `opened`, leaves only
        the closing tag in the reply; a model may also write the tag inside its reasoning). Answer None when the reply
        ends inside a block: the text after the last closing tag (the reply, without one) starts with an opening
        tag, or `opened` and there is no closing tag. Otherwise a reply without a closing tag is all answer."""
        end = self.end(reply)
        reasoning, answer = (reply[:end], reply[end + len(self.close):].lstrip()) if end >= 0 else ("", reply)
        if answer.lstrip().startswith(self.open) or (end < 0 and opened):
            reasoning, answer = reply, None
        stripped = reasoning.lstrip()
        return stripped[len(self.open):] if stripped.startswith(self.open) else reasoning, answer

    def end(self, reply: str) -> int:
        """Where the reasoning's last closing tag starts (-1: none): the last one outside every tool call
        (CALL_BLOCK), whose JSON may hold the tag as text, e.g. a string to type."""
        # (a block left open, a reply cut off inside a call, is one only after a closing tag: before one, the tag is a
        # word of the reasoning, "should I answer with a <tool_call> block?")
        calls = [match.span() for match in CALL_BLOCK.finditer(reply) if match.group().endswith("</tool_call>")
                 or self.close in reply[:match.start()]] if "<tool_call>" in reply else []
        end = reply.rfind(self.close)
        while end >= 0 and any(start < end < stop for start, stop in calls):
            end = reply.rfind(self.close, 0, end)
        return end


def reasoning_of(template: str | None, tags: tuple[str, str] | None = None) -> Reasoning | None:
    """The reasoning tags: `tags` when given, else the first known pair whose closing tag the template names, else
    the default pair where there is no template (None: the template names none, and replies are read whole)."""
    if tags:
        return Reasoning(*tags)
    if template is None:
        return Reasoning(*DEFAULT_REASONING)
    return next((Reasoning(*pair) for pair in KNOWN_REASONING if pair[1] in template), None)


def reads_tools(template: str) -> bool:
    """Whether a template reads the `tools` it is given: one that never does renders no tool schemas (SmolLM2's and
    Llama 3's ChatML-like templates), so a model under it is never told its actions as tools."""
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:  # (a tag of transformers' own, e.g. {% generation %}: left to the checks after)
        return True
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def call_style(template: str) -> str | None:
    """How a template writes tool calls: "hermes" (<tool_call> blocks), "llama" (Llama 3.1's JSON with
    "parameters", results in the ipython role), or None."""
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama"
    return None


def parse_calls(style: str, text: str) -> list[tuple[str, dict]]:
    """The tool calls in a reply (after its reasoning) as (name, arguments); [] when it makes none. Raises CallError
    for a call that is not a JSON object with a name and object arguments."""
    if style == "hermes":
        blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.DOTALL)
        return [_call(block, "arguments") for block in blocks]
    text = text.strip().removeprefix("<|python_tag|>").strip()
    if not text.startswith("{"):
        return []
    calls, at = [], 0
    while at < len(text):  # one object, or several separated by ";" as Llama 3.1 may write them
        try:
            value, end = STRICT.raw_decode(text, at)  # (_call measures its depth)
        except (ValueError, RecursionError) as error:
            raise CallError(f"your tool call is not valid JSON ({_why(error)})") from None
        calls.append(_call(value, "parameters"))
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return calls


def read_call(name, arguments) -> tuple[str, dict]:
    """A text engine's native call (its name, and its arguments as the server sent them: a JSON string) as (name,
    arguments); CallError as parse_calls raises it."""
    return _call({"name": name, "arguments": arguments if arguments is not None else {}}, "arguments")


def _call(block, arguments_key: str) -> tuple[str, dict]:
    """One call's (name, arguments) from its JSON text (or already decoded value)."""
    try:
        block = _strict(block) if isinstance(block, str) else _shallow(block)
    except (ValueError, RecursionError) as error:
        raise CallError(f"your tool call is not valid JSON ({_why(error)})") from None
    if not isinstance(block, dict) or not isinstance(block.get("name"), str) or not block["name"]:
        raise CallError('your tool call must be a JSON object with a "name" and its arguments')
    name = block["name"] if FUNCTION_NAME.fullmatch(block["name"]) else quoted(block["name"])  # (as the message says it)
    arguments = block.get(arguments_key, block.get("arguments", block.get("parameters", {})))
    if isinstance(arguments, str):  # arguments as a JSON string, as OpenAI's API writes them
        try:
            arguments = _strict(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as error:
            raise CallError(f"the arguments of {name} are not valid JSON ({_why(error)})") from None
    if not isinstance(arguments, dict):
        raise CallError(f"the arguments of {name} must be a JSON object")
    return block["name"], arguments


def _refused_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{quoted(text)} is beyond the range of a number")
    return value


# JSON as RFC 8259 has it: Python's json.loads also takes NaN, Infinity and -Infinity, and reads 1e999 as inf
STRICT = json.JSONDecoder(parse_constant=_refused_constant, parse_float=_finite)


def _strict(text: str):
    """A tool call's JSON text as a value: strict JSON, at most MAX_DEPTH deep (ValueError or RecursionError)."""
    return _shallow(STRICT.decode(text))


def _shallow(value):
    """`value` itself; ValueError when its arrays and objects nest deeper than MAX_DEPTH (walked without
    recursion, so any depth is measured)."""
    level = [value]
    for _ in range(MAX_DEPTH + 1):
        level = [item for inner in level if isinstance(inner, (list, dict))
                 for item in (inner.values() if isinstance(inner, dict) else inner)]
        if not level:
            return value
    raise ValueError("nested too deeply")


def _why(error: Exception) -> str:
    """What a JSON decoder refused, in a few words (nesting too deep and numbers too long are refused too)."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at character {error.pos}"
    return "nested too deeply" if isinstance(error, RecursionError) else str(error).split(";")[0]


def without_calls(content: str, style: str | None, reasoning: Reasoning | None = None) -> str:
    """A calling turn's content without the calls' own text (a template, or a server's, writes them from tool_calls).
    `reasoning`: its tags; a call written inside the reasoning (before its closing tag, Reasoning.end, where templates
    split a reply) is the model's thought, not a call, and stays."""
    end = reasoning.end(content) if reasoning is not None else -1
    at = end + len(reasoning.close) if end >= 0 else 0
    head, content = content[:at], content[at:]
    if style == "hermes":
        content = re.sub(r"\s*<tool_call>.*?</tool_call>", "", content, flags=re.DOTALL)
    elif style == "llama" and content.strip().removeprefix("<|python_tag|>").lstrip().startswith("{"):
        content = ""
    return (head + content).rstrip()


def openai_calls(calls: list[tuple[str, dict]], turn: int) -> list[dict]:
    """Calls as an assistant message's `tool_calls` (OpenAI's format: arguments as a JSON string)."""
    return [{"id": f"call_{turn}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}} for i, (name, arguments) in enumerate(calls)]


def _for_template(messages: list[dict], style: str | None, reasoning: Reasoning | None = None) -> list[dict]:
    """Messages as chat templates take them: a calling turn's content without the calls' own text (a sampled reply
    holds its calls as text; the template writes them from tool_calls), its arguments as objects (OpenAI's API sends
    JSON strings, which templates such as Qwen2.5's would encode a second time)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = {**message, "content": without_calls(message.get("content") or "", style, reasoning)}
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", call))
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except (ValueError, RecursionError):
                        pass
                calls.append({**call, "function": function})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


CUT = "\n[... {} tokens cut ...]\n"  # what stands for the middle of an observation cut by --max-obs-tokens
CUT_MARK = re.compile(re.escape(CUT).replace(r"\{\}", r"(\d+)"))  # (the marker in a cut observation)


class ChatFormat:
    """The pieces of text a rollout needs from a chat template: the first prompt, the scaffolding around an
    observation (what follows an assistant's end-of-turn token up to the next generation prompt; a tool result's
    too, for --agent tools), the end-of-turn token, how a tool call is written, and the reasoning tags. Found once
    by rendering sentinel messages, so any template that renders history as a prefix works (ChatML/Qwen, Llama 3,
    ...). `template_kwargs` go to every rendering (Qwen3's enable_thinking). A tokenizer without a usable template
    is the user's model: it stops the script with one sentence."""

    _USER, _ASSISTANT, _NEXT = "\x02user-sentinel\x03", "\x02assistant-sentinel\x03", "\x02next-sentinel\x03"

    def __init__(self, tokenizer, template_kwargs: dict | None = None, reasoning_tags: tuple[str, str] | None = None,
                 max_obs_tokens: int = 0):
        if not getattr(tokenizer, "chat_template", None):
            raise SystemExit(f"{tokenizer.name_or_path} has no chat template; use an instruct/chat model (or set "
                             "tokenizer.chat_template) so that turns can be formatted")
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        self.max_obs_tokens = max_obs_tokens
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
        if "<|channel|>" in template:
            raise SystemExit(f"{tokenizer.name_or_path}'s chat template speaks OpenAI's harmony format (gpt-oss: a reply is "
                             "several messages on analysis, commentary and final channels), which this project cannot "
                             "lay out token by token: use another model")
        self.call_style, self.reasoning = call_style(template), reasoning_of(template, reasoning_tags)
        self.reads_tools = reads_tools(template)
        history = [{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ASSISTANT}]
        text = self.render(history + [{"role": "user", "content": self._NEXT}], add_generation_prompt=True)
        specials = sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True)
        after = text.index(self._ASSISTANT) + len(self._ASSISTANT)
        eot = next((s for s in specials if s and text.startswith(s, after)), None)
        if eot is None:
            raise SystemExit(f"cannot find the end-of-turn token after an assistant message in {tokenizer.name_or_path}'s "
                             "chat template: use a model whose template ends each turn with a special token")
        self._eot_text = eot
        self.end_of_turn = tokenizer.convert_tokens_to_ids(eot)
        self.observation_prefix, self.observation_suffix = self._around(text, after)
        # what the template strips off a message's ends (Llama 3's `| trim`), stripped off an observation alike
        padded = self.render(history + [{"role": "user", "content": " \n" + self._NEXT + "\n "}], add_generation_prompt=True)
        at = padded.index(self._NEXT)
        self._strip = (padded[at - 2:at] != " \n", padded[at + len(self._NEXT):at + len(self._NEXT) + 2] != "\n ")
        eos = tokenizer.eos_token_id
        self.stop_ids = {self.end_of_turn} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_of_turn
        generation = self.observation_suffix  # (the generation prompt ends it)
        self.opens_reasoning = self.reasoning is not None and \
            generation.rfind(self.reasoning.open) > generation.rfind(self.reasoning.close)
        self._tool_layout: tuple[str, str] | None = None
        self._tool_json = False  # the template writes a tool result as a JSON string (Llama 3.1's `| tojson`)

    def _around(self, text: str, after: int, sentinel: str = _NEXT) -> tuple[str, str]:
        """The text between the end-of-turn token at `after` and the next message's sentinel, and after it."""
        start = after + len(self._eot_text)
        split = text.index(sentinel)
        return text[start:split], text[split + len(sentinel):]

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(_for_template(messages, self.call_style, self.reasoning),
                                                  tools=tools or None,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """An episode's first prompt: its opening messages (rl/agent.py), the tools when given, and the generation
        prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def cut(self, text: str) -> tuple[str, int]:
        """--max-obs-tokens N: an observation (an env's answer, the first one too) of more than N tokens as its first
        and last N/2, cut where a token starts, with a marker between that says how many were cut (CUT); and the
        number cut, 0 where it was short enough (or N is 0: never cut). What is cut is gone from the conversation
        (messages) as from the tokens, so that a re-rendered prompt (--reasoning drop, --context) has what the
        policy saw."""
        if not self.max_obs_tokens or len(text.encode()) <= self.max_obs_tokens:  # (a token holds a byte at least)
            return text, 0
        starts = [start for start, _ in self.tokenizer(text, add_special_tokens=False,
                                                       return_offsets_mapping=True)["offset_mapping"]]
        over = len(starts) - self.max_obs_tokens
        if over <= 0:
            return text, 0
        head = self.max_obs_tokens // 2
        return text[:starts[head]] + CUT.format(over) + text[starts[len(starts) - (self.max_obs_tokens - head)]:], over

    def observation(self, text: str, role: str = "user") -> list[int]:
        """An env's answer wrapped in the template's scaffolding: a user turn, or (role "tool") a tool result."""
        return self.encode(self.wrap(text, role))

    def wrap(self, text: str, role: str = "user") -> str:
        """The text of observation(text, role): what the template renders after an assistant turn's end-of-turn token
        up to the next generation prompt."""
        if role == "tool":
            prefix, suffix = self.tool_layout()
            text = json.dumps(text, ensure_ascii=False) if self._tool_json else text
        else:
            prefix, suffix = self.observation_prefix, self.observation_suffix
            text = text.lstrip() if self._strip[0] else text
            text = text.rstrip() if self._strip[1] else text
        return prefix + text + suffix

    def text(self, sampled: list[int]) -> str:
        """The assistant's text as the env sees it (special tokens such as end-of-turn dropped)."""
        return self.tokenizer.decode(sampled, skip_special_tokens=True)

    def answer(self, reply: str) -> str | None:
        """The part of a reply after its reasoning block (the whole reply without one); None when the reply ends
        inside the block."""
        return reply if self.reasoning is None else self.reasoning.split(reply, self.opens_reasoning)[1]

    # -- tool calls (--agent tools)

    def check_tools(self) -> None:
        """Stops the script with one sentence when the template renders no tool schemas, or no tool calls this
        module can read."""
        if not self.reads_tools:
            raise SystemExit(f"{self.tokenizer.name_or_path}'s chat template renders no tool schemas (it never reads "
                             "`tools`), so --agent tools cannot give the model the env's actions: use --agent react")
        if self.call_style is None:
            raise SystemExit(f"{self.tokenizer.name_or_path}'s chat template renders no tool calls in a format this "
                             f"project reads ({' or '.join(CALL_STYLES)}: Qwen2.5/Qwen3's <tool_call> blocks, Llama 3.1's "
                             "JSON calls): use --agent react, or a model whose template supports tools")

    def parse_calls(self, answer: str) -> list[tuple[str, dict]]:
        self.check_tools()
        return parse_calls(self.call_style, answer)

    def call_text(self, name: str, arguments: dict) -> str:
        """The reply that makes this one call, as the template writes it (the experts' replies under --agent tools)."""
        user = [{"role": "user", "content": self._USER}]
        call = {"role": "assistant", "content": "", "tool_calls": openai_calls([(name, arguments)], 0)}
        opened = self.render(user, add_generation_prompt=True)
        text = self.render([*user, call])
        if not text.startswith(opened) or self._eot_text not in text[len(opened):]:
            raise SystemExit(f"{self.tokenizer.name_or_path}'s chat template does not render a tool call after its "
                             "generation prompt; use a model whose template supports tools")
        return text[len(opened):text.index(self._eot_text, len(opened))]

    def tool_layout(self) -> tuple[str, str]:
        """The scaffolding around a tool result: (what follows the calling turn's end-of-turn token, what follows the
        result up to the next generation prompt)."""
        if self._tool_layout is None:
            self.check_tools()
            calls = openai_calls([("sentinel", {})], 0)
            history = [{"role": "user", "content": self._USER},
                       {"role": "assistant", "content": self._ASSISTANT, "tool_calls": calls},
                       {"role": "tool", "tool_call_id": calls[0]["id"], "name": "sentinel", "content": self._NEXT}]
            text = self.render(history, add_generation_prompt=True)
            # (as HF's tojson writes it: Llama 3.1 renders a result `| tojson`, a string as a quoted JSON string)
            self._tool_json = self._NEXT not in text
            sentinel = json.dumps(self._NEXT, ensure_ascii=False) if self._tool_json else self._NEXT
            if sentinel not in text:
                raise SystemExit(f"{self.tokenizer.name_or_path}'s chat template does not render a tool result's "
                                 "content: use --agent react, or a model whose template supports tools")
            # (the calling turn's end-of-turn token is the last before the result: some templates render a calling
            # turn without its content, so the assistant sentinel may be absent)
            at = text.index(sentinel)
            self._tool_layout = self._around(text, text.rindex(self._eot_text, 0, at), sentinel)
        return self._tool_layout
