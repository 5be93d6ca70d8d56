"""Agent formats: how the conversation with an env is laid out around the policy's replies (the "agent
module" of AgentGym-RL). A format decides which messages open an episode and which part of a reply the
env reads; ChatFormat (rollout.py) stays the only place that turns messages into tokens, and every token
the policy is trained on is still exactly one it sampled.

    agent = make_agent("plan")
    messages = agent.opening(env, first_observation)     # instruction, ack, observation
    env.step(agent.env_text(reply))                       # the part of a reply the env parses

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

Upstream's released code lays its conversations out as ReAct only; the planning and reflection prompts
here are this project's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PLAN_GUIDE = ("Before your first action, write a plan for the whole task, its steps in order, between <plan> and "
              "</plan>; then reply as instructed above. In a later turn, write a new <plan>...</plan> first only "
              "when the plan has to change.")
REFLECT_ASK = ("You did not complete the task. In two or three sentences, say what went wrong and what you will do "
               "differently in your next attempt. Do not write an action.")
REFLECTIONS = "You have tried this task before and failed. What you learned from those attempts:\n"
_PLAN = re.compile(r"<plan>.*?(?:</plan>|\Z)", re.DOTALL | re.IGNORECASE)
FORMATS = ("react", "plan", "reflect")


@dataclass(frozen=True)
class Agent:
    name: str = "react"
    attempts: int = 1  # episodes per task for reflect; 1 for the others

    def opening(self, env, observation: str, reflections: list[str] = ()) -> list[dict]:
        """The first three messages of an episode: the instruction, the env's ack, the first observation."""
        return [{"role": "user", "content": self.instruction(env, reflections)},
                {"role": "assistant", "content": env.ack}, {"role": "user", "content": observation}]

    def instruction(self, env, reflections: list[str] = ()) -> str:
        if self.name == "plan":
            return _after(env.instruction, PLAN_GUIDE)
        if self.name == "reflect" and reflections:
            lines = "\n".join(f"Attempt {i}: {text.strip()}" for i, text in enumerate(reflections, 1))
            return _after(env.instruction, REFLECTIONS + lines)
        return env.instruction

    def env_text(self, reply: str) -> str:
        """The part of a reply the env parses."""
        if self.name == "plan" and "<plan>" in reply.lower():
            return _PLAN.sub("", reply).lstrip()
        return reply

    def reflection_request(self, final_observation: str) -> str:
        """The user turn after a failed attempt that asks for a reflection."""
        return f"{final_observation}\n\n{REFLECT_ASK}"


REACT = Agent()


def make_agent(name: str, attempts: int = 1) -> Agent:
    """The format `name` (one of FORMATS); `attempts` counts for reflect only."""
    if name not in FORMATS:
        raise ValueError(f"unknown agent format {name!r}; choose one of: {', '.join(FORMATS)}")
    if attempts < 1:
        raise ValueError("--attempts: at least 1")
    return Agent(name, attempts if name == "reflect" else 1)


def _after(instruction: str, text: str) -> str:
    """text as a paragraph of its own after the instruction (some instructions end with blank lines)."""
    return instruction.rstrip("\n") + "\n\n" + text
