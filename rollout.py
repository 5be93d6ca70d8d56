"""Multi-turn rollout: batched generation for every live trajectory, environments stepped in parallel.

    trajectories = rollout(engine, fmt, envs, task_ids, groups, horizon=..., max_new_tokens=..., max_tokens=...)
    trajectories = rollout(..., stats=RolloutStats())                 # where the time went, for throughput metrics
    trajectories = play(engine, fmt, envs, task_ids, horizon=..., ...)   # more tasks than envs: in turn
    rollouts = Rollouts(engine, fmt, envs, tasks_of, staleness=k, ...)   # train.py's loop: a set a step, see Rollouts

Rollouts is the one loop that drives an engine; rollout() and play() play one set of it at a time, at staleness 0.
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

Limits: max_new_tokens caps the tokens sampled in a turn, exactly; max_tokens caps the whole trajectory (train.py
passes the smaller of --max-tokens and the model's context window); rollout() and play() take one of each for all their
envs, Rollouts each env's (rl/limits.py's Limits, by name; each set's caps with its tasks). An episode that runs out
of room (a first prompt or an observation that leaves no room for a reply, or a turn cut by the budget) ends cleanly
with finish "max_tokens", never an error, and is scored like one cut by the horizon: its reward is the last step's,
trained with the advantage that reward earns, as upstream keeps the env's reward for a response cut at
max_response_length. An env call that raises or hangs (envs/guard.py bounds each one) ends only its trajectory, with
finish "error": it has no outcome, and train.py leaves it out of the update.

Agent formats (rl/agent.py, `agent=`): the messages an episode opens with and what the env is asked by
each reply (react, plan; tools, the one tool call in it, answered as a tool result); reflect plays up to
agent.attempts attempts a task (`attempts`), the policy reflecting after each failed one by continuing that
attempt's tokens. The env reads a reply after its reasoning block (rl/chat.py); a reply with no action to
take (cut off inside its reasoning, no or a malformed tool call) is answered here, without the env, as an
invalid action. Every format keeps the token rules above.

What a turn's prompt holds is the agent's context policy's to say (rl/context.py: --context, --reasoning drop), asked
after each sampled turn (a summary, which no env reads, or not) and each answer: the live sequence goes on, or a new
one starts (Trajectory.sequences, a row each in train.py) on the template's rendering of what is kept.

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
- Upstream's loop is synchronous only. Rollouts at staleness k (train.py --max-staleness k) goes on playing the
  next k steps' tasks while the trainer updates, each turn recording the policy version that sampled it; k = 0 is
  the synchronous loop (the same code, and train.py's default).
- Upstream sleeps `send_interval` (1 s) before every round's env steps (pacing for its HTTP env
  servers); envs here are in-process, so there is no pause.
"""

from __future__ import annotations

import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Callable, NamedTuple

from envs import Env, StepResult
from rl import staleness as rule
from rl.agent import REACT, Agent
from rl.chat import ChatFormat, openai_calls  # (ChatFormat: rollout's callers import it from here too)
from rl.engines import EngineStalled, Sample, Watchdog  # noqa: F401 - (EngineStalled: re-exported)
from rl.engines.expert import ExpertEngine
from rl.context import Context, Kept
from rl.forks import Forks
from rl.limits import Limits, largest
from rl.engines.hf import HFEngine  # noqa: F401 - the engines rollouts run on, imported from here too
from rl.engines.vllm import VLLMEngine  # noqa: F401 - (as HFEngine)
from rl.trajectory import EnvAnswer, RolloutStats, Sequence, Trajectory, category, spans  # noqa: F401 - re-exported

Report = Callable[[list[Trajectory]], None]  # a rollout's progress: called as turns are played and episodes end
ATTEMPT_GROUPS = 1 << 20  # reflect: attempt a's group is its task group + (a - 1) x this (see attempts)
# Env calls at once: a thread per env up to this many (an env call mostly waits, on a browser, a server or a
# simulator's process, so a slow env must not hold up another's call behind it; 32 had a step's 64 episodes queue)
ENV_THREADS = 256


class Tasks(NamedTuple):
    """A set's episodes: each one's task id and group, each env's turn cap by its name, and (reflect's) each one's past
    reflections."""

    task_ids: list[int]
    groups: list[int]
    horizon: dict[str, int]
    reflections: list[list[str]] | None = None


# ----------------------------------------------------------------------------------------------
# The rollout loop


class Rollouts:
    """Every rollout: sets of episodes played on a fixed list of envs, while the trainer updates too (train.py's loop,
    --max-staleness k; rollout() and play() are one set at staleness 0).

        rollouts = Rollouts(engine, fmt, environments, tasks_of, staleness=k, first=1, last=steps, ...)
        for step in ...:
            trajectories = rollouts.take(step)   # set `step`, complete; the later sets go on being played
            rollouts.before_update()             # every turn under way finished: the engine holds nothing
            ... update (rollouts.advance between its micro-batches, when rollouts.meanwhile), before_sync, sync ...
            rollouts.resume(step)                # the engine now has version `step`

    Set j is training step j's tasks (`tasks_of(j)`), and step j trains exactly set j, so the data cursor is the
    step. The staleness rule (rl/staleness.py, with the bound's proof) says when a set opens and on which block of
    len(environments) / (k + 1) envs it plays: its envs reset as soon as the block is free, a reset (a page load, a
    simulator's start) sampling nothing, and its turns begin once the engine has the policy version j - 1 - k. A
    turn is sampled by the version the engine has when it is generated (recorded in Trajectory.versions with
    `versions`); a long episode goes on under newer weights (a partial rollout). With k = 0 set j opens once step
    j - 1 is over: the synchronous loop, in which every hook but take has nothing to do.

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
    its env answers. `reseed(j)`, when given, restarts the engine's random stream as set j opens
    (--deterministic: a set's samples depend on its seed and the weights alone). `fork` K: each group's episodes
    start from copies of its first after its first K turns (rl/forks.py) instead of resets of their own.
    """

    def __init__(self, engine, fmt: ChatFormat, environments: list[Env], tasks_of: Callable[[int], Tasks], *,
                 limits: dict[str, Limits], staleness: int = 0, first: int = 1, last: int = 1,
                 agent: Agent = REACT, pool: ThreadPoolExecutor | None = None,
                 reseed: Callable[[int], None] | None = None, versions: bool = False,
                 redraw: Callable[[int, list[Trajectory]], dict[int, int]] | None = None, fork: int | None = None):
        if len(environments) % rule.blocks(staleness):
            raise ValueError(f"{len(environments)} envs do not split into {rule.blocks(staleness)} sets' blocks")
        if agent.attempts > 1 and staleness:
            raise ValueError("reflect's attempts depend on each other's reflections: play it at staleness 0")
        if agent.attempts > 1 and fork is not None:
            raise ValueError("reflect's attempts are each a rollout of their own, which does not fork: play it with "
                             "--group-start reset")
        self.engine, self.fmt, self.environments, self.tasks_of = engine, fmt, environments, tasks_of
        self.staleness, self.last, self.agent, self.versions = staleness, last, agent, versions
        self.limits, self.reseed, self.redraw, self.forks = limits, reseed, redraw, Forks(fork)
        self.block = len(environments) // rule.blocks(staleness)
        self.meanwhile = engine.continuous and not getattr(engine, "sleep_mode", False)  # (see advance)
        self.own_pool = pool is None
        self.pool = pool or ThreadPoolExecutor(max_workers=min(ENV_THREADS, len(environments)))
        self.version = first - 1  # the engine's weights: those after this many updates
        self.opened = first - 1  # the last set started
        self.sets: dict[int, list[Trajectory | None]] = {}  # set -> its trajectories (None while its env resets)
        self.reflections: dict[int, list[list[str]] | None] = {}  # set -> reflect's past reflections of each
        self.holds: dict[int, int] = {}  # block of envs -> the set it plays
        self.replays: dict[int, tuple[int, int]] = {}  # set -> its --dynamic-sampling (rounds, groups) so far
        self.settled: dict[int, tuple[int, int]] = {}  # complete set, none to play again -> the same (_settle)
        self.ready: list[Trajectory] = []  # waiting to be submitted for their next turn
        self.stepping: dict[Future, Trajectory] = {}
        self.resetting: dict[Future, tuple[int, int, int, int, int]] = {}  # -> (set, index, task, group, horizon)
        self.clock = RolloutStats()

    def take(self, j: int, progress: Report | None = None) -> list[Trajectory]:
        """Play until set j is complete, and return it in row order (the other sets go on later). `progress`, when
        given, is called with set j's trajectories under way whenever one of them played a turn or ended."""
        if self.agent.attempts > 1:  # reflect: a set's attempts are sets of their own, played in turn
            return self._attempts(j, progress)
        begin, watchdog = time.perf_counter(), Watchdog(self.engine)
        seen = []
        try:
            self._open()
            if j not in self.sets:
                raise ValueError(f"set {j} is not under way: it starts with version "
                                 f"{rule.first_version(j, self.staleness)}, and the engine has {self.version} "
                                 "(sets are taken in order, each once)")
            while True:
                self._open()
                if progress is not None:
                    started = [t for t in self.sets[j] if t is not None]
                    now = [(t.live, t.turns) for t in started if t.turns or not t.live]
                    if now != seen:
                        progress(started)
                        seen = now
                self._settle()
                if j in self.settled:
                    rounds, groups = self.settled.pop(j)  # (a step's metrics count its own set's replays)
                    self.clock.add(RolloutStats(redraw_rounds=rounds, redrawn_groups=groups))
                    return sorted(self.sets.pop(j), key=lambda t: t.row)
                watchdog.check()
                self._submit()
                if self.engine.pending:  # a round engine answers every submitted turn, vLLM the ones that finished
                    self._generate()
                self._collect()
        finally:
            self.clock.rollout_s += time.perf_counter() - begin

    def spent(self, stats: RolloutStats) -> None:
        """Add where the loop's time went since the last call (takes and advances) to `stats`."""
        stats.add(self.clock)
        self.clock = RolloutStats()

    def before_update(self) -> None:
        """Empty an engine on the trainer's device (all but a rollout server, which generates through the update),
        and let it sleep through the update (vLLM's sleep mode frees the GPU)."""
        if not self.engine.apart:
            self.advance()
        self.engine.sleep()

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
                self._generate()
        finally:
            self.clock.rollout_s += time.perf_counter() - begin

    def resume(self, version: int) -> None:
        """The engine has the weights after `version` updates: later turns are sampled by them, the sets whose
        turns they allow begin them, and at staleness 0 the next set opens."""
        self.version = version
        self._open()

    def close(self) -> None:
        """Stop: drop what the engine holds and wait for the env calls under way (nothing spills into what follows;
        the unfinished sets are lost, as a resumed run replays them)."""
        self.engine.abort()
        wait([*self.stepping, *self.resetting])
        self.stepping.clear()
        self.resetting.clear()
        self.forks.close()
        if self.own_pool:
            self.pool.shutdown(wait=True)

    # -- the loop's parts

    def _tasks(self, j: int) -> Tasks:
        """Set j's tasks, the engine reseeded for them."""
        tasks = self.tasks_of(j)
        if len(tasks.task_ids) > self.block:
            raise ValueError(f"set {j} has {len(tasks.task_ids)} episodes, more than its block of {self.block} envs")
        if self.reseed is not None:
            self.reseed(j)
        return tasks

    def _open(self) -> None:
        """Start every set the staleness rule opens: reset its envs, in the pool, as turns go on. A reset samples
        nothing; its turns wait for their version (_submit)."""
        while (self.opened < self.last and self.agent.attempts == 1 and
               rule.opens(self.opened + 1, self.staleness, self.opened + 1 - rule.blocks(self.staleness) in self.sets,
                          self.version)):
            j = self.opened = self.opened + 1
            task_ids, groups, horizon, reflections = self._tasks(j)
            self.sets[j], self.reflections[j] = [None] * len(task_ids), reflections
            self.holds[rule.block(j, self.staleness)] = j
            self._begin(j, [(i, task, group, horizon[self.environments[self._row(j, i)].name])
                            for i, (task, group) in enumerate(zip(task_ids, groups))])

    def _begin(self, j: int, episodes: list[tuple[int, int, int, int]]) -> None:
        """Start set j's `episodes` (index, task, group, turn cap): each by a reset of its env, in the pool, or under
        --group-start fork only the first of each group, the others waiting for copies of it (rl/forks.py)."""
        for i, task, group, horizon in self.forks.starts(episodes, lambda i: self._row(j, i)):
            self.resetting[self.pool.submit(EnvAnswer.of, self.environments[self._row(j, i)], "reset", task)] = \
                (j, i, task, group, horizon)

    def _settle(self) -> None:
        """--dynamic-sampling (rl/tasks.Redraw): the episodes of each complete set that `redraw` plays again start anew,
        on their new tasks in their own envs, as soon as the set completes (a set past the one taken too: its replays
        play beside it); a complete set with none left is settled, with its replays' rounds and groups."""
        for j in [j for j in self.sets if j not in self.settled and self._complete(j)]:
            again = self.redraw(j, self.sets[j]) if self.redraw is not None else {}
            rounds, groups = self.replays.pop(j, (0, 0))
            if not again:
                self.settled[j] = rounds, groups
                continue
            self.replays[j] = rounds + 1, groups + len({self.sets[j][i].group for i in again})
            played = self.sets[j]
            self.sets[j] = [None if i in again else traj for i, traj in enumerate(played)]
            self._begin(j, [(i, task, played[i].group, played[i].horizon) for i, task in sorted(again.items())])

    def _attempts(self, j: int, progress: Callable[[int, int], None] | None) -> list[Trajectory]:
        """Reflect's set j: its episodes attempt after attempt (attempts), each attempt a set of its own."""
        self.opened = j
        task_ids, groups, horizon, _ = self._tasks(j)
        top = largest(self.limits)  # (each attempt's set: one cap and budget, the largest; reflect's envs share them)
        return attempts(self.engine, self.fmt, self.environments[:len(task_ids)], task_ids, groups,
                        horizon=max(horizon.values()), max_new_tokens=top.max_new_tokens, max_tokens=top.max_tokens,
                        agent=self.agent, pool=self.pool, stats=self.clock, progress=progress)

    def _submit(self) -> None:
        """Submit the next turn of every trajectory ready for one, but those of a set whose turns may not begin yet
        (set j: before its first version; they wait, reset)."""
        held = []
        for traj in self.ready:
            limit = min(self.limits[traj.env].max_new_tokens, _room(traj, self.limits[traj.env].max_tokens))
            if rule.first_version(self.holds[traj.row // self.block], self.staleness) > self.version:
                held.append(traj)
            elif limit < 1:  # a first prompt that leaves no room for a reply
                traj.finish = "max_tokens"
                self._branch(traj)
            else:
                self.engine.submit(traj, limit)
        self.ready = held

    def _generate(self) -> None:
        """One engine poll; every finished turn is appended (with the policy version that sampled it, under
        `versions`) and its env step started."""
        start = time.perf_counter()
        finished = self.engine.poll()
        self.clock.generate_s += time.perf_counter() - start
        for traj, sample in finished:
            _add_usage(traj, sample)
            if sample.error is not None:
                traj.fail(sample.error)
            elif sample.finish is not None:  # a text engine's server has no room left in its context window
                traj.finish = sample.finish
            if not traj.live:  # (ended without an env answer)
                self._branch(traj)
                continue
            env_turn = _act(self.fmt, self.agent.context, traj, sample)
            if self.versions:
                traj.versions.append(self.version)
            self.clock.sampled_tokens += len(sample.token_ids)
            if not env_turn:  # (a summary, which no env reads: answered by no one, as the rollout waits for answers)
                self.stepping[_answered(None, traj)] = traj
                continue
            action = self.agent.read(self.fmt, traj.env, traj.messages[-1]["content"], sample.tool_calls)
            traj.actions.append(action.text)
            if action.calls:
                traj.messages[-1]["tool_calls"] = openai_calls(action.calls, traj.turns)
            elif sample.tool_calls:  # (a text engine's calls not taken: kept as it sent them, for the logs alone)
                traj.messages[-1]["invalid_tool_calls"] = sample.tool_calls
            if action.problem is not None:  # a reply the env never sees: answered here, as an invalid action
                traj.malformed += 1
                self.stepping[_answered(StepResult(action.problem, traj.reward, False, {"valid": False}), traj)] = traj
            else:
                env = self.forks.env(traj.row, self.environments)
                self.stepping[self.pool.submit(EnvAnswer.of, env, "step", action.text)] = traj

    def _collect(self, idle: bool = True) -> None:
        """Take in the env answers (resets and steps): while the engine has work, those that came; otherwise wait, for
        the first (continuous) or for all (a round's barrier, also when not `idle`: a round engine's rounds never
        depend on timing); not `idle` (advance), a continuous engine waits for none."""
        waiting = [*self.resetting, *self.stepping]
        if not waiting or (self.engine.pending and not self.engine.continuous):
            return
        if self.engine.pending or (self.engine.continuous and not idle):
            answered = [future for future in waiting if future.done()]
        else:
            start = time.perf_counter()
            answered = wait(waiting, return_when=FIRST_COMPLETED if self.engine.continuous else ALL_COMPLETED).done
            self.clock.idle_s += time.perf_counter() - start
        for future in sorted(answered, key=self._row_of):  # row order: a round engine's batch order
            answer = future.result()
            self.clock.count(answer)
            if future in self.resetting:
                j, i, task, group, horizon = self.resetting.pop(future)
                row, reflections = self._row(j, i), self.reflections[j]
                traj = self.sets[j][i] = _start(self.fmt, self.agent, row, self.environments[row], task, group, answer,
                                                horizon, reflections[i] if reflections else [])
                if traj.live:
                    self.ready.append(traj)
            elif _taken_in(self.fmt, self.agent.context, traj := self.stepping.pop(future), answer,
                           self.limits[traj.env].max_tokens):
                self.ready.append(traj)
            self._branch(traj)

    def _branch(self, traj: Trajectory) -> None:
        """--group-start fork: once `traj` played its group's shared turns, or ended however it ended (an env answer,
        a failed sample, no room), the group's other episodes begin where it is (rl/forks.py; else nothing)."""
        j = self.holds[traj.row // self.block]
        for i, twin in self.forks.branch(traj, self.forks.env(traj.row, self.environments), lambda i: self._row(j, i)):
            self.sets[j][i] = twin
            self.ready += [twin] if twin.live else []

    def _row(self, j: int, i: int) -> int:
        """The env of set j's episode i: the i-th of its block."""
        return rule.block(j, self.staleness) * self.block + i

    def _row_of(self, future: Future) -> int:
        return self.stepping[future].row if future in self.stepping else self._row(*self.resetting[future][:2])

    def _complete(self, j: int) -> bool:
        return j in self.sets and all(t is not None and not t.live for t in self.sets[j])


# ----------------------------------------------------------------------------------------------
# One set at a time: rollout, reflect's attempts, play


def rollout(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int], *,
            horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent = REACT,
            pool: ThreadPoolExecutor | None = None, stats: RolloutStats | None = None,
            progress: Report | None = None,
            reflections: list[list[str]] | None = None, fork: int | None = None) -> list[Trajectory]:
    """Play one episode per env: environments[i] plays task_ids[i], in group groups[i], for at most
    `horizon` turns, laid out by `agent` (rl/agent.py; reflect plays up to agent.attempts attempts, each a
    trajectory, see attempts()). `progress`, when given, is called with the trajectories under way whenever one of
    them played a turn or ended (rl/progress.py shows them). `stats`, when given,
    receives the rollout's timing and token counts (RolloutStats). `reflections`: each episode's past ones, which
    it opens with (attempts'). `fork` K: groups fork after K turns (rl/forks.py)."""
    assert len(environments) == len(task_ids) == len(groups)
    if agent.attempts > 1:
        return attempts(engine, fmt, environments, task_ids, groups, horizon=horizon, max_new_tokens=max_new_tokens,
                        max_tokens=max_tokens, agent=agent, pool=pool, stats=stats, progress=progress)
    limits = {env.name: Limits((horizon,), 1, max_new_tokens, max_tokens) for env in environments}  # (every env's)
    one = Rollouts(engine, fmt, environments, lambda _: Tasks(task_ids, groups, dict.fromkeys(limits, horizon),
                                                              reflections), limits=limits, agent=agent, pool=pool,
                   fork=fork)
    try:
        return one.take(1, progress)
    finally:  # stopped half-way (an exception), nothing may spill into the next rollout
        one.close()
        if stats is not None:
            one.spent(stats)


def attempts(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int], *,
             horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent, pool: ThreadPoolExecutor | None = None,
             stats: RolloutStats | None = None, progress: Report | None = None) -> list[Trajectory]:
    """Reflect's episodes: attempt after attempt at each task until it succeeds or agent.attempts are played.
    After a failed attempt the policy writes a reflection (reflect()), and the task's next attempt opens with
    all of its reflections. Returns every attempt's trajectory, attempt 1's first; an attempt's group is
    its task group's, moved by the attempt (group + (attempt - 1) x ATTEMPT_GROUPS), so that GRPO compares
    it with the same attempt of the other samples, and no attempt's group meets another task's (play's
    later rollouts number their groups on). An attempt that ended in an env failure ends its
    episode. `progress` is called with each attempt's trajectories (as rollout's)."""
    reflections: list[list[str]] = [[] for _ in task_ids]
    rows, played, clock = list(range(len(task_ids))), [], RolloutStats()
    if isinstance(engine, ExpertEngine):  # (it keys its experts by env row, which attempts renumber; never reflects)
        raise ValueError("the envs' scripted experts do not reflect: play them with --agent react")
    if max(groups, default=0) >= ATTEMPT_GROUPS:
        raise ValueError(f"reflect numbers its attempts' groups from {ATTEMPT_GROUPS}: task groups must stay below")
    for attempt in range(1, agent.attempts + 1):
        attempt_clock = RolloutStats()
        batch = rollout(engine, fmt, [environments[r] for r in rows], [task_ids[r] for r in rows],
                        [groups[r] + (attempt - 1) * ATTEMPT_GROUPS for r in rows], horizon=horizon,
                        max_new_tokens=max_new_tokens, max_tokens=max_tokens, agent=replace(agent, attempts=1),
                        pool=pool, stats=attempt_clock, progress=progress,
                        reflections=[reflections[r] for r in rows])
        for traj in batch:
            traj.attempt.number = attempt
        played += batch
        failed = [(r, t) for r, t in zip(rows, batch) if not t.success and t.finish != "error"]
        if attempt < agent.attempts:
            start = time.perf_counter()
            written = reflect(engine, fmt, [t for _, t in failed], agent, max_new_tokens, max_tokens, attempt_clock)
            attempt_clock.rollout_s += time.perf_counter() - start  # (reflecting is rollout time spent generating)
            attempt_clock.generate_s += time.perf_counter() - start
            for (r, traj), text in zip(failed, written):
                traj.attempt.reflection, traj.attempt.final = text, text is None
                if text is not None:
                    reflections[r].append(text)
        clock.add(attempt_clock)
        rows = [r for r, t in failed if not t.attempt.final]
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


def play(engine, fmt: ChatFormat, environments: list[Env], task_ids: list[int], groups: list[int] | None = None, *,
         horizon: int, max_new_tokens: int, max_tokens: int, agent: Agent = REACT,
         pool: ThreadPoolExecutor | None = None, progress: Report | None = None) -> list[Trajectory]:
    """Any number of episodes on a fixed set of envs: rollouts of as many at once as there are envs,
    in order, until every task id is played. `progress` is called as turns are played and episodes end
    (see rollout; rl/progress.py's Progress shows them). Groups default to one per episode."""
    groups = list(range(len(task_ids))) if groups is None else groups
    trajectories: list[Trajectory] = []
    for start in range(0, len(task_ids), len(environments)):
        count = min(len(environments), len(task_ids) - start)
        trajectories += rollout(engine, fmt, environments[:count], task_ids[start:start + count],
                                groups[start:start + count], horizon=horizon, max_new_tokens=max_new_tokens,
                                max_tokens=max_tokens, agent=agent, pool=pool, progress=progress)
    return trajectories


def _answered(result: StepResult | None, traj: Trajectory) -> Future:
    """An env step already answered (None: a turn no env reads), as the rollout waits for one: no env seconds."""
    future = Future()
    future.set_result(EnvAnswer(result, 0.0, traj.states[-1] if traj.states else None))
    return future


def _add_usage(traj: Trajectory, sample: Sample) -> None:
    """A text engine's token counts and cost, summed over the episode (its reflections' included)."""
    for key, value in sample.usage.items():
        traj.usage[key] = traj.usage.get(key, 0) + value


def _taken_in(fmt: ChatFormat, context: Context, traj: Trajectory, answer: EnvAnswer, max_tokens: int) -> bool:
    """An env's answer to a turn (None: a summary's, which no env reads), observed, and the next turn's prompt as the
    context says; whether the trajectory goes on to another turn (at its horizon it ends, finish "horizon")."""
    if answer.result is not None:
        _observe(fmt, traj, answer.result)
        if not isinstance(answer.result, Exception):
            traj.states.append(answer.state)
        if traj.live and traj.turns >= traj.horizon:
            traj.finish = "horizon"
    if traj.live:
        _prompt(fmt, traj, context.after(traj), max_tokens)
    return traj.live


def _start(fmt: ChatFormat, agent: Agent, row: int, env: Env, task_id: int, group: int, answer: EnvAnswer,
           horizon: int, reflections: list[str]) -> Trajectory:
    """A trajectory whose tokens are the first prompt (the agent format's opening: instruction, ack, first
    observation); `answer`: the reset's (the first observation)."""
    first, _, state = answer
    if isinstance(first, Exception):
        messages = agent.opening(env, "", reflections)[:2]
        traj = Trajectory(env.name, task_id, group, row, messages, horizon=horizon)
        traj.fail(f"reset failed: {type(first).__name__}: {first}")
        return traj
    first, cut = fmt.cut(first)
    messages = agent.opening(env, first, reflections)
    traj = Trajectory(env.name, task_id, group, row, messages, horizon=horizon, tools=agent.tools(env), states=[state],
                      observations=1, cut_at=[0] if cut else [], context=Kept(opening=len(messages)))
    traj.add(fmt.prompt(messages, tools=traj.tools))
    return traj


def _act(fmt: ChatFormat, context: Context, traj: Trajectory, sample: Sample) -> bool:
    """Append a sampled turn, trained on, and the message the env will read; whether an env reads it (a summary: no)."""
    traj.prompt_tokens.append(len(traj.token_ids) if sample.text is None else int(sample.usage.get("prompt_tokens", 0)))
    if sample.text is None:  # (a text engine, rl/engines/api.py, has no tokens to append: the reply only)
        traj.add(sample.token_ids, sample.logprobs, trained=True)
        if sample.token_ids[-1:] != [fmt.end_of_turn]:
            # cut off by the limit, or stopped on another eos: the template needs the end-of-turn token,
            # which the model did not choose, so it is not trained on
            traj.add([fmt.end_of_turn])
    traj.messages.append({"role": "assistant", "content": _reply(fmt, sample)})
    if sample.reasoning:  # (a text engine's reasoning, returned apart from its reply: logged, never sent back)
        traj.messages[-1]["reasoning_content"] = sample.reasoning
    env_turn = context.sampled(traj)
    traj.turns, traj.sampled = traj.turns + env_turn, traj.sampled + len(sample.token_ids)
    return env_turn


def _reply(fmt: ChatFormat, sample: Sample) -> str:
    """A sampled turn's text as the conversation keeps it (the env is asked what agent.read finds in it)."""
    return sample.text if sample.text is not None else fmt.text(sample.token_ids)


def _observe(fmt: ChatFormat, traj: Trajectory, result) -> None:
    """Record the env's answer to a turn (in the messages; its tokens are the next prompt's, _prompt)."""
    if isinstance(result, Exception):
        traj.fail(f"step failed: {type(result).__name__}: {result}")
        return
    traj.reward, traj.done = float(result.reward), bool(result.done)
    traj.turn_rewards.append(traj.reward)
    traj.valid.append(result.info.get("valid") is not False)
    traj.invalid_actions += not traj.valid[-1]
    traj.success = bool(result.info.get("success", result.reward > 0)) if result.done else False
    text, cut = fmt.cut(result.observation)
    traj.cut_at += [traj.observations] if cut else []
    traj.observations += 1
    calls = traj.messages[-1].get("tool_calls")  # an answer to a tool call is the call's result
    traj.messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": text} if calls else
                         {"role": "user", "content": text})
    if traj.done:
        traj.finish = "done"


def _prompt(fmt: ChatFormat, traj: Trajectory, segment: bool, max_tokens: int) -> None:
    """The next turn's prompt: the live context continued by the answer's tokens, or a new segment, the template's
    rendering of what the context keeps; where that leaves no room for a reply the episode ends, finish max_tokens."""
    if segment:
        ids, room = fmt.prompt(traj.prompt_messages(), tools=traj.tools), max_tokens - 1
    else:
        ids, room = fmt.observation(traj.messages[-1]["content"], traj.messages[-1]["role"]), _room(traj, max_tokens)
    if room - len(ids) < 1:
        traj.finish = "max_tokens"
    elif segment:
        traj.restart(ids)
    else:
        traj.add(ids)


def _room(traj: Trajectory, max_tokens: int) -> int:
    """Tokens the next turn may sample: what is left of the budget, less one for the end-of-turn token
    that closes a turn the model did not end itself, so that no trajectory exceeds max_tokens."""
    return max_tokens - len(traj.token_ids) - 1
