"""Agent formats: how the conversation with an env is laid out around the policy's replies (the "agent
module" of AgentGym-RL). A format decides which messages open an episode and which part of a reply the
env reads; ChatFormat (rollout.py) stays the only place that turns messages into tokens, and every token
the policy is trained on is still exactly one it sampled.

    agent = make_agent("plan")
    messages = agent.opening(env, first_observation)     # instruction, ack, observation
    action = agent.read(fmt, env.name, reply)             # what the env is asked: action.text for env.step

- react (default): AgentGym's layout, "Thought: ... Action: ...": the env's instruction, its ack, the first
  observation; the env reads the whole reply. Byte-identical to the layout before formats existed.
- plan: long-horizon planning. The instruction is followed by PLAN_GUIDE: before its first action the
  agent writes a plan between <plan> and </plan>, and a new one in a later turn whenever the plan has to
  change. The plan is the policy's own sampled text in its reply (trained like any action token) and stays
  in the conversation, so every later turn sees it; the env reads the reply with its plan blocks removed,
  i.e. exactly what react would have sent. A reply whose plan is never closed leaves the env nothing to
  read (an invalid action, as any malformed reply). Blocks are matched case-insensitively and do not nest:
  a "<plan>" inside a plan ends at the first "</plan>", and a literal "<plan>" in an action (a WebArena
  `type` of that text) is taken for a plan.
- reflect: self-reflection across attempts (Reflexion, Shinn et al., 2023). An attempt is a react
  episode; after a failed one the policy continues that attempt's conversation with a short reflection
  (asked for by a user turn holding the final observation and REFLECT_ASK), and the next attempt on the
  same task opens with every reflection so far after the instruction (REFLECTIONS). An episode stops at its
  first success or after `attempts` attempts (rollout.py runs them). Each attempt is its own trajectory
  with its own reward; training compares an attempt with the same attempt of the task's other samples (its
  own group). Reflections are sampled by the policy and logged with the attempt they reflect on, but not
  trained: the reward that would judge one is the next attempt's, earned in another context than the one
  the reflection was sampled in, so its log-probs would not be the sampler's.

- tools: native tool calling. The env's actions are tools (envs/tools.py, OpenAI's function format) that the
  chat template renders into the first prompt; the instruction is followed by TOOLS_GUIDE; the model acts by
  calling one tool a turn, in its template's call format (rl/chat.py), and the env's answer comes back as a tool
  result. A reply the env cannot take as one call (no call, bad JSON, an unknown tool, a missing or mistyped
  argument, several calls) is answered with an observation that says what was wrong, without touching the env,
  and counts as an invalid action.

Every format reads a reply after its reasoning block (ChatFormat.answer): a reply cut off inside its reasoning
is answered as an invalid action, as a malformed one is, and the env never sees the reasoning.

LayoutArgs holds the flags that choose the layout (--agent, --attempts, --reasoning, --context, --reasoning-tags,
--chat-template-kwargs, --max-obs-tokens); make_agent turns the first four into the Agent an episode is played by (its
`context`, what a turn's prompt holds: rl/context.py), chat_format the others and a tokenizer into its ChatFormat.

Upstream's released code lays its conversations out as ReAct only; the planning, reflection and tool-calling
prompts here are this project's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import envs
from envs import tools as env_tools
from rl.advantages import ESTIMATORS, is_grouped, names
from rl.chat import CallError, ChatFormat, read_call
from rl.context import Context

PLAN_GUIDE = ("Before your first action, write a plan for the whole task, its steps in order, between <plan> and "
              "</plan>; then reply as instructed above. In a later turn, write a new <plan>...</plan> first only "
              "when the plan has to change.")
REFLECT_ASK = ("You did not complete the task. In two or three sentences, say what went wrong and what you will do "
               "differently in your next attempt. Do not write an action.")
REFLECTIONS = "You have tried this task before and failed. What you learned from those attempts:\n"
TOOLS_GUIDE = ("Do not write an Action line: act by calling exactly one of the tools you are given in each reply. You "
               "may think before the call.")
_PLAN = re.compile(r"<plan>.*?(?:</plan>|\Z)", re.DOTALL | re.IGNORECASE)
FORMATS = ("react", "plan", "reflect", "tools")


@dataclass(frozen=True)
class Action:
    """What a reply asks of the env: `text` for env.step, or `problem`, the observation that answers a reply the env
    never sees (an invalid action); `calls`, the one tool call the reply made (name, arguments), if it made one."""

    text: str | None = None
    problem: str | None = None
    calls: list[tuple[str, dict]] = field(default_factory=list)


@dataclass(frozen=True)
class Agent:
    name: str = "react"
    attempts: int = 1  # episodes per task for reflect; 1 for the others
    context: Context = Context()  # what a turn's prompt holds of the episode (rl/context.py: --context, --reasoning)

    def opening(self, env, observation: str, reflections: list[str] = ()) -> list[dict]:
        """The first three messages of an episode: the instruction, the env's ack, the first observation."""
        return [{"role": "user", "content": self.instruction(env, reflections)},
                {"role": "assistant", "content": env.ack}, {"role": "user", "content": observation}]

    def instruction(self, env, reflections: list[str] = ()) -> str:
        if self.name == "tools":
            return _after(env.instruction, TOOLS_GUIDE)
        if self.name == "plan":
            return _after(env.instruction, PLAN_GUIDE)
        if self.name == "reflect" and reflections:
            lines = "\n".join(f"Attempt {i}: {text.strip()}" for i, text in enumerate(reflections, 1))
            return _after(env.instruction, REFLECTIONS + lines)
        return env.instruction

    def tools(self, env) -> list[dict] | None:
        """The tools the model is given (OpenAI function schemas), None but for the tools format."""
        return env_tools.schemas(env.name) if self.name == "tools" else None

    def read(self, fmt, env_name: str, reply: str, native_calls: list[dict] | None = None) -> Action:
        """What the env is asked to do by a reply: its answer after the reasoning block (fmt.answer), as text (react,
        plan, reflect) or as the one tool call in it (tools: parsed by fmt in the template's format, or a text
        engine's native calls, [{"name", "arguments"}])."""
        answer = fmt.answer(reply)
        if answer is None:
            return Action(problem=f"Your reply ended inside its reasoning, before {fmt.reasoning.close}: no action was "
                                  "taken. Close your reasoning sooner, then act.")
        if self.name != "tools":
            return Action(text=self.env_text(answer))
        try:
            calls = ([read_call(call.get("name"), call.get("arguments")) for call in native_calls]
                     if native_calls else fmt.parse_calls(answer))
        except CallError as error:
            return Action(problem=f"Invalid tool call: {_sentence(error)} No action was taken.")
        if not calls:
            return Action(problem="Your reply calls no tool: call one of the tools to act.")
        if len(calls) > 1:
            return Action(problem=f"Your reply calls {len(calls)} tools, and this environment takes one action a turn: "
                                  "call one tool. No action was taken.")
        try:
            return Action(text=env_tools.action_text(env_name, *calls[0]), calls=calls)
        except env_tools.ToolCallError as error:
            return Action(problem=f"Invalid tool call: {_sentence(error)} No action was taken.", calls=calls)

    def env_text(self, reply: str) -> str:
        """The part of a reply's answer the env parses."""
        if self.name == "plan" and "<plan>" in reply.lower():
            return _PLAN.sub("", reply).lstrip()
        return reply

    def reflection_request(self, final_observation: str) -> str:
        """The user turn after a failed attempt that asks for a reflection."""
        return f"{final_observation}\n\n{REFLECT_ASK}"


REACT = Agent()


@dataclass
class LayoutArgs:
    """How an episode is laid out: train.py's flags (eval.py takes the same words as overrides of a run's own)."""

    agent: Literal["react", "plan", "reflect", "tools"] = "react"
    """how episodes are laid out (rl/agent.py): react, AgentGym's Thought/Action; plan, a plan written before the
    first action and revised when needed (trained like any action); reflect, up to --attempts attempts a task,
    each after a reflection on the failed ones (each attempt its own trajectory and reward); tools, the env's
    actions as native tool calls in the chat template's own format (rl/chat.py)"""
    reasoning_tags: tuple[str, str] | None = None
    """a reasoning model's block, which the env never reads (e.g. '<think>' '</think>'); default: the template's"""
    chat_template_kwargs: dict[str, str] = field(default_factory=dict)
    """options for the chat template's every rendering, e.g. --chat-template-kwargs enable_thinking false (Qwen3)"""
    reasoning: Literal["keep", "drop"] = "keep"
    """keep: one sequence an episode, every turn appended (earlier reasoning stays in the context); drop: each turn's
    prompt is the chat template's rendering so far (earlier reasoning gone), each turn its own sequence (grpo, rloo, gigpo)"""
    attempts: int = 3
    """--agent reflect: attempts a task gets (it stops at its first success)"""
    max_obs_tokens: int = 0
    """an observation of more than N tokens is cut to its first and last N/2, a marker between (so that one WebArena
    page cannot fill the budget; rollout/obs_cut counts them); 0: never"""
    context: str = "full"
    """what a turn's prompt holds (rl/context.py): full, the whole episode; window:K, the opening (instruction, first
    observation) and the last K turns; summary:M, after every M turns the policy summarizes, and the summary replaces
    the turns before it; each change of history starts a new sequence (grpo, rloo, gigpo)"""

    def check(self, env_name: str, algo: str | None = None) -> None:
        """Stop early, with what to do, on a layout that cannot work for this env and --algo (check_layout)."""
        if self.attempts < 1:
            raise SystemExit("--attempts must be at least 1")
        if self.max_obs_tokens and self.max_obs_tokens < 16:
            raise SystemExit(f"--max-obs-tokens {self.max_obs_tokens} would leave an observation almost nothing: give "
                             "0 (never cut) or at least 16")
        check_layout(self.agent, env_name, algo, Context.parse(self.context, self.reasoning))

    def make_agent(self) -> Agent:
        return make_agent(self.agent, self.attempts, Context.parse(self.context, self.reasoning))


LAYOUT_KEYS = ("agent", "reasoning_tags", "chat_template_kwargs", "reasoning", "max_obs_tokens", "context")  # (eval's)


def run_layout(flags, own: dict) -> dict:
    """eval.py's layout (LAYOUT_KEYS): each of its layout flags where given, else a run's own (`own`: its config, {}
    for any other model), else LayoutArgs' default; --chat-template-kwargs are added to a run's own."""
    default = LayoutArgs()
    layout = {key: getattr(flags, key) if getattr(flags, key) is not None else own.get(key, getattr(default, key))
              for key in LAYOUT_KEYS if key != "chat_template_kwargs"}
    return layout | {"reasoning_tags": tuple(layout["reasoning_tags"]) if layout["reasoning_tags"] else None,
                     "chat_template_kwargs": {**own.get("chat_template_kwargs", {}), **flags.chat_template_kwargs}}


def chat_format(tokenizer, layout: LayoutArgs) -> ChatFormat:
    """The format `layout`'s flags ask for: --chat-template-kwargs as the template's variables (envs.parse_options,
    true/false/none as Python's), under --agent tools a template whose calls rl/chat.py reads, else one sentence."""
    fmt = ChatFormat(tokenizer, envs.parse_options(layout.chat_template_kwargs, words=True), layout.reasoning_tags,
                     layout.max_obs_tokens)
    if layout.agent == "tools":
        fmt.check_tools()
    return fmt


def check_layout(name: str, env_name: str, algo: str | None = None, context: Context = Context()) -> None:
    """Stops the script with one sentence when format `name` cannot lay out this run: an env that declares no tools
    under tools; --algo sft, dpo or agentevol (learning --data as it is laid out) under plan or reflect; --reasoning
    drop, which trains a row a turn, or a --context that drops turns, which trains segments, with an estimator that
    needs an episode in one row or with reflect's attempts."""
    if name == "tools":
        try:
            env_tools.tools(env_name)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    if algo is not None and algo not in ESTIMATORS and name not in ("react", "tools"):  # (sft, dpo, agentevol)
        raise SystemExit(f"--agent {name} lays out the rollouts of RL ({', '.join(ESTIMATORS)}); {algo} learns "
                         "--data's conversations as they are laid out, so it plays them as react (or, for episodes of "
                         "tool calls, as --agent tools)")
    layout = (f"--algo {algo} " if algo is not None else "") + f"--agent {name}"
    if context.mode != "full" and (algo is not None and not is_grouped(algo) or name == "reflect"):
        raise SystemExit(f"--context {context} trains an episode as segments, each with its episode's advantage: a "
                         f"grouped estimator ({names(lambda e: e.grouped, 'or')}) and one attempt an episode; {layout} "
                         "needs --context full")
    if context.drop and (algo is not None and not is_grouped(algo) or name == "reflect"):
        raise SystemExit(f"--reasoning drop trains each turn as its own sequence with its episode's advantage: a grouped "
                         f"estimator ({names(lambda e: e.grouped, 'or')}) and one attempt an episode; {layout} "
                         "needs --reasoning keep")


def make_agent(name: str, attempts: int = 1, context: Context = Context()) -> Agent:
    """The format `name` (one of FORMATS) under `context`; `attempts` counts for reflect only."""
    if name not in FORMATS:
        raise ValueError(f"unknown agent format {name!r}; choose one of: {', '.join(FORMATS)}")
    if attempts < 1:
        raise ValueError("--attempts: at least 1")
    return Agent(name, attempts if name == "reflect" else 1, context)


def _after(instruction: str, text: str) -> str:
    """text as a paragraph of its own after the instruction (some instructions end with blank lines)."""
    return instruction.rstrip("\n") + "\n\n" + text


def _sentence(error: Exception) -> str:
    text = str(error).strip()
    return text if text.endswith((".", "!", "?")) else text + "."
