"""Writes BabyAI's task sets for the embedded agent, envs/data/babyai_{short,tiny}_{train,test}.json.

1. short: the levels whose scripted expert (envs.oracle) finishes at least 80% of the train split's seeds
   (3-102) within 6 turns, the tiny preset's horizon. On the other levels the expert itself mostly cannot
   (it needs more turns, or gives up), so no policy could show progress there. Measured: 13 levels at
   90-100%, all others at 42% or less. scripts/build_tiny_model.py --focus-steps N trains on these.
2. tiny, what `python train.py` trains on and reports its held-out gain on: those of the short levels whose
   mission names at most two goals on every seed (GoToRedBallGrey, GoToRedBall, GoToRedBallNoDists: the red
   ball; GoToRedBlueBall: the red or the blue ball; OpenRedDoor: the red door), counted over seeds 3-22. The
   embedded agent cannot yet copy a goal out of the observation (it writes "go to the red ball" whatever the
   mission says), so on the other levels, with 5-18 goals each, it is at 0-15% success and GRPO's groups of
   4 rarely differ in reward (1 - p^4 - (1-p)^4); on these it succeeds most often (measured on seeds 3-22).

Test tasks of both: seeds 0-2 (the shipped test split's) and seeds from 103 on (in neither shipped split),
enough for more than 100 held-out tasks. Train tasks: short, seeds 3-102 (a subset of the shipped train split,
which the agent's SFT saw); tiny, seeds 121-220, which nothing before RL has seen: on seeds the SFT saw, RL
raised an agent's success on those seeds and not on held-out ones (measured with --focus-steps 80: +6 points
on train seeds 3-22, -0.5 on the held-out tasks, after 24 steps), as if sharpening what the SFT memorised.

    python scripts/babyai_splits.py        # about 3 minutes: the expert plays 4,000 episodes
"""

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from envs import DATA_DIR, save_task_ids  # noqa: E402
from envs.babyai import LEVELS  # noqa: E402
from rl.model import EMBEDDED_ROLLOUT, load_tokenizer  # noqa: E402
from rollout import ChatFormat, ExpertEngine, play  # noqa: E402

HORIZON = EMBEDDED_ROLLOUT["horizon"]
EXPERT_SHARE, MAX_GOALS, GOAL_SEEDS = 0.8, 2, range(3, 23)
TRAIN_SEEDS, RL_SEEDS, TEST_SEEDS, MIN_TEST = range(3, 103), range(121, 221), [0, 1, 2], 101


def success_by_level(engine, fmt, levels: list[int], seeds, episodes: int) -> dict[int, float]:
    """Each level's share of solved episodes over these seeds, `episodes` each, within HORIZON turns."""
    environments = [envs.make("babyai") for _ in range(64)]
    ids = [seed * len(LEVELS) + level for seed in seeds for level in levels for _ in range(episodes)]
    engine = engine(environments)
    played = play(engine, fmt, environments, ids, horizon=HORIZON, max_new_tokens=EMBEDDED_ROLLOUT["max_new_tokens"],
                  max_tokens=EMBEDDED_ROLLOUT["max_tokens"])
    engine.close()
    for env in environments:
        env.close()
    solved = collections.defaultdict(list)
    for episode in played:
        solved[episode.task_id % len(LEVELS)].append(episode.success)
    return {level: sum(solved[level]) / len(solved[level]) for level in levels}


def write(name: str, levels: list[int], train_seeds) -> None:
    per_level = -(-MIN_TEST // len(levels))
    test_seeds = TEST_SEEDS + list(range(TRAIN_SEEDS.stop, TRAIN_SEEDS.stop + max(0, per_level - len(TEST_SEEDS))))
    train = [seed * len(LEVELS) + level for seed in train_seeds for level in levels]
    test = [seed * len(LEVELS) + level for seed in test_seeds for level in levels]
    save_task_ids(DATA_DIR / f"babyai_{name}_train.json", "babyai", train)
    save_task_ids(DATA_DIR / f"babyai_{name}_test.json", "babyai", test)
    print(f"{name}: {', '.join(LEVELS[level][7:-3] for level in levels)}: {len(train)} train and {len(test)} test task ids")


def goals(level: int, seeds) -> set[str]:
    """The distinct goals of a level's missions over these seeds ("go to the red ball" and "go to a red ball"
    are one)."""
    env = envs.make("babyai")
    missions = {env.reset(seed * len(LEVELS) + level).split("\n")[0] for seed in seeds}
    env.close()
    return {" ".join(word for word in mission.split() if word not in ("a", "the")) for mission in missions}


if __name__ == "__main__":
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    expert = success_by_level(lambda environments: ExpertEngine(fmt, environments), fmt, list(range(len(LEVELS))),
                              TRAIN_SEEDS, 1)
    short = [level for level, share in expert.items() if share >= EXPERT_SHARE]
    write("short", short, TRAIN_SEEDS)
    write("tiny", [level for level in short if len(goals(level, GOAL_SEEDS)) <= MAX_GOALS], RL_SEEDS)
