"""Groups that fork (train.py --group-start fork, --fork-turns K): the bookkeeping of rollout.py's one loop for them.

A group's first episode plays its first K turns alone; then the group's other episodes begin where it is, each on
its own copy of its env (envs.Env.fork) with a copy of its trajectory: the shared turns' tokens, loss mask and
log-probs exactly as sampled (trained in every copy, as any of its turns; Trajectory.prefix_turns says how many), and
each goes on with its own samples. So n trajectories share a prefix and part at one state (GiGPO's anchor group). The
loop and its rules stay the same (Rollouts): a set's resets are fewer, and until the fork a group's other rows wait.

    forks = Forks(K)                       # Forks(None): every episode starts from a reset of its own
    forks.starts(episodes, row_of)         -> the episodes that reset (each group's first); the others wait
    forks.due(traj)                        -> its group waits on it, and it played the shared turns (or ended)
    forks.branch(traj, env, row_of)        -> when due, (index, copy) for each episode that waited on it; else []
    forks.env(row, environments), forks.drop(row), forks.close()
"""

from __future__ import annotations

import copy
from typing import Callable

from envs import Env
from rl.trajectory import Trajectory


class Forks:
    def __init__(self, turns: int | None):
        self.turns = turns  # K, or None: no group forks
        self.waiting: dict[int, list[int]] = {}  # a group's first row -> its other episodes (set indices)
        self.copies: dict[int, Env] = {}  # row -> the env copy its episode plays on, in place of its own

    def starts(self, episodes: list[tuple], row_of: Callable[[int], int]) -> list[tuple]:
        """Of `episodes` (set index, task, group, turn cap), the ones that start by a reset: all of them, or when
        forking each group's first, the others waiting for it. Each row's old copy (its last episode's) is closed."""
        first: dict[int, int] = {}  # group -> its first row
        resets = []
        for episode in episodes:
            i, group = episode[0], episode[2]
            row = row_of(i)
            self.drop(row)
            if self.turns is not None and group in first:
                self.waiting[first[group]].append(i)
                continue
            first[group] = row
            if self.turns is not None:
                self.waiting[row] = []
            resets.append(episode)
        return resets

    def due(self, traj: Trajectory) -> bool:
        """Its group waits on it, and it has played the shared turns (at most its turn cap - 1, so that each copy
        samples at least its last turn) or ended."""
        return traj.row in self.waiting and (not traj.live or traj.turns >= min(self.turns, traj.horizon - 1))

    def branch(self, traj: Trajectory, env: Env, row_of: Callable[[int], int]) -> list[tuple[int, Trajectory]]:
        """The other episodes of `traj`'s group, where it is now: (set index, a copy of it), each on its own copy of
        `env`. An episode that ended within the shared turns is its group's every episode: copies of it, ended, whose
        outcomes tie. A copy of the env that cannot be made (a given-up env) fails its episode, as a failed reset does.
        Not due (forks.due): nothing."""
        if not self.due(traj):
            return []
        traj.prefix_turns = traj.turns
        twins = []
        for i in self.waiting.pop(traj.row):
            twin = copy.deepcopy(traj)
            twin.row = row_of(i)
            twins.append((i, twin))
            if twin.live:
                try:
                    self.copies[twin.row] = env.fork()
                except Exception as error:  # noqa: BLE001 - as any env failure, it ends one trajectory
                    twin.fail(f"fork failed: {type(error).__name__}: {error}")
        return twins

    def env(self, row: int, environments: list[Env]) -> Env:
        """The env that row's episode plays on: its own, or the copy it was given."""
        return self.copies.get(row, environments[row])

    def drop(self, row: int) -> None:
        if row in self.copies:
            self.copies.pop(row).close()

    def close(self) -> None:
        self.waiting.clear()
        for row in list(self.copies):
            self.drop(row)
