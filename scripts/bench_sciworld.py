"""Benchmark the SciWorld port: step latency, resets/s and resident memory for 1, 4 and 16 envs.

In rounds, like the rollout: all envs reset a random task at once (timed), reload it with the
gold path (not timed), then step their gold actions (or random valid ones), one step of every
live env per round from a thread pool (each step timed, at most --max-steps rounds). Step latency
is what the caller waits, queueing for its JVM included. Memory is the resident set (VmRSS) of the
pool's JVMs, and of this Python process, at the end of the run.

    python scripts/bench_sciworld.py                      # 1, 4, 16 envs, defaults of make()
    python scripts/bench_sciworld.py --envs 16 --pool-size 8 --heap 384m
    python scripts/bench_sciworld.py --policy random      # random valid actions instead of gold paths
"""

import argparse
import random
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
from envs import sciworld  # noqa: E402


def rss_mib(pid="self") -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(n_envs: int, episodes: int, max_steps: int, options: dict, seed: int, policy: str) -> dict:
    sciworld.shutdown()  # every size starts from a fresh JVM, as a new run would
    rng = random.Random(seed)
    env_list = [envs.make("sciworld", **options) for _ in range(n_envs)]
    step_times, reset_times, reset_rounds, step_rounds = [], [], [], []

    def timed(fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t

    with ThreadPoolExecutor(n_envs) as pool:
        for episode in range(episodes + 1):  # the first round warms the JVM up and is not counted
            if episode == 1:
                step_times, reset_times, reset_rounds, step_rounds = [], [], [], []
            task_ids = [rng.randrange(sciworld.NUM_TASK_IDS) for _ in range(n_envs)]
            t = time.perf_counter()
            results = list(pool.map(lambda e, i: timed(e.reset, i), env_list, task_ids))
            reset_rounds.append(time.perf_counter() - t)
            reset_times += [took for _, took in results]
            observations = [observation for observation, _ in results]
            if policy == "gold":
                oracles = list(pool.map(envs.oracle, env_list))  # reloads with the gold path: not timed
            else:  # a random valid action each turn (the valid actions are computed untimed)
                oracles = [lambda _, e=e: f"Action: {rng.choice(e.valid_actions())}" for e in env_list]
            live = list(range(n_envs))
            for _ in range(max_steps):
                if not live:
                    break
                texts = [oracles[k](observations[k]) for k in live]
                t = time.perf_counter()
                results = list(pool.map(lambda k, text: timed(env_list[k].step, text), live, texts))
                step_rounds.append(time.perf_counter() - t)
                step_times += [took for _, took in results]
                for k, (result, _) in zip(live, results):
                    observations[k] = result.observation
                live = [k for k, (result, _) in zip(live, results) if not result.done]

    jvms = env_list[0].pool.jvms
    memory = sum(rss_mib(j.process.pid) for j in jvms)
    for env in env_list:
        env.close()
    step_ms = sorted(1000 * s for s in step_times)
    return {
        "envs": n_envs,
        "jvms": len(jvms),
        "steps": len(step_ms),
        "step_median_ms": statistics.median(step_ms),
        "step_p95_ms": step_ms[int(0.95 * (len(step_ms) - 1))],
        "steps_per_s": len(step_ms) / sum(step_rounds),
        "reset_median_ms": 1000 * statistics.median(reset_times),
        "resets_per_s": len(reset_times) / sum(reset_rounds),
        "jvm_rss_mib": memory,
        "python_rss_mib": rss_mib(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--episodes", type=int, default=4, help="episodes per env")
    parser.add_argument("--max-steps", type=int, default=40, help="gold steps per episode at most")
    parser.add_argument("--pool-size", type=int, default=16)
    parser.add_argument("--heap", default=None, help="JVM -Xmx (default: make()'s, from the pool size)")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=["gold", "random"], default="gold",
                        help="gold: the oracle's actions; random: a random valid action each turn")
    args = parser.parse_args()
    options = {"pool_size": args.pool_size, "heap": args.heap, "timeout": args.timeout}
    settings = envs.make("sciworld", **options).options
    print(f"pool_size={settings['pool_size']} heap={settings['heap']} episodes/env={args.episodes} "
          f"max_steps={args.max_steps} policy={args.policy}")
    print(f"{'envs':>4} {'jvms':>4} {'steps':>6} {'step med':>9} {'step p95':>9} {'steps/s':>8} "
          f"{'reset med':>10} {'resets/s':>9} {'JVM RSS':>9} {'py RSS':>8}")
    for n in args.envs:
        r = run(n, args.episodes, args.max_steps, options, args.seed, args.policy)
        print(f"{r['envs']:>4} {r['jvms']:>4} {r['steps']:>6} {r['step_median_ms']:>7.1f}ms "
              f"{r['step_p95_ms']:>7.1f}ms {r['steps_per_s']:>8.0f} {r['reset_median_ms']:>8.0f}ms "
              f"{r['resets_per_s']:>9.1f} {r['jvm_rss_mib']:>6.0f}MiB {r['python_rss_mib']:>5.0f}MiB",
              flush=True)


if __name__ == "__main__":
    main()
