"""Write SciWorld's default splits, envs/data/sciworld_{train,test}.json: the simulator's own train
and test variations of each task (its dev variations are left out), as AgentGym's flat task ids.
Also checks envs.sciworld.TASKS against the installed simulator.

    python scripts/sciworld_splits.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
from envs import sciworld  # noqa: E402


def simulator_splits(env: sciworld.SciWorld) -> tuple[list[int], list[int]]:
    """(train ids, test ids) from the simulator behind `env` (which must have been reset once)."""
    train, test = [], []
    for (task, variations), first_id in zip(sciworld.TASKS, sciworld.FIRST_IDS):
        def read(sim):
            sim.load(task, 0, "", False)  # the variation lists are those of the loaded task
            return sim.getTaskMaxVariations(task), list(sim.getVariationsTrain()), list(sim.getVariationsTest())

        count, train_variations, test_variations = env.call(read)
        if count != variations:
            raise SystemExit(f"{task} has {count} variations in this simulator, envs.sciworld.TASKS says {variations}")
        train += [first_id + v for v in train_variations]
        test += [first_id + v for v in test_variations]
        print(f"{task:50s} {variations:4d} variations: {len(train_variations):4d} train {len(test_variations):4d} test")
    return train, test


def main():
    env = envs.make("sciworld")
    env.reset(0)
    train, test = simulator_splits(env)
    envs.save_task_ids(envs.DATA_DIR / "sciworld_train.json", "sciworld", train)
    envs.save_task_ids(envs.DATA_DIR / "sciworld_test.json", "sciworld", test)
    print(f"{len(train)} train and {len(test)} test task ids written to {envs.DATA_DIR}")


if __name__ == "__main__":
    main()
