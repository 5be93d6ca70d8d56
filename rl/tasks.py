"""Which tasks a run plays: the train and test task ids (a task id file, else the env's split), a training step's
tasks (shuffled epochs over the train split, as upstream's data loader) and a process's share of them."""

from __future__ import annotations

import random

import envs


def task_ids(path: str | None, env: str, split: str) -> list[int]:
    """The task ids of `path` (an AgentGym-RL-Data-ID file), else of the env's `split` ("train" or "test")."""
    return envs.load_task_ids(path, env) if path else envs.splits(env)[split]


def tasks_for(step: int, train_ids: list[int], per_step: int, seed: int) -> list[int]:
    """The tasks of a training step: shuffled epochs over the train split, as upstream's data loader
    (every task once per epoch, a new order each epoch, the last incomplete batch dropped). A pure
    function of the step, so a resumed run sees the tasks it would have seen."""
    epoch, k = divmod(step - 1, len(train_ids) // per_step)
    order = random.Random(f"{seed}-epoch-{epoch}").sample(train_ids, len(train_ids))
    return order[k * per_step:(k + 1) * per_step]


def my_tasks(tasks: list[int], n: int, accelerator) -> tuple[list[int], list[int]]:
    """This process's share of the tasks, each `n` times: (task ids, groups), a group for each task's n episodes."""
    mine = [t for t in tasks[accelerator.process_index::accelerator.num_processes] for _ in range(n)]
    return mine, [i // n for i in range(len(mine))]
