"""TextCraft speed and memory: env steps/s over oracle episodes (reset + every step, all 544
goals), reset time, and the process's peak RSS before and after 10,000 resets.

    python scripts/bench_textcraft.py [--passes 5]
"""

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from envs.textcraft import crafting_tree  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


parser = argparse.ArgumentParser()
parser.add_argument("--passes", type=int, default=5, help="oracle episodes over all 544 goals, this many times")
args = parser.parse_args()

start = time.perf_counter()
goals = crafting_tree().goals
print(f"tree: {len(goals)} goals, built in {time.perf_counter() - start:.3f} s; peak RSS {peak_rss_mib():.1f} MiB")

env = envs.make("textcraft")
steps, start = 0, time.perf_counter()
for _ in range(args.passes):
    for task_id in range(len(goals)):
        observation = env.reset(task_id)
        act = envs.oracle(env)
        while True:
            result = env.step(act(observation))
            observation, steps = result.observation, steps + 1
            if result.done:
                break
elapsed = time.perf_counter() - start
episodes = args.passes * len(goals)
print(f"oracle episodes: {episodes} ({steps} steps) in {elapsed:.2f} s: {steps / elapsed:,.0f} env steps/s "
      f"(reset + oracle plan + steps), {episodes / elapsed:,.0f} episodes/s")

before = peak_rss_mib()
start = time.perf_counter()
for task_id in range(10_000):
    env.reset(task_id)
elapsed = time.perf_counter() - start
print(f"10,000 resets in {elapsed:.2f} s ({elapsed / 10_000 * 1e3:.3f} ms each); "
      f"peak RSS {before:.1f} MiB before, {peak_rss_mib():.1f} MiB after")
