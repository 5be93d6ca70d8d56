"""Multi-turn rollout: batched generation for every live trajectory, environments stepped in parallel.

    trajectories = rollout(engine, fmt, envs, task_ids, groups, horizon=..., max_new_tokens=..., max_tokens=...)
    trajectories = rollout(..., stats=RolloutStats())                 # where the time went, for throughput metrics
    trajectories = play(engine, fmt, envs, task_ids, horizon=..., ...)   # more tasks than envs: in turn
    stream = Stream(engine, fmt, envs, tasks_of, staleness=k, ...)       # train.py --max-staleness k: see Stream

One env per trajectory (the caller repeats each task n times). Each trajectory's next turn is
submitted to the engine; a finished turn's decoded text goes to env.step in a thread pool, and the
observation extends the trajectory, until the env says done, the turn cap (the horizon) is reached
or the token budget is spent. The outcome reward is the last step's reward, as upstream. With a
continuous engine (vLLM) a trajectory is resubmitted the moment its env answers, so a slow env holds
up only its own trajectory; with a round engine (HF; vLLM under --deterministic, whose batches must
repeat) every live trajectory's turn is generated together, submitted in row order, and the next round
waits for every env of this one. An engine that holds turns and generates nothing for STALL_S seconds
(a vLLM engine left asleep, say) stops the rollout with EngineStalled instead of leaving it waiting
forever (Watchdog).

Token-in, token-out: a Trajectory holds exactly the token ids the engine sampled. The model's own
tokens are never decoded and re-encoded; only new text (the first prompt and each observation,
wrapped in the chat template's scaffolding) is ever tokenized, so turn k+1's prompt is turn k's
prompt plus the sampled tokens plus the observation's tokens. The loss mask is 1 on sampled tokens
(including the end-of-turn token when the model sampled it) and 0 on everything else; a turn cut
off by the token limit is closed with an end-of-turn token that has mask 0, since the model did not
choose it. The final observation (after the last turn, or one that would leave no room for a
reply within max_tokens) is kept in `messages` but not appended as tokens: nothing after it is
trained, so it would only cost compute.

Limits: max_new_tokens caps the tokens sampled in a turn, exactly; max_tokens caps the whole
trajectory (train.py passes the smaller of --max-tokens and the model's context window). An episode
that runs out of room (a first prompt or an observation that leaves no room for a reply, or a turn
cut by the budget) ends cleanly with finish "max_tokens", never an error, and is scored like one cut
by the horizon: its reward is the last step's, trained with the advantage that reward earns, as
upstream keeps the env's reward for a response cut at max_response_length. An env call that raises
or hangs (envs/guard.py bounds each one) ends only its trajectory, with finish "error": it has no
outcome, and train.py leaves it out of the update.

Agent formats (rl/agent.py, `agent=`): the messages an episode opens with and what the env is asked by
each reply (react, plan; tools, the one tool call in it, answered as a tool result); reflect plays up to
agent.attempts attempts a task (`attempts`), the policy reflecting after each failed one by continuing that
attempt's tokens. The env reads a reply after its reasoning block (rl/chat.py); a reply with no action to
take (cut off inside its reasoning, no or a malformed tool call) is answered here, without the env, as an
invalid action. Every format keeps the token rules above.

--reasoning drop (ChatFormat.history) is the one layout that does not append: each turn's prompt is the
chat template's rendering of the conversation so far (a template that drops earlier reasoning is
followed), and each turn's prompt and sampled tokens are kept as a sequence of their own
(Trajectory.sequences), which train.py trains as a row each.

Engines (rl/engines/): HFEngine, VLLMEngine and ExpertEngine (the envs' scripted oracles). A text
engine (rl/engines/api.py's APIEngine: a model behind an HTTP API, for eval) returns the reply as text
(Sample.text): it becomes the assistant message exactly as a decoded turn would, and no tokens are
appended, so such a trajectory's token_ids stay empty.

Where this differs from upstream's rollout (AgentGym-RL's vLLMRollout.generate_sequences) on purpose:
- Upstream re-renders the whole message list with the chat template every round and tokenizes it,
  so the trained tokens are a re-encoding of the sampled text (not always the same ids, and a
  template that rewrites history, like Qwen3's, changes earlier turns). Here tokens are appended,
  never re-encoded.
- Upstream makes one batched generate call per round and steps every env before the next round.
  With vLLM, a trajectory's next turn starts as soon as its own env answers, so one slow env (a
  browser page, a search call) no longer leaves the GPU idle; turn caps, token budgets, the layout
  and the rewards are the same. The HF engine keeps rounds (one batched call each).
- Upstream's loop is synchronous only. Stream (train.py --max-staleness k) goes on playing the next k steps' tasks
  while the trainer updates, each turn recording the policy version that sampled it; k = 0 is the synchronous
  loop exactly.
- Upstream sleeps `send_interval` (1 s) before every round's env steps (pacing for its HTTP env
  servers); envs here are in-process, so there is no pause.
"""

from __future__ import annotations

import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Callable

import envs
from envs import Env, StepResult
from rl.agent import REACT, Agent
from rl.chat import ChatFormat, openai_calls  # (ChatFormat: rollout's callers import it from here too)
from rl.records import FORMAT, encode_array
from rl.engines import Sample
from rl.engines.expert import ExpertEngine
from rl.engines.hf import HFEngine  # noqa: F401 - the engines rollouts run on, imported from here too
from rl.engines.vllm import VLLMEngine  # noqa: F401 - (as HFEngine)

# ----------------------------------------------------------------------------------------------
# Data

ATTEMPT_GROUPS = 1 << 20  # reflect: attempt a's group is its task group + (a - 1) x this (see attempts)
# A rollout stops when its engine holds submitted turns and generates nothing for this long (Watchdog): longer
# than any prefill and token of a working engine, however slow
STALL_S = 600.0
# Env calls at once: a thread per env up to this many (an env call mostly waits, on a browser, a server or a
# simulator's process, so a slow env must not hold up another's call behind it; 32 had a step's 64 episodes queue)
ENV_THREADS = 256


@dataclass
class Trajectory:
    env: str
    task_id: int
    group: int  # the n samples of one task share a group
    row: int  # index of this trajectory's env in the rollout
    messages: list[dict]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy is trained on
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each token (0 where loss_mask is 0)
    horizon: int = 0  # the turn cap it played under
    turns: int = 0
    invalid_actions: int = 0  # turns whose action the env reported as not valid (info["valid"] False)
    valid: list[bool] = field(default_factory=list)  # each turn's: False where the env reported it not valid
    malformed: int = 0  # of those, turns whose reply held no action to take (no call, a bad call, cut inside reasoning)
    actions: list[str | None] = field(default_factory=list)  # what each turn sent to env.step (None: nothing, malformed)
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)  # the env's reward after each turn (its last is `reward`)
    done: bool = False
    finish: str = ""  # "done" | "horizon" | "max_tokens" | "error"
    error: str | None = None
    success: bool = False
    attempt: int = 1  # reflect: which attempt at the task this is (rl/agent.py)
    final: bool = True  # reflect: False when another attempt followed this one
    reflection: str | None = None  # reflect: what the policy wrote after this attempt failed
    usage: dict[str, float] = field(default_factory=dict)  # an API model's calls, tokens and cost (rl/engines/api.py)
    tools: list[dict] | None = None  # --agent tools: the tools the model was given (OpenAI function schemas)
    # --reasoning drop: each turn's own sequence (the template's rendering of the conversation before it, then the
    # turn's sampled tokens), as (token ids, loss mask, log-probs); token_ids & co. then hold the latest turn's
    sequences: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)
    # --max-staleness (Stream): the policy version that sampled each turn, the number of updates its weights had had
    versions: list[int] = field(default_factory=list)
    # the env's state key before each turn and after the last (envs.Env.state_key: equal exactly when two episodes of
    # the task are in the same state; None where the env cannot say): GiGPO's anchor states (rl/advantages.py)
    states: list[str | None] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float] | None = None, trained: bool = False) -> None:
        """Append tokens: sampled ones with their log-probs and trained=True, anything else untrained."""
        self.token_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.logprobs += logprobs if trained else [0.0] * len(ids)

    def fail(self, error: str) -> None:
        self.finish, self.error, self.reward = "error", error, 0.0

    @property
    def item_id(self) -> str:
        return f"{self.env}_{self.task_id}"

    @property
    def live(self) -> bool:
        return not self.finish

    def cut(self, horizon: int) -> Trajectory:
        """The episode as it would have ended under a lower turn cap: the same turns up to it (nothing an
        episode sees depends on its cap), its reward the one after turn `horizon`, its invalid and malformed turns
        those among them; tokens and messages are the whole episode's. An env failure after turn `horizon` is one
        the lower cap never met."""
        if self.turns <= horizon or len(self.turn_rewards) < horizon:
            return self
        return replace(self, turns=horizon, reward=self.turn_rewards[horizon - 1], done=False, success=False,
                       finish="horizon", error=None, horizon=horizon, states=self.states[:horizon + 1],
                       invalid_actions=self.valid[:horizon].count(False), malformed=self.actions[:horizon].count(None))

    def log_record(self) -> dict:
        """The trajectory as a log record (rl/records.py), without what only training knows."""
        return {
            "log_format": FORMAT, "item_id": self.item_id, "task_id": self.task_id,
            "category": category(self.env, self.task_id), "group": self.group, "horizon": self.horizon,
            "reward": self.reward, "success": self.success, "turns": self.turns, "finish": self.finish,
            "error": self.error, "invalid_actions": self.invalid_actions, "malformed": self.malformed,
            "turn_rewards": self.turn_rewards, "env_actions": self.actions,  # (what the env was sent: the viewer replays it)
            # (--reasoning drop: over every turn's sequence; token_ids below are the last turn's, `turn_sequences` says so)
            "tokens": sum(len(ids) for ids, _, _ in self.sequences) if self.sequences else len(self.token_ids),
            "action_tokens": sum(sum(mask) for _, mask, _ in self.sequences) if self.sequences else sum(self.loss_mask),
            **({"turn_sequences": len(self.sequences)} if self.sequences else {}),
            **({"attempt": self.attempt, "final": self.final, "reflection": self.reflection} if self.attempt > 1 or
               not self.final else {}),  # (reflect's; before the messages, where the viewer's index reads)
            "messages": self.messages,
            # the exact tokens, the [start, end) runs of loss-mask 1 (the sampled turns) among them, and
            # the sampler's log-prob of each of those tokens
            "token_ids": encode_array(self.token_ids, "i32"), "action_spans": spans(self.loss_mask),
            "sampled_logprobs": encode_array([p for p, m in zip(self.logprobs, self.loss_mask) if m], "f32"),
            **({"usage": self.usage} if self.usage else {}),
            **({"versions": self.versions} if self.versions else {}),
            **({"states": self.states} if any(key is not None for key in self.states) else {}),
        }

    def token_turns(self) -> list[int]:
        """The turn of every token: each turn's index on its sampled tokens (the runs of loss-mask 1, a run per turn),
        -1 on everything else."""
        turns, turn = [-1] * len(self.loss_mask), -1
        for i, trained in enumerate(self.loss_mask):
            if trained and (i == 0 or not self.loss_mask[i - 1]):
                turn += 1
            if trained:
                turns[i] = turn
        return turns

    def token_versions(self) -> list[int]:
        """The version of every token (Stream's trajectories): each turn's on its sampled tokens, -1 elsewhere."""
        return [self.versions[turn] if turn >= 0 else -1 for turn in self.token_turns()]


def category(env: str, task_id: int) -> str | None:
    """The task's eval category, or None for an env not in envs.ENVS here (a result of one registered elsewhere)."""
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

    def add(self, other: RolloutStats) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count(self, timed: list) -> None:
        """Env calls, each as (its result, its seconds)."""
        self.env_s += sum(seconds for _, seconds in timed)
        self.env_calls += len(timed)
        self.env_call_s += [seconds for _, seconds in timed]


# ----------------------------------------------------------------------------------------------
# The rollout loop


def rollout(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int], *,
            horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent = REACT,
            pool: ThreadPoolExecutor | None = None, stats: RolloutStats | None = None,
            progress: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """Play one episode per env: environments[i] plays task_ids[i], in group groups[i], for at most
    `horizon` turns, laid out by `agent` (rl/agent.py; reflect plays up to agent.attempts attempts, each a
    trajectory, see attempts()). `progress`, when given, is called with the counts of episodes that ended and of
    turns played since its last call (a long episode shows as turns before it ends). `stats`, when given,
    receives the rollout's timing and token counts (RolloutStats)."""
    assert len(environments) == len(task_ids) == len(groups)
    if agent.attempts > 1:
        return attempts(engine, fmt, environments, task_ids, groups, horizon=horizon, max_new_tokens=max_new_tokens,
                        max_tokens=max_tokens, agent=agent, pool=pool, stats=stats, progress=progress)
    return _episodes(engine, fmt, environments, task_ids, groups, [[] for _ in task_ids], horizon=horizon,
                     max_new_tokens=max_new_tokens, max_tokens=max_tokens, agent=agent, pool=pool, stats=stats,
                     progress=progress)


def attempts(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int], *,
             horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent, pool: ThreadPoolExecutor | None = None,
             stats: RolloutStats | None = None, progress: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """Reflect's episodes: attempt after attempt at each task until it succeeds or agent.attempts are played.
    After a failed attempt the policy writes a reflection (reflect()), and the task's next attempt opens with
    all of its reflections. Returns every attempt's trajectory, attempt 1's first; an attempt's group is
    its task group's, moved by the attempt (group + (attempt - 1) x ATTEMPT_GROUPS), so that GRPO compares
    it with the same attempt of the other samples, and no attempt's group meets another task's (play's
    later rollouts number their groups on). An attempt that ended in an env failure ends its
    episode. `progress` counts episodes (a task's attempts together) and every attempt's turns."""
    reflections: list[list[str]] = [[] for _ in task_ids]
    rows, played, clock = list(range(len(task_ids))), [], RolloutStats()
    if isinstance(engine, ExpertEngine):  # (it keys its experts by env row, which attempts renumber; and never reflects)
        raise ValueError("the envs' scripted experts do not reflect: play them with --agent react")
    if max(groups, default=0) >= ATTEMPT_GROUPS:
        raise ValueError(f"reflect numbers its attempts' groups from {ATTEMPT_GROUPS}: task groups must stay below")
    for attempt in range(1, agent.attempts + 1):
        attempt_clock = RolloutStats()
        batch = _episodes(engine, fmt, [environments[r] for r in rows], [task_ids[r] for r in rows],
                          [groups[r] + (attempt - 1) * ATTEMPT_GROUPS for r in rows], [reflections[r] for r in rows],
                          horizon=horizon, max_new_tokens=max_new_tokens, max_tokens=max_tokens, agent=agent, pool=pool,
                          stats=attempt_clock, progress=(lambda _, turns: progress(0, turns)) if progress else None)
        for traj in batch:
            traj.attempt = attempt
        played += batch
        failed = [(r, t) for r, t in zip(rows, batch) if not t.success and t.finish != "error"]
        if attempt < agent.attempts:
            start = time.perf_counter()
            written = reflect(engine, fmt, [t for _, t in failed], agent, max_new_tokens, max_tokens, attempt_clock)
            attempt_clock.rollout_s += time.perf_counter() - start  # (reflecting is rollout time spent generating)
            attempt_clock.generate_s += time.perf_counter() - start
            for (r, traj), text in zip(failed, written):
                traj.reflection, traj.final = text, text is None
                if text is not None:
                    reflections[r].append(text)
        clock.add(attempt_clock)
        going_on = [r for r, t in failed if not t.final]
        if progress is not None:
            progress(len(rows) - len(going_on), 0)
        rows = going_on
        if not rows:
            break
    if stats is not None:
        stats.add(clock)
    return played


def reflect(engine, fmt: ChatFormat, failed: list[Trajectory], agent: Agent, max_new_tokens: int,
            max_tokens: int, clock: RolloutStats | None = None) -> list[str | None]:
    """Each failed attempt's reflection: the policy continues the attempt's conversation after a user turn with
    its final observation and the request (agent.reflection_request), for at most max_new_tokens tokens within
    max_tokens. None where there is no room for one, the attempt never got to act, the engine failed or the
    reply was empty. An API model's usage for it counts on the attempt; the tokens sampled, on `clock`."""
    asks: list[Trajectory | None] = []
    for traj in failed:
        asks.append(None)
        if traj.turns < 1 or traj.messages[-1]["role"] != "user":
            continue  # (the final observation of an attempt that acted is never in its tokens: see _observe)
        request = agent.reflection_request(traj.messages[-1]["content"])
        messages = [*traj.messages[:-1], {"role": "user", "content": request}]
        ask = Trajectory(traj.env, traj.task_id, traj.group, traj.row, messages,
                         token_ids=traj.token_ids + fmt.observation(request), turns=traj.turns)
        limit = min(max_new_tokens, _room(ask, max_tokens))
        if limit >= 1:
            asks[-1] = ask
            engine.submit(ask, limit)
    texts: dict[int, str] = {}
    row = {id(ask): i for i, ask in enumerate(asks) if ask is not None}  # (by identity, not by comparing trajectories)
    watchdog = Watchdog(engine)
    try:
        while engine.pending:
            watchdog.check()
            for ask, sample in engine.poll():
                _add_usage(failed[row[id(ask)]], sample)
                if clock is not None:
                    clock.sampled_tokens += len(sample.token_ids)
                # (the reflection after its reasoning block; none for a failed request, a full context window, an
                # empty reply or one cut off inside its reasoning)
                text = (fmt.answer(_reply(fmt, sample)) or "") if sample.error is None and sample.finish is None else ""
                if text.strip():
                    texts[id(ask)] = text
    finally:
        engine.abort()
    return [texts.get(id(ask)) if ask is not None else None for ask in asks]


def _episodes(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int],
              reflections: list[list[str]], *, horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent,
              pool: ThreadPoolExecutor | None, stats: RolloutStats | None,
              progress: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """One episode per env (see rollout), each opening with its past reflections (reflect's; else none)."""
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=min(ENV_THREADS, len(environments)))
    clock = RolloutStats()
    begin = time.perf_counter()
    stepping: dict[Future, Trajectory] = {}  # env steps under way
    try:
        # -- reset every env in parallel; the first observation completes each prompt
        firsts = list(pool.map(_called, environments, ["reset"] * len(environments), task_ids))
        clock.count([(first, seconds) for first, seconds, _ in firsts])
        trajectories = [_start(fmt, agent, row, env, task, group, first, horizon, past)
                        for row, (env, task, group, first, past)
                        in enumerate(zip(environments, task_ids, groups, firsts, reflections))]
        clock.idle_s += time.perf_counter() - begin

        ready = [t for t in trajectories if t.live]  # waiting to be submitted for their next turn
        ended = played = 0
        watchdog = Watchdog(engine)
        while ready or stepping or engine.pending:
            watchdog.check()
            if progress is not None:
                now, turns = sum(not t.live for t in trajectories), sum(t.turns for t in trajectories)
                if (now, turns) != (ended, played):
                    progress(now - ended, turns - played)
                    ended, played = now, turns
            for traj in ready:
                limit = min(max_new_tokens, _room(traj, max_tokens))
                if limit < 1:  # a first prompt that leaves no room for a reply
                    traj.finish = "max_tokens"
                else:
                    engine.submit(traj, limit)
            if engine.pending:  # a round engine answers every submitted turn, vLLM the ones that finished
                _generate(engine, fmt, agent, environments, pool, stepping, clock)
            ready = _collect(engine, fmt, stepping, clock, max_tokens)
        for traj in trajectories:
            if traj.live:
                traj.finish = "horizon"
        if progress is not None and len(trajectories) > ended:
            progress(len(trajectories) - ended, sum(t.turns for t in trajectories) - played)
        return trajectories
    finally:  # stopped half-way (an exception), nothing may spill into the next rollout
        engine.abort()
        wait(stepping)
        if own_pool:
            pool.shutdown(wait=True)
        clock.rollout_s = time.perf_counter() - begin
        if stats is not None:
            stats.add(clock)


def play(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int] | None = None, *,
         horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent = REACT, pool: ThreadPoolExecutor | None = None,
         progress: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """Any number of episodes on a fixed set of envs: rollouts of as many at once as there are envs,
    in order, until every task id is played. `progress` is called as turns are played and episodes end
    (see rollout; on_bar shows them on a tqdm bar). Groups default to one per episode."""
    groups = list(range(len(task_ids))) if groups is None else groups
    trajectories: list[Trajectory] = []
    for start in range(0, len(task_ids), len(environments)):
        count = min(len(environments), len(task_ids) - start)
        trajectories += rollout(engine, fmt, environments[:count], task_ids[start:start + count],
                                groups[start:start + count], horizon=horizon, max_new_tokens=max_new_tokens,
                                max_tokens=max_tokens, agent=agent, pool=pool, progress=progress)
    return trajectories


def on_bar(bar) -> Callable[[int, int], None]:
    """A progress callback for play() and rollout() that shows on a tqdm bar: episodes as its count, the turns
    played so far beside it (long episodes, such as upstream's 20-30 turns of 512 tokens, move it before the
    first one ends)."""
    turns = 0

    def advance(episodes: int, played: int) -> None:
        nonlocal turns
        turns += played
        bar.set_postfix_str(f"{turns} turns", refresh=False)
        bar.update(episodes)

    return advance


class Stream:
    """Rollouts that go on while the trainer updates: train.py's asynchronous loop (--max-staleness k).

        stream = Stream(engine, fmt, environments, tasks_of, staleness=2, first=1, last=steps, ...)
        for step in ...:
            trajectories = stream.take(step)   # set `step`, complete; the later sets go on being played
            stream.advance()                   # every turn under way finished: the engine holds nothing
            ... update (stream.advance between its micro-batches, when stream.meanwhile), sync ...
            stream.resume(step)                # the engine now has version `step`

    Set j is training step j's tasks (`tasks_of(j)`: task ids, groups, turn cap), as the synchronous loop plays
    them, and step j trains exactly set j, so the data cursor is the step. A set's turns begin once the engine has
    the policy version j - 1 - k, the weights after update j - 1 - k (version v: the weights after v updates), so
    at most k + 1 sets are under way, each on its own block of len(environments) / (k + 1) envs; its envs are reset
    as soon as the block is free (set j - k - 1 taken), a reset (a page load, a simulator's start) sampling nothing.
    A turn is sampled by the version the engine has when it is generated, recorded in Trajectory.versions; a
    long episode goes on under newer weights (a partial rollout). Since set j is trained at update j and its
    first turn was sampled by version >= j - 1 - k, no trained token is more than k versions older than the
    weights it updates: the bound holds by construction, whatever the envs' latencies, and nothing is dropped.
    With k = 0 a set starts only after the previous update, exactly as the synchronous loop (tests check that
    the runs are equal; under --horizon auto its cap is decided one step earlier, from the steps finished when the
    set's envs reset: rl/horizon.known_before).

    The engine's weights change only between `advance` and `resume`. `advance` submits the turns of trajectories
    whose env has answered and lets every turn under way finish, so that each turn is sampled by one version whole:
    new weights never meet a half-generated turn, nor KV computed by the old ones (the sync drops the prefix cache).
    The env steps it starts go on during the update. An engine with weights of its own that stays awake through
    the update (`meanwhile`: vLLM without sleep mode, a rollout server; not HF, which samples with the trainer's
    own weights, nor an engine that rounds) is also advanced between the update's micro-batches, still with the
    weights before the update, so an env that answers mid-update waits a micro-batch, not the whole update, for
    its next turn; a rollout server generates on its own devices all along.

    A round engine (HF, vLLM under --deterministic) plays every live trajectory of every set in one round and
    waits for all their envs, so a run is replayable; a continuous one (vLLM) resubmits a trajectory the moment
    its env answers.
    """

    def __init__(self, engine, fmt: ChatFormat, environments: list[Env],
                 tasks_of: Callable[[int], tuple[list[int], list[int], int]], *, staleness: int, first: int, last: int,
                 max_new_tokens: int, max_tokens: int, agent: Agent = REACT, pool: ThreadPoolExecutor | None = None,
                 reseed: Callable[[int], None] | None = None):
        if len(environments) % (staleness + 1):
            raise ValueError(f"{len(environments)} envs do not split into {staleness + 1} sets' blocks")
        if agent.attempts > 1:
            raise ValueError("reflect's attempts depend on each other's reflections: play it with the synchronous loop")
        self.engine, self.fmt, self.environments, self.tasks_of = engine, fmt, environments, tasks_of
        self.staleness, self.last, self.agent = staleness, last, agent
        self.max_new_tokens, self.max_tokens, self.reseed = max_new_tokens, max_tokens, reseed
        self.block = len(environments) // (staleness + 1)
        self.meanwhile = engine.continuous and not getattr(engine, "sleep_mode", False)  # (see advance)
        self.pool = pool or ThreadPoolExecutor(max_workers=min(ENV_THREADS, len(environments)))
        self.version = first - 1  # the engine's weights: those after this many updates
        self.opened = first - 1  # the last set started
        self.sets: dict[int, list[Trajectory | None]] = {}  # set -> its trajectories (None while its env resets)
        self.holds: dict[int, int] = {}  # block of envs -> the set it plays
        self.ready: list[Trajectory] = []  # waiting to be submitted for their next turn
        self.stepping: dict[Future, Trajectory] = {}
        self.resetting: dict[Future, tuple[int, int, int, int]] = {}  # -> (set, index, task, group)
        self.clock = RolloutStats()

    def take(self, j: int, progress: Callable[[int, int], None] | None = None) -> list[Trajectory]:
        """Play until set j is complete, and return it in row order (the other sets go on later). `progress`: set
        j's ended episodes and the turns played, as rollout's."""
        begin, watchdog = time.perf_counter(), Watchdog(self.engine)
        ended = played = 0
        try:
            self._open()
            if j not in self.sets:
                raise ValueError(f"set {j} is not under way: it starts with version {j - 1 - self.staleness}, and the "
                                 f"engine has {self.version} (sets are taken in order, each once)")
            while True:
                self._open()
                if progress is not None:
                    now, turns = self._counts(j)
                    if (now, turns) != (ended, played):
                        progress(now - ended, turns - played)
                        ended, played = now, turns
                if self._complete(j):
                    return sorted(self.sets.pop(j), key=lambda t: t.row)
                watchdog.check()
                self._submit()
                if self.engine.pending:
                    _generate(self.engine, self.fmt, self.agent, self.environments, self.pool, self.stepping,
                              self.clock, self.version)
                self._collect()
        finally:
            self.clock.rollout_s += time.perf_counter() - begin

    def spent(self, stats: RolloutStats) -> None:
        """Add where the loop's time went since the last call (takes and advances) to `stats`."""
        stats.add(self.clock)
        self.clock = RolloutStats()

    def before_update(self) -> None:
        """Empty an engine on the trainer's device (all but a rollout server, which generates through the update)."""
        if not self.engine.apart:
            self.advance()

    def before_sync(self) -> None:
        """Finish the turns the engine holds with the weights that began them; an engine that samples with the
        trainer's own weights (HF's) emptied before the update, which changed them."""
        if not self.engine.on_trainer_weights:
            self.advance()

    def advance(self) -> None:
        """Generate the next turn of every trajectory whose env has answered (a round engine waits for every env
        under way: one round) and finish every turn under way, their env steps started (they go on during the
        update): the engine then holds nothing, and its weights may change."""
        begin, watchdog = time.perf_counter(), Watchdog(self.engine)
        try:
            self._open()
            self._collect(idle=False)
            self._submit()
            while self.engine.pending:
                watchdog.check()
                _generate(self.engine, self.fmt, self.agent, self.environments, self.pool, self.stepping, self.clock,
                          self.version)
        finally:
            self.clock.rollout_s += time.perf_counter() - begin

    def resume(self, version: int) -> None:
        """The engine has the weights after `version` updates: later turns are sampled by them, and the sets whose
        turns they allow begin them."""
        self.version = version

    def close(self) -> None:
        """Stop: drop what the engine holds and wait for the env calls under way (nothing spills into what follows;
        the unfinished sets are lost, as a resumed run replays them)."""
        self.engine.abort()
        wait([*self.stepping, *self.resetting])
        self.stepping.clear()
        self.resetting.clear()

    # -- the loop's parts

    def _open(self) -> None:
        """Start every set whose block of envs is free (the set k + 1 before it was taken): reset its envs, in the
        pool, as turns go on. A reset samples nothing; its turns wait for their version (_submit)."""
        while self.opened < self.last and self.opened + 1 - (self.staleness + 1) not in self.sets:
            j = self.opened = self.opened + 1
            task_ids, groups, horizon = self.tasks_of(j)
            if len(task_ids) > self.block:
                raise ValueError(f"set {j} has {len(task_ids)} episodes, more than its block of {self.block} envs")
            if self.reseed is not None:  # (--deterministic: the set's samples depend on its seed and the weights)
                self.reseed(j)
            self.sets[j] = [None] * len(task_ids)
            self.holds[(j - 1) % (self.staleness + 1)] = j
            for i, (task, group) in enumerate(zip(task_ids, groups)):
                row = (j - 1) % (self.staleness + 1) * self.block + i
                self.resetting[self.pool.submit(_called, self.environments[row], "reset", task)] = (j, i, task, group, horizon)

    def _submit(self) -> None:
        """Submit the next turn of every trajectory ready for one, but those of a set whose turns may not begin yet
        (set j: before version j - 1 - k; they wait, reset)."""
        held = []
        for traj in self.ready:
            limit = min(self.max_new_tokens, _room(traj, self.max_tokens))
            if self.holds[traj.row // self.block] > self.version + 1 + self.staleness:
                held.append(traj)
            elif limit < 1:  # a first prompt that leaves no room for a reply
                traj.finish = "max_tokens"
            else:
                self.engine.submit(traj, limit)
        self.ready = held

    def _collect(self, idle: bool = True) -> None:
        """Take in the env answers (resets and steps) as rollout's _collect does: while the engine has work, those
        that came; otherwise wait, for the first (continuous) or for all (a round's barrier, also when not `idle`:
        a round engine's rounds never depend on timing); not `idle` (advance), a continuous engine waits for none."""
        waiting = [*self.resetting, *self.stepping]
        if not waiting or (self.engine.pending and not self.engine.continuous):
            return
        if self.engine.pending or (self.engine.continuous and not idle):
            answered = [future for future in waiting if future.done()]
        else:
            start = time.perf_counter()
            answered = wait(waiting, return_when=FIRST_COMPLETED if self.engine.continuous else ALL_COMPLETED).done
            self.clock.idle_s += time.perf_counter() - start
        for future in sorted(answered, key=self._row):  # row order: a round engine's batch order
            if future in self.resetting:
                j, i, task, group, horizon = self.resetting.pop(future)
                row = self._row(future, (j, i))
                first = future.result()
                self.clock.count([first[:2]])
                traj = self.sets[j][i] = _start(self.fmt, self.agent, row, self.environments[row], task, group, first,
                                                horizon, [])
                if traj.live:
                    self.ready.append(traj)
            elif _taken_in(self.fmt, traj := self.stepping.pop(future), future.result(), self.clock, self.max_tokens):
                self.ready.append(traj)

    def _row(self, future: Future, where: tuple[int, int] | None = None) -> int:
        if future in self.stepping:
            return self.stepping[future].row
        j, i = where or self.resetting[future][:2]
        return (j - 1) % (self.staleness + 1) * self.block + i

    def _complete(self, j: int) -> bool:
        return j in self.sets and all(t is not None and not t.live for t in self.sets[j])

    def _counts(self, j: int) -> tuple[int, int]:
        """Set j's ended episodes and turns played."""
        started = [t for t in self.sets[j] if t is not None]
        return sum(not t.live for t in started), sum(t.turns for t in started)


def _generate(engine, fmt: ChatFormat, agent: Agent, environments: list[Env], pool: ThreadPoolExecutor,
              stepping: dict[Future, Trajectory], clock: RolloutStats, version: int | None = None) -> None:
    """One engine poll; every finished turn is appended (with the policy `version` that sampled it, when given)
    and its env step started."""
    start = time.perf_counter()
    finished = engine.poll()
    clock.generate_s += time.perf_counter() - start
    for traj, sample in finished:
        _add_usage(traj, sample)
        if sample.error is not None:
            traj.fail(sample.error)
            continue
        if sample.finish is not None:  # a text engine's server has no room left in its context window
            traj.finish = sample.finish
            continue
        _act(fmt, traj, sample)
        if version is not None:
            traj.versions.append(version)
        clock.sampled_tokens += len(sample.token_ids)
        action = agent.read(fmt, traj.env, traj.messages[-1]["content"], sample.tool_calls)
        traj.actions.append(action.text)
        if action.calls:
            traj.messages[-1]["tool_calls"] = openai_calls(action.calls, traj.turns)
        if action.problem is not None:  # a reply the env never sees: answered here, as an invalid action
            traj.malformed += 1
            stepping[_answered(StepResult(action.problem, traj.reward, False, {"valid": False}), traj)] = traj
        else:
            stepping[pool.submit(_called, environments[traj.row], "step", action.text)] = traj


def _answered(result: StepResult, traj: Trajectory) -> Future:
    """An env step already answered, as the rollout waits for one: (result, no env seconds, the state unchanged)."""
    future = Future()
    future.set_result((result, 0.0, traj.states[-1] if traj.states else None))
    return future


def _add_usage(traj: Trajectory, sample: Sample) -> None:
    """A text engine's token counts and cost, summed over the episode (its reflections' included)."""
    for key, value in sample.usage.items():
        traj.usage[key] = traj.usage.get(key, 0) + value


def _collect(engine, fmt: ChatFormat, stepping: dict[Future, Trajectory], clock: RolloutStats,
             max_tokens: int) -> list[Trajectory]:
    """The env answers to take in now, observed; returns the trajectories that go on to another turn.
    While the engine has work, whatever has answered (none for a round engine, which finishes its round
    first); otherwise the engine is idle and waits, for the first answer (continuous) or for all of them
    (a round's barrier)."""
    if not stepping or (engine.pending and not engine.continuous):
        return []
    if engine.pending:
        answered = [future for future in stepping if future.done()]
    else:
        start = time.perf_counter()
        answered = wait(stepping, return_when=FIRST_COMPLETED if engine.continuous else ALL_COMPLETED).done
        clock.idle_s += time.perf_counter() - start
    going_on = []
    for future in sorted(answered, key=lambda f: stepping[f].row):  # row order: a round engine's batch order
        traj = stepping.pop(future)
        if _taken_in(fmt, traj, future.result(), clock, max_tokens):
            going_on.append(traj)
    return going_on


def _taken_in(fmt: ChatFormat, traj: Trajectory, answer: tuple, clock: RolloutStats, max_tokens: int) -> bool:
    """An env's (result, seconds, state key) for a turn, observed; whether the trajectory goes on to another turn (at
    its horizon it ends, finish "horizon")."""
    result, seconds, state = answer
    clock.count([(result, seconds)])
    _observe(fmt, traj, result, traj.horizon, max_tokens)
    if not isinstance(result, Exception):
        traj.states.append(state)
    if traj.live and traj.turns >= traj.horizon:
        traj.finish = "horizon"
    return traj.live


class EngineStalled(RuntimeError):
    """The engine held submitted turns and generated nothing for STALL_S seconds."""


class Watchdog:
    """Stops a rollout whose engine holds turns and generates nothing (engine.progress stands still) for STALL_S
    seconds, e.g. a vLLM engine asleep: its scheduler is paused and what it is sent waits forever. The clock starts
    at the first check that finds turns waiting, so time spent waiting on envs with nothing submitted never counts."""

    def __init__(self, engine):
        self.engine, self.progress, self.since = engine, engine.progress, time.perf_counter()

    def check(self) -> None:
        now = time.perf_counter()
        if not self.engine.pending or self.engine.progress != self.progress:
            self.progress, self.since = self.engine.progress, now
        elif now - self.since > STALL_S:
            raise EngineStalled(
                f"the {self.engine.name} engine generated nothing for {STALL_S:g} s while {self.engine.pending} turns "
                "waited: it is stuck (a vLLM engine that sleeps never schedules what it is sent), so the rollout stops")


def _timed(fn, *args):
    """Run an env call: (its result, or the exception it raised, and its seconds). Infrastructure
    failures come back as the exception, never raised."""
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as error:  # noqa: BLE001 - any env failure ends one trajectory, not the run
        result = error
    return result, time.perf_counter() - start


def _called(env: Env, method: str, *args) -> tuple:
    """An env call ("reset" or "step"), in the pool: (its result, or the exception it raised, its seconds, the env's
    state key after it, None where the env cannot say). A key that fails to come is None, never an error
    (envs.state_key_of)."""
    result, seconds = _timed(getattr(env, method), *args)
    return result, seconds, None if isinstance(result, Exception) else envs.state_key_of(env)


def _start(fmt: ChatFormat, agent: Agent, row: int, env: Env, task_id: int, group: int, answer: tuple, horizon: int,
           reflections: list[str]) -> Trajectory:
    """A trajectory whose tokens are the first prompt (the agent format's opening: instruction, ack, first
    observation); `answer`: the reset's (first observation, seconds, state key)."""
    first, _, state = answer
    if isinstance(first, Exception):
        messages = agent.opening(env, "", reflections)[:2]
        traj = Trajectory(env.name, task_id, group, row, messages, horizon=horizon)
        traj.fail(f"reset failed: {type(first).__name__}: {first}")
        return traj
    messages = agent.opening(env, first, reflections)
    traj = Trajectory(env.name, task_id, group, row, messages, horizon=horizon, tools=agent.tools(env), states=[state])
    traj.add(fmt.prompt(messages, tools=traj.tools))
    return traj


def _act(fmt: ChatFormat, traj: Trajectory, sample: Sample) -> None:
    """Append a sampled turn, trained on, and the message the env will read."""
    if sample.text is None:  # (a text engine, rl/engines/api.py, has no tokens to append: the reply only)
        traj.add(sample.token_ids, sample.logprobs, trained=True)
        if sample.token_ids[-1:] != [fmt.end_of_turn]:
            # cut off by the limit, or stopped on another eos: the template needs the end-of-turn token,
            # which the model did not choose, so it is not trained on
            traj.add([fmt.end_of_turn])
        if fmt.history == "drop":
            traj.sequences.append((list(traj.token_ids), list(traj.loss_mask), list(traj.logprobs)))
    traj.messages.append({"role": "assistant", "content": _reply(fmt, sample)})
    if sample.reasoning:  # (a text engine's reasoning, returned apart from its reply: logged, never sent back)
        traj.messages[-1]["reasoning_content"] = sample.reasoning
    traj.turns += 1


def _reply(fmt: ChatFormat, sample: Sample) -> str:
    """A sampled turn's text as the conversation keeps it (the env is asked what agent.read finds in it)."""
    return sample.text if sample.text is not None else fmt.text(sample.token_ids)


def _observe(fmt: ChatFormat, traj: Trajectory, result, horizon: int, max_tokens: int) -> None:
    """Record the env's answer to a turn; append the observation's tokens if another turn follows."""
    if isinstance(result, Exception):
        traj.fail(f"step failed: {type(result).__name__}: {result}")
        return
    traj.reward, traj.done = float(result.reward), bool(result.done)
    traj.turn_rewards.append(traj.reward)
    traj.valid.append(result.info.get("valid") is not False)
    traj.invalid_actions += not traj.valid[-1]
    traj.success = bool(result.info.get("success", result.reward > 0)) if result.done else False
    calls = traj.messages[-1].get("tool_calls")  # an answer to a tool call is the call's result
    traj.messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": result.observation} if calls
                         else {"role": "user", "content": result.observation})
    if traj.done:
        traj.finish = "done"
    elif traj.turns < horizon and fmt.history == "drop":  # the next turn's prompt: the template's rendering so far
        prompt = fmt.prompt(traj.messages, tools=traj.tools)
        if max_tokens - len(prompt) - 1 < 1:
            traj.finish = "max_tokens"
        else:
            traj.token_ids, traj.loss_mask, traj.logprobs = [], [], []
            traj.add(prompt)
    elif traj.turns < horizon:
        observation = fmt.observation(result.observation, traj.messages[-1]["role"])
        if _room(traj, max_tokens) - len(observation) < 1:  # no room left for a reply
            traj.finish = "max_tokens"
        else:
            traj.add(observation)


def _room(traj: Trajectory, max_tokens: int) -> int:
    """Tokens the next turn may sample: what is left of the budget, less one for the end-of-turn token
    that closes a turn the model did not end itself, so that no trajectory exceeds max_tokens."""
    return max_tokens - len(traj.token_ids) - 1
