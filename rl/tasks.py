"""Which tasks a run plays: the train and test task ids (a task id file, else the env's split), a training step's
tasks (shuffled epochs over the train split, as upstream's data loader) and a process's share of them; with several
envs (train.py --env babyai textcraft ...), each env's share of a step by a fixed quota (Mix).

    mix = Mix.of(("babyai", "textcraft"), (1.0, 1.0), per_step=8)     # 4 tasks of each a step
    tasks = step_tasks(step, mix, train_ids, seed)                     # [("babyai", 12), ..., ("textcraft", 3), ...]
    mine, groups = my_tasks(tasks, n, accelerator)                     # this process's episodes, n a task
    rows = mix.rows(n, process, processes)                             # the env of each of those episodes, in order

    redraw = Redraw(train_ids, rounds=2, seed=1, algo="gigpo")         # --dynamic-sampling 2 (rollout.Rollouts)

A step's tasks are each env's own shuffled epochs (tasks_for), so the data cursor stays a pure function of the step
and a resumed run sees the tasks it would have seen. The quota is the same every step (NeMo-RL's exact per-step
quotas rather than a draw per task): a process's episodes then always take the same envs in the same rows, so one
list of env instances serves every step. Upstream AgentGym-RL trains one env a run; a run of one env here is a mix
of one, the tasks it drew before.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field

import envs
from rl.advantages import AdvantageInputs, advantages
from rl.batch import make_batch, rows_of
from rl.scores import spread


def env_names(env) -> tuple[str, ...]:
    """--env's names as a run keeps them: `all` the five envs, in envs.ENVS's order; a run's config.json from before
    several envs (a name, not a list) its one env."""
    names = (env,) if isinstance(env, str) else tuple(env)
    return tuple(envs.ENVS) if "all" in names else names


def tasks_by_env(path: str | None, names: tuple[str, ...], split: str) -> dict[str, list[int]]:
    """Each env's task ids: those the file `path` names for it (an AgentGym-RL-Data-ID file, whose item ids say
    their env: babyai_12), else its `split`. A file that names none of the run's envs says nothing to the run and
    is refused (envs.TaskFileError), as one that names another env."""
    named = envs.load_tasks(path, names) if path else {}
    if path and not any(named.values()):
        raise envs.TaskFileError(f"task id file {path} holds no {' or '.join(names)} task")
    return {name: named[name] if named.get(name) else envs.splits(name)[split] for name in names}


def test_tasks(path: str | None, names: tuple[str, ...], count: int) -> dict[str, list[int]]:
    """The tasks an evaluation plays, by env: `count` of those the task file `path` names (else of the test split),
    spread over them (0: all)."""
    return {name: spread(ids, count or len(ids)) for name, ids in tasks_by_env(path, names, "test").items()}


def tasks_for(step: int, train_ids: list[int], per_step: int, seed: int) -> list[int]:
    """The tasks of a training step: shuffled epochs over the train split, as upstream's data loader
    (every task once per epoch, a new order each epoch, the last incomplete batch dropped). A pure
    function of the step, so a resumed run sees the tasks it would have seen."""
    epoch, k = divmod(step - 1, len(train_ids) // per_step)
    order = random.Random(f"{seed}-epoch-{epoch}").sample(train_ids, len(train_ids))
    return order[k * per_step:(k + 1) * per_step]


def my_tasks(tasks: list, n: int, accelerator) -> tuple[list, list[int]]:
    """This process's share of the tasks, each `n` times: (tasks, groups), a group for each task's n episodes."""
    mine = share(tasks, n, accelerator.process_index, accelerator.num_processes)
    return mine, [i // n for i in range(len(mine))]


def share(tasks: list, n: int, process: int, processes: int) -> list:
    """A process's share of the tasks (every processes-th, from its index), each `n` times in a row."""
    return [t for t in tasks[process::processes] for _ in range(n)]


@dataclass(frozen=True)
class Mix:
    """The run's envs and each one's tasks a step (`counts`, in the order of `names`, summing to the step's)."""

    names: tuple[str, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, names: tuple[str, ...], weights: tuple[float, ...], per_step: int) -> Mix:
        """`per_step` tasks shared by `weights` (largest remainders; ties to the env named first); every env at
        least one task a step, or a SystemExit that says how many a step it needs."""
        if len(set(names)) != len(names):
            raise SystemExit(f"--env names an env twice: {' '.join(names)}")
        weights = weights or (1.0,) * len(names)
        if len(weights) != len(names) or any(not w > 0 for w in weights):
            raise SystemExit(f"--env-weights takes one positive weight an env ({len(names)}: {', '.join(names)}), "
                             f"not {' '.join(f'{w:g}' for w in weights)}")
        exact = [per_step * w / sum(weights) for w in weights]
        counts = [int(e) for e in exact]
        for i in sorted(range(len(names)), key=lambda i: counts[i] - exact[i])[:per_step - sum(counts)]:
            counts[i] += 1
        if min(counts) < 1:
            short = names[counts.index(min(counts))]
            raise SystemExit(f"--tasks-per-step {per_step} gives {short} no task a step at --env-weights "
                             f"{' '.join(f'{w:g}' for w in weights)}: every env needs one; raise --tasks-per-step or "
                             f"{short}'s weight")
        return cls(tuple(names), tuple(counts))

    def task_ids(self, path: str | None) -> dict[str, list[int]]:
        """The tasks training steps draw from, by env: those the task file `path` names (tasks_by_env), else the env's
        train split; at least its quota of each, or a SystemExit that says so."""
        train_ids = tasks_by_env(path, self.names, "train")
        for name, count in zip(self.names, self.counts):
            if len(train_ids[name]) < count:
                raise SystemExit(f"the train split has {len(train_ids[name])} tasks"
                                 + (f" of {name}, fewer than the {count} a step --env-weights give it"
                                    if len(self.names) > 1 else f", fewer than --tasks-per-step {count}"))
        return train_ids

    def epoch_steps(self, train_ids: dict[str, list[int]]) -> int:
        """Steps an epoch (--epochs): with several envs the longest pass, so that every env's tasks are seen once."""
        return max(len(train_ids[name]) // count for name, count in zip(self.names, self.counts))

    def __str__(self) -> str:
        """`babyai`, or `babyai (6 a step) + textcraft (2 a step)`: a run's first line."""
        return self.names[0] if len(self.names) == 1 else \
            " + ".join(f"{name} ({count} a step)" for name, count in zip(self.names, self.counts))

    def rows(self, n: int, process: int = 0, processes: int = 1) -> list[str]:
        """The env of each episode of a process's share of a step (my_tasks over step_tasks), in order."""
        quota = [name for name, count in zip(self.names, self.counts) for _ in range(count)]
        return share(quota, n, process, processes)


def step_tasks(step: int, mix: Mix, train_ids: dict[str, list[int]], seed: int) -> list[tuple[str, int]]:
    """A training step's tasks, (env, task id) each: each env's quota of its own shuffled epochs (tasks_for)."""
    return [(name, task) for name, count in zip(mix.names, mix.counts)
            for task in tasks_for(step, train_ids[name], count, seed)]


def instances(episodes: dict[str, int], batch: int, processes: int) -> list[str]:
    """The env of each instance that plays each env's `episodes` on a process: a process's share of them, at most
    `batch` of one env at once (rollout.play goes through more in turn)."""
    return [name for name, count in episodes.items() for _ in range(min(batch, -(-count // processes)))]


@dataclass
class Redraw:
    """--dynamic-sampling R, DAPO's dynamic sampling (Yu et al., 2025), for rollout.Rollouts: when a set (a step's
    episodes) is complete, every task group that the run's estimator gives no advantage (all 0 on its action tokens:
    `signal`; a group with an env failure is kept, for --max-error-rate to see) plays again on a task drawn anew from
    its env's train split, in the same envs and the same set, up to R rounds a set; a group with signal is kept. Under
    grpo and rloo that is a group whose episodes all scored the same; under gigpo the turns from a shared env state
    must tie too (two successes, in 2 turns and in 4 through a loop, teach which turns to take). A step keeps its quota
    of groups, as many of them with signal as R rounds found. Each draw is a pure function of (seed, process, step,
    round, group), so the data cursor stays one of the step and a resumed run redraws what it would have (its outcomes
    too, under --deterministic)."""

    train_ids: dict[str, list[int]]
    rounds: int
    seed: int
    process: int = 0
    algo: str = "grpo"  # the run's estimator (--algo, a grouped one), which judges a group's signal ...
    flags: dict = field(default_factory=dict)  # ... under its flags (rl/advantages.EstimatorArgs, by name)
    tried: dict[int, int] = field(default_factory=dict)  # set -> the rounds it played

    def __call__(self, j: int, played: list) -> dict[int, int]:
        """Set j's episodes (Trajectory, in set order) to play again, by index, each with its new task: {} when every
        group has signal, or R rounds were played."""
        r = self.tried[j] = self.tried.get(j, 0) + 1
        if r > self.rounds:
            return {}
        members = collections.defaultdict(list)
        for i, traj in enumerate(played):
            members[traj.group].append(i)
        kept = self.signal(played)
        again = {}
        for group, indices in members.items():
            if any(played[i].error is not None for i in indices):
                continue  # (kept: an env failure counts in --max-error-rate, which a replay would hide)
            if group not in kept:
                env = played[indices[0]].env
                task = random.Random(f"{self.seed}-{self.process}-{j}-dynamic-{r}-{group}").choice(self.train_ids[env])
                again |= {i: task for i in indices}
        return again

    def signal(self, played: list) -> set[int]:
        """The groups of `played` (Trajectory) that the estimator gives an advantage other than 0 on some action token:
        the update's own function (rl/advantages.advantages) on the episodes' rows as the update lays them out, by
        the env's rewards (before --overlong-penalty; without --kl-in-reward's penalty, which the reference model
        gives at the update)."""
        rows, episodes = rows_of(played)
        batch = make_batch(rows, 0, [], "cpu", episodes=episodes)
        inputs = AdvantageInputs(scores=batch.scores, groups=batch.groups, ok=batch.ok, mask=batch.full.loss_mask,
                                 episodes=batch.episodes, anchors=batch.anchors, turn=batch.full.turn)
        adv, _ = advantages(self.algo, inputs, **self.flags)
        return set(batch.groups[adv.ne(0).any(1)].tolist())
