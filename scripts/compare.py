"""train.py configurations side by side over seeds: held-out success before and after with 95% intervals, each
against the first configuration, wall time, env steps, invalid actions, and the curves overlaid.

    python scripts/compare.py --out runs/compare-babyai --seeds 1 2 3 --common "--eval-every 4" \\
        --run grpo "--algo grpo" --run gigpo "--algo gigpo"
    python scripts/compare.py --out runs/compare-babyai --seeds 1 2 3 --common "--eval-every 4" --baseline grpo \\
        --run grpo "--algo grpo" --run auto "--horizon auto" --run fixed6 "--horizon 6"

Each (configuration, seed) is `python train.py --seed S <--common> <its flags>` into <out>/<name>-seed<S>; a run that
finished before (its <out>/<name>-seed<S>.json) is read, not run again, so configurations can be added to a
comparison later and share runs (the second command reuses the first's grpo runs). The figures:

- held-out success at step 0 and at the last evaluation, over the seeds' evaluations pooled by task (a task's success
  the mean over seeds and episodes), the gain paired by task with its 95% interval (rl/scores.py's `paired`), and
  each seed's gain; every configuration's last evaluation against the first configuration's, paired the same way;
- wall time (the train.py process: loading and evaluations included) and training time (its steps' rollout and update
  seconds summed, perf/rollout_s + perf/update_s: so configurations that evaluate at different steps compare), env
  steps (the trained episodes' turns, summed over the steps), the invalid-action share of the first and of the last
  steps, the share of turns in a GiGPO anchor group of two or more;
- where the runs play several envs (train.py --env babyai textcraft) or the configurations different ones (a generalist
  and its specialists): the same per env, each env's held-out tasks apart, and each configuration against the first on
  the tasks of an env both played;
- with --task-sets NAME=FILE ...: the same gains on each set's tasks apart (task id files as train.py's --test-tasks
  reads them), where the evaluation plays sets of different meaning: training tasks beside the same goals renamed,
  say (docs/environments.md, TextCraft's reach);
- with --baseline NAME: the baseline's final held-out success (mean over seeds) as a target, and for each run the env
  steps it had taken at its first evaluation at or above it (train.py --eval-every sets how often it looks), as a share
  of the baseline's env steps.

Writes <out>/compare.json, prints the table (Markdown), and draws <out>/curves.png (scripts/plot.py, every run overlaid)
and <out>/compare.png (training success, invalid actions and held-out success against env steps, a colour a
configuration, a line style a seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.records import read_log, read_metrics  # noqa: E402
from rl.scores import paired  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs=2, action="append", metavar=("NAME", "FLAGS"), required=True,
                        help='a configuration: its name and its train.py flags as one string ("" for none)')
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--common", default="", help="train.py flags of every run")
    parser.add_argument("--out", type=Path, required=True, help="the directory of the runs and the results")
    parser.add_argument("--baseline", help="the configuration whose final held-out success the others race to")
    parser.add_argument("--task-sets", nargs="+", default=[], metavar="NAME=FILE",
                        help="the evaluated tasks' gains on each set apart (a task id file each)")
    args = parser.parse_args(argv)
    args.task_sets = dict(task_set(parser, spec) for spec in args.task_sets)
    names = [name for name, _ in args.run]
    if len(set(names)) < len(names) or any(not name.replace("_", "").replace(".", "").isalnum() for name in names):
        parser.error("--run names must be distinct, letters, digits, '_' and '.'")
    if args.baseline is not None and args.baseline not in names:
        parser.error(f"--baseline {args.baseline} is not one of the --run names ({', '.join(names)})")
    return args


def task_set(parser, spec: str) -> tuple[str, set[str]]:
    """NAME=FILE: the item ids of a task file."""
    name, _, path = spec.partition("=")
    if not name or not path:
        parser.error(f"--task-sets {spec}: give NAME=FILE")
    try:
        return name, {row["item_id"] for row in json.loads(Path(path).read_text())}
    except (OSError, ValueError, TypeError, KeyError) as error:
        parser.error(f"--task-sets {spec}: not a task id file ({error})")


def play(name: str, flags: str, seed: int, args) -> dict:
    """One run of train.py (or the one that finished before): its figures, with its directory and wall time."""
    run = f"{name}-seed{seed}"
    done = args.out / f"{run}.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(args.out / run, ignore_errors=True)  # (a run cut short before: played again, whole)
    command = [sys.executable, "train.py", "--seed", str(seed), "--out-dir", str(args.out.resolve()), "--run-name", run,
               *shlex.split(args.common), *shlex.split(flags)]
    print("compare: " + shlex.join(command), flush=True)
    start = time.perf_counter()
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    finished = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if finished.returncode != 0:
        raise SystemExit(f"{run} failed ({finished.returncode}): {finished.stderr.strip()[-1500:]}")
    figures = {"run_dir": str(args.out / run), "wall_s": time.perf_counter() - start, "command": shlex.join(command)}
    done.write_text(json.dumps(figures) + "\n")
    return figures


def figures_of(run_dir: Path) -> dict:
    """A run's curves: held-out success per task at every evaluation, env steps so far at every step, and the
    per-step shares."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "rollout/trajectories" in r]
    evaluations = defaultdict(lambda: defaultdict(list))
    for record in read_log(run_dir / "evaluations.jsonl"):
        if record.get("final", True):
            evaluations[record["step"]][record["item_id"]].append(float(record["success"]))
    env_steps, so_far = {0: 0.0}, 0.0
    for r in rows:
        so_far += r["rollout/turns"] * r["rollout/trajectories"]
        env_steps[r["charts/step"]] = so_far
    return {"held_out": {step: {task: sum(s) / len(s) for task, s in tasks.items()} for step, tasks in evaluations.items()},
            "env_steps": env_steps, "rows": rows}


def pooled(runs: list[dict], step: str) -> dict:
    """Per task, the mean success over the runs' evaluation at `step` ("first" or "last")."""
    by_task = defaultdict(list)
    for run in runs:
        held = run["held_out"]
        for task, success in held[min(held) if step == "first" else max(held)].items():
            by_task[task].append(success)
    return {task: sum(s) / len(s) for task, s in by_task.items()}


def env_of(task: str) -> str:
    """The env of a held-out task by its item id (babyai_12: babyai)."""
    return task.rpartition("_")[0]


def env_gains(before: dict, after: dict, first: dict | None) -> dict:
    """Per env of the held-out tasks: the gain paired by task, and against the first configuration's last evaluation
    on that env's tasks both played (a generalist against a specialist, say), where it has any."""
    gains = {}
    for env in sorted({env_of(task) for task in after}):
        mine = {task: value for task, value in after.items() if env_of(task) == env}
        first_of_env = {t: v for t, v in before.items() if env_of(t) == env}
        if not set(first_of_env) & set(mine):  # (its first evaluation played none of them: no gain to pair)
            continue
        gains[env] = {"gain": paired(first_of_env, mine)}
        if first is not None and set(first) & set(mine):
            gains[env]["against_first"] = paired(first, mine)
    return gains


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def set_gains(before: dict, after: dict, sets: dict[str, set[str]]) -> dict:
    """Per task set: the gain paired by task on the set's tasks the evaluations played."""
    return {name: paired({t: v for t, v in before.items() if t in tasks}, {t: v for t, v in after.items() if t in tasks})
            for name, tasks in sets.items() if set(before) & set(after) & tasks}


def summarise(configs: dict[str, list[dict]], baseline: str | None, sets: dict[str, set[str]] | None = None) -> dict:
    first = next(iter(configs))
    results = {}
    target = None
    if baseline is not None:
        runs = configs[baseline]
        target = {"success": mean(mean(r["held_out"][max(r["held_out"])].values()) for r in runs),
                  "env_steps": mean(r["env_steps"][max(r["env_steps"])] for r in runs)}
    for name, runs in configs.items():
        before, after = pooled(runs, "first"), pooled(runs, "last")
        result = {
            "seeds": len(runs), "gain": paired(before, after),
            "seed_gains": [mean(r["held_out"][max(r["held_out"])].values()) - mean(r["held_out"][min(r["held_out"])].values())
                           for r in runs],
            "wall_s": mean(r["wall_s"] for r in runs), "wall_range": [min(r["wall_s"] for r in runs), max(r["wall_s"] for r in runs)],
            "train_s": mean(sum(x["perf/rollout_s"] + x["perf/update_s"] for x in r["rows"]) for r in runs),
            "env_steps": mean(r["env_steps"][max(r["env_steps"])] for r in runs),
            "invalid_first": mean(mean(x["rollout/invalid_action_rate"] for x in r["rows"][:3]) for r in runs),
            "invalid_last": mean(mean(x["rollout/invalid_action_rate"] for x in r["rows"][-3:]) for r in runs),
            "anchored_share": mean(mean(x.get("rollout/anchored_share", 0.0) for x in r["rows"]) for r in runs),
        }
        if name != first:
            result["against_first"] = paired(pooled(configs[first], "last"), after)
        result["envs"] = env_gains(before, after, pooled(configs[first], "last") if name != first else None)
        result["sets"] = set_gains(before, after, sets or {})
        result["set_seed_gains"] = {label: [set_gains(r["held_out"][min(r["held_out"])], r["held_out"][max(r["held_out"])],
                                                      {label: sets[label]}).get(label, {"gain": float("nan")})["gain"]
                                            for r in runs] for label in result["sets"]}
        if target is not None:
            reached = [next((r["env_steps"][step] for step in sorted(r["held_out"]) if step > 0
                             and mean(r["held_out"][step].values()) >= target["success"] - 1e-9), None) for r in runs]
            result["to_target"] = reached
            result["to_target_share"] = [None if e is None else e / target["env_steps"] for e in reached]
        results[name] = result
    return {"first": first, "target": target, "configs": results}


def table(summary: dict, seeds: list[int]) -> str:
    def interval(g):
        return f"{g['gain']:+.3f} ({g['low']:+.3f} to {g['high']:+.3f})" if g["low"] is not None else f"{g['gain']:+.3f}"

    first = summary["first"]
    lines = [f"seeds {' '.join(map(str, seeds))}; held-out success pooled over the seeds by task, gains paired by task "
             "with their 95% interval", "",
             f"| configuration | held-out before -> after | gain | each seed's gain | vs {first}, after | wall (min) | "
             "rollouts + updates (min) | env steps | invalid actions, first -> last 3 steps | turns in an anchor group >= 2 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["configs"].items():
        g = r["gain"]
        lines.append(f"| {name} | {g['before']:.3f} -> {g['after']:.3f} | {interval(g)} | "
                     f"{', '.join(f'{x:+.3f}' for x in r['seed_gains'])} | "
                     f"{interval(r['against_first']) if 'against_first' in r else '-'} | "
                     f"{r['wall_s'] / 60:.1f} ({r['wall_range'][0] / 60:.1f}-{r['wall_range'][1] / 60:.1f}) | "
                     f"{r['train_s'] / 60:.1f} | "
                     f"{r['env_steps']:,.0f} | {r['invalid_first']:.2f} -> {r['invalid_last']:.2f} | {r['anchored_share']:.2f} |")
    if any(len(r["envs"]) > 1 for r in summary["configs"].values()) or \
            len({env for r in summary["configs"].values() for env in r["envs"]}) > 1:
        lines += ["", f"per env (each configuration's held-out tasks of that env; vs {first}: on the tasks of that env "
                  "both played)", "", f"| configuration | env | tasks | held-out before -> after | gain | vs {first}, after |",
                  "|---|---|---|---|---|---|"]
        for name, r in summary["configs"].items():
            for env, e in r["envs"].items():
                g = e["gain"]
                lines.append(f"| {name} | {env} | {g['tasks']} | {g['before']:.3f} -> {g['after']:.3f} | {interval(g)} | "
                             f"{interval(e['against_first']) if 'against_first' in e else '-'} |")
    if any(r["sets"] for r in summary["configs"].values()):
        lines += ["", "per task set (--task-sets: the evaluated tasks of each set)", "",
                  "| configuration | task set | tasks | before -> after | gain | each seed's gain |", "|---|---|---|---|---|---|"]
        for name, r in summary["configs"].items():
            for label, g in r["sets"].items():
                lines.append(f"| {name} | {label} | {g['tasks']} | {g['before']:.3f} -> {g['after']:.3f} | {interval(g)} | "
                             f"{', '.join(f'{x:+.3f}' for x in r['set_seed_gains'][label])} |")
    target = summary["target"]
    if target is not None:
        lines += ["", f"target: the baseline's final held-out success {target['success']:.3f}, reached in "
                  f"{target['env_steps']:,.0f} env steps (mean over seeds)", "",
                  "| configuration | env steps at the first evaluation >= target, each seed | share of the baseline's |",
                  "|---|---|---|"]
        for name, r in summary["configs"].items():
            lines.append(f"| {name} | {', '.join('not reached' if e is None else f'{e:,.0f}' for e in r['to_target'])} | "
                         f"{', '.join('-' if s is None else f'{s:.0%}' for s in r['to_target_share'])} |")
    return "\n".join(lines)


def plot_compare(configs: dict[str, list[dict]], seeds: list[int], target: dict | None, path: Path) -> None:
    """Three panels, a colour a configuration, a line style a seed: training success per step (mean of 3 steps), the
    invalid-action share per step, held-out success against env steps (with --baseline: its final success, and 70% of
    its env steps)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for c, (name, runs) in enumerate(configs.items()):
        for s, run in enumerate(runs):
            style = {"color": f"C{c}", "linestyle": ("-", "--", ":", "-.")[s % 4], "label": f"{name} seed {seeds[s]}"}
            steps = [r["charts/step"] for r in run["rows"]]
            success = [r["rollout/success"] for r in run["rows"]]
            axes[0].plot(steps, [mean(success[max(0, i - 2):i + 1]) for i in range(len(success))], **style)
            axes[1].plot(steps, [r["rollout/invalid_action_rate"] for r in run["rows"]], **style)
            held = sorted(run["held_out"])
            axes[2].plot([run["env_steps"].get(step, 0) for step in held], [mean(run["held_out"][step].values()) for step in held],
                         marker="o", markersize=3, **style)
    if target is not None:
        axes[2].axhline(target["success"], color="grey", linewidth=0.8)
        axes[2].axvline(0.7 * target["env_steps"], color="grey", linewidth=0.8, linestyle=":")
    for axis, (x, y) in zip(axes, [("step", "training success (mean of 3 steps)"), ("step", "invalid-action share"),
                                    ("env steps of the trained episodes so far", "held-out success")]):
        axis.set_xlabel(x)
        axis.set_ylabel(y)
    axes[2].legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    configs = {}
    for name, flags in args.run:
        configs[name] = []
        for seed in args.seeds:
            played = play(name, flags, seed, args)
            configs[name].append(figures_of(Path(played["run_dir"])) | {"wall_s": played["wall_s"]})
    for runs in configs.values():
        for run in runs:
            if len(run["held_out"]) < 2:
                raise SystemExit("every run needs its step-0 evaluation and a later one: give --eval-every (in --common)")
    summary = summarise(configs, args.baseline, args.task_sets)
    print(table(summary, args.seeds))
    (args.out / "compare.json").write_text(json.dumps({"runs": dict(args.run), "seeds": args.seeds, "common": args.common,
                                                       **summary}, indent=2) + "\n")
    plot_compare(configs, args.seeds, summary["target"], args.out / "compare.png")
    run_dirs = [str(args.out / f"{name}-seed{seed}") for name in configs for seed in args.seeds]
    subprocess.run([sys.executable, "scripts/plot.py", *run_dirs, "--out", str(args.out / "curves.png")], cwd=ROOT,
                   stdout=subprocess.DEVNULL, check=False)
    print(f"wrote {args.out / 'compare.json'}, {args.out / 'compare.png'}, {args.out / 'curves.png'}")
    return summary


if __name__ == "__main__":
    main()
