"""WebArena env throughput and memory with 1, 4 and 8 concurrent envs, on the local sites.

    python scripts/bench_webarena.py                      # 20 s per setting
    python scripts/bench_webarena.py --seconds 60 --envs 1 4 8 16 --settle-s 0

Each env plays the local tasks with their oracles (reset, the expert's actions, stop + evaluation,
next task) in its own thread of a pool, all envs sharing the process's one Chromium, as a rollout
does. Reported per setting: actions/s (env.step calls, summed over envs), resets/s, the median
step and reset latency, and memory sampled every 0.5 s: the peak RSS summed over this process,
the Playwright driver and every Chromium process (shared pages counted in each process, so an
over-estimate), and the peak PSS (shared pages split between processes: the honest total).
"""

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from envs.webarena import tasks  # noqa: E402
from envs.webarena.browser import chromium_pids, descendants  # noqa: E402


def memory_mib() -> tuple[float, float]:
    """(RSS, PSS) in MiB of this process and all its descendants."""
    import os

    rss = pss = 0
    for pid in [os.getpid(), *descendants()]:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    return rss / 1024, pss / 1024


def play(env, task_ids, stop_at, latencies):
    """Play tasks until `stop_at`, appending each reset's and step's seconds to `latencies`."""
    i = 0
    while time.monotonic() < stop_at:
        started = time.monotonic()
        observation = env.reset(task_ids[i % len(task_ids)])
        latencies["reset"].append(time.monotonic() - started)
        expert = envs.oracle(env)
        done = False
        while not done and time.monotonic() < stop_at:
            started = time.monotonic()
            result = env.step(expert(observation))
            latencies["step"].append(time.monotonic() - started)
            observation, done = result.observation, result.done
        i += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=None, help="make(settle_s=...); default: the env's")
    args = parser.parse_args()
    options = {"sites": "local"} | ({"settle_s": args.settle_s} if args.settle_s is not None else {})
    judged = {i for i, c in enumerate(tasks.configs("local")) if "fuzzy_match" in (c["eval"]["reference_answers"] or {})}
    task_ids = [i for i in range(len(tasks.configs("local"))) if i not in judged]

    warm = envs.make("webarena", **options)  # launch the browser and log in once, outside the timing
    for task_id in (4, 10):
        warm.reset(task_id)
    warm.close()
    print(f"idle: {len(chromium_pids())} Chromium processes, RSS {memory_mib()[0]:.0f} MiB, PSS {memory_mib()[1]:.0f} MiB")
    print("envs  actions/s  resets/s  step p50 (ms)  reset p50 (ms)  peak RSS (MiB)  peak PSS (MiB)  Chromium procs")
    for n in args.envs:
        pool_envs = [envs.make("webarena", **options) for _ in range(n)]
        latencies = {"step": [], "reset": []}  # list appends are thread-safe
        peak, procs, sampling = [0.0, 0.0], [0], True

        def sample():
            while sampling:
                rss, pss = memory_mib()
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
                procs[0] = max(procs[0], len(chromium_pids()))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        stop_at = started + args.seconds
        with ThreadPoolExecutor(n) as pool:
            # Each env starts at a different task so that the mix is the same for every n.
            futures = [pool.submit(play, env, task_ids[k % len(task_ids):] + task_ids[:k % len(task_ids)], stop_at,
                                   latencies) for k, env in enumerate(pool_envs)]
            for future in futures:
                future.result()
        elapsed = time.monotonic() - started
        sampling = False
        sampler.join()
        for env in pool_envs:
            env.close()
        print(f"{n:4d}  {len(latencies['step']) / elapsed:9.1f}  {len(latencies['reset']) / elapsed:8.2f}  "
              f"{1000 * statistics.median(latencies['step']):13.0f}  {1000 * statistics.median(latencies['reset']):14.0f}  "
              f"{peak[0]:14.0f}  {peak[1]:14.0f}  {procs[0]:14d}", flush=True)


if __name__ == "__main__":
    main()
