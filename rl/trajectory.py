"""The unit of data: a Trajectory (one episode, token for token), what an env call answers (EnvAnswer) and where a
rollout's time went (RolloutStats). rollout.py fills them; rl/ (batch, records, scores, metrics, data) reads them;
rollout.py re-exports Trajectory, where DESIGN names it.

A trajectory's tokens are its context: the token ids the engine continues for its next turn (engines read
`token_ids`), with a loss mask of 1 on the tokens the policy sampled and their sampler log-probs. In the append
layouts the context is the whole episode, and it is what trains. Where rl/context.py starts a new segment (--reasoning
drop: every turn; --context window or summary: where the kept history changes) the next prompt is the chat template's
rendering of what is kept, the context holds the latest segment only, and the episode trains as its segments
(`sequences`, a row each: `trained()`); what the next prompt keeps is rl/context.py's state, one field (`context`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import envs
from envs import StepResult
from rl.context import Kept
from rl.records import FORMAT, encode_array


class Sequence(NamedTuple):
    """A run of tokens as it trains: ids, the loss mask (1 on sampled tokens), the sampler's log-prob of each."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]


class EnvAnswer(NamedTuple):
    """An env call's answer as the rollout takes it in: its result (the first observation of a reset, a step's
    StepResult; None for a turn no env reads, a summary) or the exception it raised, its seconds, and the env's state
    key after it (None where the env cannot say, or the call failed)."""

    result: StepResult | str | Exception | None
    seconds: float
    state: str | None

    @classmethod
    def of(cls, env, method: str, *args) -> EnvAnswer:
        """An env call ("reset" or "step"), in the rollout's pool: its result, or the exception it raised (any env
        failure ends one trajectory, never the run), its seconds, the env's state key after it (None where the env
        cannot say; a key that fails to come is None, never an error: envs.state_key_of)."""
        start = time.perf_counter()
        try:
            result = getattr(env, method)(*args)
        except Exception as error:  # noqa: BLE001 - any env failure ends one trajectory, not the run
            result = error
        seconds = time.perf_counter() - start
        return cls(result, seconds, None if isinstance(result, Exception) else envs.state_key_of(env))


@dataclass
class Attempt:
    """--agent reflect: which attempt at its task an episode is, whether it is the last one (False when another
    followed it), and what the policy wrote after it failed, for the next attempt."""
    number: int = 1
    final: bool = True
    reflection: str | None = None


@dataclass
class Trajectory:
    env: str
    task_id: int
    group: int  # the n samples of one task share a group
    row: int  # index of this trajectory's env in the rollout
    messages: list[dict]
    # -- the context (see the module docstring)
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy is trained on
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each token (0 where loss_mask is 0)
    # -- each turn's
    horizon: int = 0  # the turn cap it played under
    turns: int = 0
    sampled: int = 0  # the tokens its turns sampled (rl/progress.py counts them)
    valid: list[bool] = field(default_factory=list)  # False where the env reported the turn's action not valid
    actions: list[str | None] = field(default_factory=list)  # what each turn sent to env.step (None: nothing, malformed)
    turn_rewards: list[float] = field(default_factory=list)  # the env's reward after each turn (its last is `reward`)
    # the env's state key before each turn and after the last (envs.Env.state_key: equal exactly when two episodes of
    # the task are in the same state; None where the env cannot say): GiGPO's anchor states (rl/advantages.py)
    states: list[str | None] = field(default_factory=list)
    # --max-staleness: the policy version that sampled each turn, the number of updates its weights had had
    versions: list[int] = field(default_factory=list)
    # --group-start fork: its first turns, played once for its group and copied into each of its episodes (rollout.py)
    prefix_turns: int = 0
    # -- the outcome
    reward: float = 0.0
    done: bool = False
    finish: str = ""  # "done" | "horizon" | "max_tokens" | "error"
    error: str | None = None
    success: bool = False
    invalid_actions: int = 0  # turns whose action the env reported as not valid (info["valid"] False)
    malformed: int = 0  # of those, turns whose reply held no action to take (no call, a bad call, cut inside reasoning)
    observations: int = 0  # the env's answers it saw (the first one too)
    cut_at: list[int] = field(default_factory=list)  # of those, the ones --max-obs-tokens cut (0: the first)
    # -- the layouts' and engines' own
    attempt: Attempt = field(default_factory=Attempt)  # --agent reflect's (rl/agent.py)
    tools: list[dict] | None = None  # --agent tools: the tools the model was given (OpenAI function schemas)
    # --reasoning drop, --context window, summary: each segment's tokens (its rendered prompt, the turns it extends it
    # by), the last one live (rl/context.py)
    sequences: list[Sequence] = field(default_factory=list)
    context: Kept = field(default_factory=Kept)  # what the next prompt holds (rl/context.py's state; every message)
    summary_spans: list[int] = field(default_factory=list)  # the sampled turns (runs of loss-mask 1) that were summaries
    prompt_tokens: list[int] = field(default_factory=list)  # each turn's prompt length (the context it was sampled in)
    usage: dict[str, float] = field(default_factory=dict)  # an API model's calls, tokens and cost (rl/api.py)

    def add(self, ids: list[int], logprobs: list[float] | None = None, trained: bool = False) -> None:
        """Append tokens to the context: sampled ones with their log-probs and trained=True, anything else untrained."""
        self.token_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.logprobs += logprobs if trained else [0.0] * len(ids)

    def restart(self, prompt: list[int]) -> None:
        """A new segment (rl/context.py): the next turn's context is `prompt` alone (the turns before it stay in
        `sequences`)."""
        self.token_ids, self.loss_mask, self.logprobs = [], [], []
        self.add(prompt)

    def keep_segment(self) -> None:
        """Record the live context as the last segment, after a turn was sampled in it: a new one, or where a turn was
        sampled in it before (before this turn's prompt, the first prompt_tokens[-1] tokens), in place of that one's."""
        live = Sequence(list(self.token_ids), list(self.loss_mask), list(self.logprobs))
        again = 1 in self.loss_mask[:self.prompt_tokens[-1]]
        self.sequences[-1:] = [live] if again else [*self.sequences[-1:], live]

    def prompt_messages(self) -> list[dict]:
        """The messages the next turn's prompt holds: all, or (--context window, summary) what the context keeps."""
        return self.context.prompt(self.messages)

    def fail(self, error: str) -> None:
        self.finish, self.error, self.reward = "error", error, 0.0

    @property
    def item_id(self) -> str:
        return f"{self.env}_{self.task_id}"

    @property
    def live(self) -> bool:
        return not self.finish

    def trained(self) -> list[Sequence]:
        """The sequences the episode trains as: drop's turns, or else the context."""
        return self.sequences or [Sequence(self.token_ids, self.loss_mask, self.logprobs)]

    @property
    def obs_cut(self) -> int:
        return len(self.cut_at)

    def cut(self, horizon: int) -> Trajectory:
        """The episode as it would have ended under a lower turn cap: the same turns up to it (nothing an
        episode sees depends on its cap), its reward the one after turn `horizon`, its invalid and malformed turns,
        prompts, observations and summaries those among them; tokens and messages are the whole episode's. An env failure after turn `horizon` is one
        the lower cap never met."""
        if self.turns <= horizon or len(self.turn_rewards) < horizon:
            return self
        samples = turns = 0  # (the sampled turns up to env turn `horizon`: its summaries before it too)
        while samples < len(self.prompt_tokens) and turns < horizon:
            turns += samples not in self.summary_spans
            samples += 1
        return replace(self, turns=horizon, reward=self.turn_rewards[horizon - 1], done=False, success=False,
                       finish="horizon", error=None, horizon=horizon, states=self.states[:horizon + 1],
                       invalid_actions=self.valid[:horizon].count(False), malformed=self.actions[:horizon].count(None),
                       prompt_tokens=self.prompt_tokens[:samples], observations=min(self.observations, horizon + 1),
                       cut_at=[i for i in self.cut_at if i <= horizon],
                       summary_spans=[s for s in self.summary_spans if s < samples])

    def log_record(self) -> dict:
        """The trajectory as a log record (rl/records.py), without what only training knows."""
        trained = self.trained()
        return {
            "log_format": FORMAT, "item_id": self.item_id, "task_id": self.task_id,
            "category": category(self.env, self.task_id), "group": self.group, "horizon": self.horizon,
            "reward": self.reward, "success": self.success, "turns": self.turns, "finish": self.finish,
            "error": self.error, "invalid_actions": self.invalid_actions, "malformed": self.malformed,
            "observations": self.observations, "obs_cut": self.obs_cut,
            **({"summary_spans": self.summary_spans} if self.summary_spans else {}),
            "turn_rewards": self.turn_rewards, "env_actions": self.actions,  # (what the env was sent: the viewer replays it)
            # (over every trained sequence; under --reasoning drop and --context window token_ids below are the last
            # segment's, as `segments` says)
            "tokens": sum(len(s.token_ids) for s in trained), "action_tokens": sum(sum(s.loss_mask) for s in trained),
            "segments": len(trained), "prompt_tokens": self.prompt_tokens,
            **({"summaries": len(self.summary_spans)} if self.summary_spans else {}),  # (summary_spans: which)
            # (reflect's; before the messages, where the viewer's index reads)
            **({"attempt": self.attempt.number, "final": self.attempt.final, "reflection": self.attempt.reflection}
               if self.attempt.number > 1 or not self.attempt.final else {}),
            "messages": self.messages,
            # the exact tokens, the [start, end) runs of loss-mask 1 (the sampled turns) among them, and
            # the sampler's log-prob of each of those tokens
            "token_ids": encode_array(self.token_ids, "i32"), "action_spans": spans(self.loss_mask),
            "sampled_logprobs": encode_array([p for p, m in zip(self.logprobs, self.loss_mask) if m], "f32"),
            **({"usage": self.usage} if self.usage else {}),
            **({"versions": self.versions} if self.versions else {}),
            **({"prefix_turns": self.prefix_turns} if self.prefix_turns else {}),
            **({"states": self.states} if any(key is not None for key in self.states) else {}),
        }

    def token_turns(self, samples: bool = False) -> list[int]:
        """The env turn of every token: each turn's index on its sampled tokens (the runs of loss-mask 1, a run per
        turn), -1 on everything else; a summary's tokens (--context summary) count as the turn they precede. With
        `samples`, the index of the sampled turn instead, summaries counted (what `versions` holds one of each)."""
        turns, sample, turn, at = [-1] * len(self.loss_mask), -1, -1, -1
        for i, trained in enumerate(self.loss_mask):
            if trained and (i == 0 or not self.loss_mask[i - 1]):
                sample += 1
                at = turn + 1
                turn += sample not in self.summary_spans
            if trained:
                turns[i] = sample if samples else at
        return turns

    def token_versions(self) -> list[int]:
        """The version of every token (--max-staleness): each sampled turn's on its tokens, -1 elsewhere."""
        return [self.versions[sample] if sample >= 0 else -1 for sample in self.token_turns(samples=True)]


def category(env: str, task_id: int) -> str | None:
    """The task's eval category, or None for an env unknown here (a result of one registered elsewhere, or a spec
    whose package or target is missing: envs.known)."""
    try:
        return envs.category(env, task_id)
    except (ValueError, LookupError):
        return None


def spans(mask: list[int]) -> list[list[int]]:
    """The [start, end) runs of 1 in a 0/1 mask."""
    runs, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append([start, i])
            start = None
    return runs


@dataclass
class RolloutStats:
    """Where a rollout's time went and what it sampled, for throughput metrics: rollout(stats=...) adds its own."""

    rollout_s: float = 0.0  # wall
    generate_s: float = 0.0  # inside the engine
    idle_s: float = 0.0  # waiting for envs with nothing to generate
    env_s: float = 0.0  # env time summed over calls, resets and steps
    env_calls: int = 0
    env_call_s: list[float] = field(default_factory=list)  # each call's seconds
    sampled_tokens: int = 0
    redrawn_groups: int = 0  # --dynamic-sampling: task groups without signal played again on new tasks
    redraw_rounds: int = 0  # the rounds that did

    def add(self, other: RolloutStats) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count(self, answer: EnvAnswer) -> None:
        """An env call."""
        self.env_s += answer.seconds
        self.env_calls += 1
        self.env_call_s.append(answer.seconds)
