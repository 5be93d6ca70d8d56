"""Writes TextCraft's default task-id splits, envs/data/textcraft_{train,test}.json, and the goals in neither,
envs/data/textcraft_rest.json.

Upstream's split sizes (374 train, 100 test; AgentGym-RL-Data-ID) with upstream's files not
published: each depth (1-4) is split in proportion to its share of the 544 goals (largest
remainder), the ids of a depth drawn with random.Random(0); the other 70 goals are in neither
(textcraft_rest.json, depths in about the test split's shares): tasks for RL on an agent whose SFT
played the train split (`--train-tasks envs/data/textcraft_rest.json`), so that its goals are new to it as the
test split's are.

    python scripts/textcraft_splits.py
"""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs import DATA_DIR, save_task_ids  # noqa: E402
from envs.textcraft import category, crafting_tree  # noqa: E402

TRAIN, TEST, SEED = 374, 100, 0


def apportion(total: int, sizes: list[int]) -> list[int]:
    """Split `total` over strata in proportion to `sizes` (largest remainder, ties to the first)."""
    exact = [total * s / sum(sizes) for s in sizes]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def make_splits() -> tuple[list[int], list[int]]:
    strata: dict[str, list[int]] = {}
    for task_id in range(len(crafting_tree().goals)):
        strata.setdefault(category(task_id), []).append(task_id)
    ids = list(strata.values())
    rng = random.Random(SEED)
    drawn = [rng.sample(group, len(group)) for group in ids]
    test_counts = apportion(TEST, [len(g) for g in ids])
    train_counts = apportion(TRAIN, [len(g) - n for g, n in zip(ids, test_counts)])
    test = sorted(i for g, n in zip(drawn, test_counts) for i in g[:n])
    train = sorted(i for g, n, m in zip(drawn, test_counts, train_counts) for i in g[n:n + m])
    return train, test


if __name__ == "__main__":
    train, test = make_splits()
    save_task_ids(DATA_DIR / "textcraft_train.json", "textcraft", train)
    save_task_ids(DATA_DIR / "textcraft_test.json", "textcraft", test)
    rest = sorted(set(range(len(crafting_tree().goals))) - set(train) - set(test))
    save_task_ids(DATA_DIR / "textcraft_rest.json", "textcraft", rest)
    print(f"wrote {len(train)} train, {len(test)} test and {len(rest)} other task ids to {DATA_DIR}")
