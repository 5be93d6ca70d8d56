"""bench section async: `python train.py` on a long-tailed env latency workload (--async-delay, train.py's --env-delay:
envs/latency.py, by default WebArena's measured distribution), the synchronous loop and --max-staleness 1, 2, 4
(--staleness), one after another, each for --async-steps steps from the same seed (--seeds: one run of each per seed):
training steps per hour and env steps (of the trained episodes) per hour, over the sum of the steps' wall times
(perf/step_s: model loading left out, the asynchronous runs' first fill of k + 1 steps' tasks in; an asynchronous run
goes k steps further, unmeasured, so that its last measured steps play the next steps' sets as they would mid-run, not
an empty queue), the same over its steady state (the second half of the steps: past the first fill for k <= 3 at 8
steps); the engine's idle share (1 - its generating seconds / the step's); the reward and success of the last three
steps (the mean over seeds, and their range); and a plot of reward against wall time beside the JSON (--out with .png).

    python scripts/bench.py --sections async --seeds 1 2
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from bench.common import Args, pyplot, save, train_metrics


def section_async(args: Args, work: Path) -> dict:
    """Each loop (synchronous, then each --staleness k) per seed, train.py for --async-steps steps on the
    --async-delay workload, read off its metrics.jsonl; the figures, and the curves' plot."""
    runs = {}
    for seed in args.seeds:
        for k in (None, *args.staleness):
            name = f"{'sync' if k is None else f'k{k}'}-seed{seed}"
            steps = args.async_steps + (k or 0)  # (k more: the last measured steps play the next ones' sets, as mid-run)
            command = [sys.executable, "train.py", "--model", args.model, "--steps", str(steps),
                       "--seed", str(seed), "--env-delay", args.async_delay, "--eval-every", "0", "--save-every", "0",
                       "--out-dir", str(work), "--run-name", name, *shlex.split(args.async_args),
                       *(["--max-staleness", str(k)] if k is not None else [])]
            rows = train_metrics("async", command, work / name)
            runs[name] = [r for r in rows if 1 <= r.get("charts/step", 0) <= args.async_steps]
    loops = {"sync": None, **{f"k{k}": k for k in args.staleness}}
    result = {"delay": args.async_delay, "steps": args.async_steps, "seeds": list(args.seeds), "loops": {}}
    for loop in loops:
        figures = [async_figures(runs[f"{loop}-seed{seed}"]) for seed in args.seeds]
        result["loops"][loop] = {key: sum(f[key] for f in figures) / len(figures) for key in figures[0]} | {
            "reward_range": [min(f["reward"] for f in figures), max(f["reward"] for f in figures)],
            "success_range": [min(f["success"] for f in figures), max(f["success"] for f in figures)]}
    sync = result["loops"]["sync"]["steps_per_hour"]
    steady = result["loops"]["sync"]["steady_steps_per_hour"]
    for figures in result["loops"].values():
        figures["speedup"] = figures["steps_per_hour"] / sync
        figures["steady_speedup"] = figures["steady_steps_per_hour"] / steady
    result["plot"] = plot_async(runs, Path(args.out).with_suffix(".png"))
    return result


def async_figures(rows: list[dict]) -> dict:
    """A run's throughput and outcome: steps and env steps per hour over its steps' summed wall time, the engine's
    mean idle share, the reward and success of its last three steps."""
    seconds = sum(r["perf/step_s"] for r in rows)
    last = rows[-3:]
    steady = rows[len(rows) // 2:]  # (past the first fill for k <= 3 at 8 steps)
    return {"steps_per_hour": 3600 * len(rows) / seconds,
            "steady_steps_per_hour": 3600 * len(steady) / sum(r["perf/step_s"] for r in steady),
            "env_steps_per_hour": 3600 * sum(r["rollout/turns"] * r["rollout/trajectories"] for r in rows) / seconds,
            "engine_idle_share": sum(r["perf/engine_idle_share"] for r in rows) / len(rows),
            "step_s": seconds / len(rows),
            "reward": sum(r["rollout/reward"] for r in last) / len(last),
            "success": sum(r["rollout/success"] for r in last) / len(last),
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows)}


def plot_async(runs: dict[str, list[dict]], path: Path) -> str | None:
    """Reward against wall time, a line per run: what a fixed time buys each loop."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    loops = list(dict.fromkeys(name.split("-")[0] for name in runs))  # (a colour a loop, a line style a seed)
    seeds = list(dict.fromkeys(name.split("-", 1)[1] for name in runs))
    for name, rows in runs.items():
        loop, seed = name.split("-", 1)
        elapsed = [sum(r["perf/step_s"] for r in rows[:i + 1]) / 60 for i in range(len(rows))]
        axis.plot(elapsed, [r["rollout/reward"] for r in rows], marker="o", markersize=3, label=name,
                  color=f"C{loops.index(loop)}", linestyle=("-", "--", ":", "-.")[seeds.index(seed) % 4])
    axis.set_xlabel("wall time of the training steps (min)")
    axis.set_ylabel("rollout reward")
    axis.set_title("synchronous vs --max-staleness k on a long-tailed env")
    axis.legend(fontsize=7)
    return save(figure, path)


def async_rows(result: dict) -> list[str]:
    """The async section's rows: a loop each, its throughput against the synchronous loop's and its outcome."""
    if "loops" not in result:
        return []
    seeds = len(result["seeds"])
    lines = []
    for loop, f in result["loops"].items():
        spread = (f" (seeds {f['reward_range'][0]:.3f}-{f['reward_range'][1]:.3f})" if seeds > 1 else "")
        lines.append(f"| async | {'synchronous' if loop == 'sync' else '--max-staleness ' + loop[1:]}: steps/h, env steps/h, "
                     f"engine idle, reward{spread} / success of the last 3 of {result['steps']} steps "
                     f"({result['delay']}, {seeds} seed{'s' if seeds > 1 else ''}; steady: the second half) | "
                     f"{f['steps_per_hour']:,.0f} ({f['speedup']:.2f}x; steady {f['steady_speedup']:.2f}x), "
                     f"{f['env_steps_per_hour']:,.0f}, {f['engine_idle_share']:.0%}, "
                     f"{f['reward']:.3f} / {f['success']:.2f} | {'>= 2.5x at k <= 2' if loop in ('k1', 'k2') else ''} |")
    return lines
