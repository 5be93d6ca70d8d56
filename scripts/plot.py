"""Plots of a run's curves from its metrics.jsonl, as PNGs, with no service: training reward and success
per step (and their running mean) and per task category, the test success of every evaluation (step 0 is
the initial policy), turns against the horizon cap with ScalingInter-RL's stages shaded, how episodes
ended (finish reasons, invalid actions, groups without reward variance), KL and entropy, clipping and
gradient norm, throughput, time and peak memory. An eval result (eval.py's .json) is drawn as Avg@k and
Pass@k per category, a sweep of horizons' (eval.py --horizon 5 10 20) as both against the horizon.
train.py and eval.py run this at their end.

    python scripts/plot.py runs/<run>                                  # -> runs/<run>/curves.png
    python scripts/plot.py runs/a runs/b runs/c --out curves.png       # several runs (e.g. seeds) overlaid
    python scripts/plot.py runs/eval/babyai-tiny-agent-....json        # -> the same name, .png

A run that is still going is plotted as far as it got; a line torn by a crash is skipped. A series of few
points (a short run, the evaluations) is drawn with a marker at each, so that a 1-step run's single points show.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MultipleLocator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rl.records import read_metrics  # noqa: E402

FEW_POINTS = 20  # a series with at most this many points gets a marker at each

PANELS = [  # (title, [(metric or pattern, label)], y limits or None); a "*" pattern is one line per match
    ("training episodes", [("rollout/success", "success"), ("rollout/reward", "reward")], (0, 1)),
    ("training success by category", [("category/*/success", "*")], (0, 1)),
    ("held-out test tasks", [("eval/success", "success")], (0, 1)),
    ("turns", [("rollout/turns", "turns"), ("rollout/horizon", "horizon cap")], None),
    ("how episodes ended (shares)", [("finish/*", "*"), ("rollout/invalid_action_rate", "invalid actions"),
                                     ("rollout/zero_variance_groups", "groups without signal")], (0, 1)),
    ("policy", [("losses/kl", "KL to the initial policy"), ("losses/entropy", "entropy")], None),
    ("update", [("losses/clipfrac", "clip fraction"), ("losses/grad_norm", "gradient norm")], None),
    ("throughput", [("perf/tokens_per_s", "sampled tokens/s"), ("perf/update_tokens_per_s", "update tokens/s")], None),
    ("time", [("perf/step_s", "step s"), ("perf/rollout_s", "rollout s"), ("perf/update_s", "update s")], None),
    ("peak memory (GiB)", [("perf/rollout_peak_gib", "rollout"), ("perf/update_peak_gib", "update")], None),
]


def run_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give a run directory (runs/<run>)")
    return read_metrics(path)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["charts/step"], row[key]) for row in rows if key in row and "charts/step" in row]
    return [p[0] for p in points], [p[1] for p in points]


def running_mean(values: list[float], width: int) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def shade_stages(axis, rows: list[dict]) -> None:
    """Alternate shading for each stretch of steps under one horizon cap (ScalingInter-RL's stages)."""
    steps, horizons = series(rows, "rollout/horizon")
    start = 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or horizons[i] != horizons[start]:
            if len(set(horizons)) > 1:
                axis.axvspan(steps[start] - 0.5, steps[i - 1] + 0.5, alpha=0.06 if horizons[start] % 2 else 0.12, color="grey")
                axis.text(steps[start], axis.get_ylim()[1], f" {horizons[start]} turns", va="top", fontsize=7, color="grey")
            start = i


def expand(keys: list[tuple[str, str]], rows: list[dict]) -> list[tuple[str, str]]:
    """The (metric, label) pairs of a panel, each "*" pattern replaced by the metrics it matches."""
    out = []
    for key, label in keys:
        if "*" not in key:
            out.append((key, label))
            continue
        matched = sorted({name for row in rows for name in row if fnmatch.fnmatch(name, key)})
        prefix, _, suffix = key.partition("*")
        out += [(name, name[len(prefix):len(name) - len(suffix)]) for name in matched]
    return out


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    figure, axes = plt.subplots(2, 5, figsize=(25, 8))
    for axis, (title, patterns, limits) in zip(axes.flat, PANELS):
        for k, (name, rows) in enumerate(runs.items()):
            keys = expand(patterns, rows)
            for j, (key, label) in enumerate(keys):
                steps, values = series(rows, key)
                if not steps:
                    continue
                color = f"C{(k * len(keys) + j) % 10}"
                tag = f"{label} ({name})" if len(runs) > 1 else label
                smooth = key.startswith("rollout/") and key != "rollout/horizon" and len(values) > 4
                few = len(values) <= FEW_POINTS or key.startswith("eval/")
                axis.plot(steps, values, color=color, alpha=0.3 if smooth else 1.0, marker="o" if few else None,
                          markersize=4, label=None if smooth else tag)
                if smooth:
                    axis.plot(steps, running_mean(values, 5), color=color, label=f"{tag}, mean of 5")
        if limits:  # (a little beyond, so that a point at 0 or 1 shows whole)
            axis.set_ylim(limits[0] - 0.03, limits[1] + 0.03)
        shade_stages(axis, next(iter(runs.values())))
        axis.set_title(title)
        axis.set_xlabel("step")
        steps = [row["charts/step"] for rows in runs.values() for row in rows if "charts/step" in row]
        if steps and max(steps) - min(steps) < 10:  # a short run: whole steps, and room around a single one
            axis.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
            axis.xaxis.set_major_locator(MultipleLocator(1))
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    save(figure, out)


def save(figure, out: Path) -> None:
    """Write the PNG beside its final name and rename it into place: never half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    tmp.replace(out)


def plot_eval(path: Path, out: Path) -> None:
    """Avg@k and Pass@k per category of an eval result (eval.py's .json), overall first."""
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"{path} is not an eval result: {error}") from error
    if "avg@k" not in result:
        raise SystemExit(f"{path} is not an eval result (no avg@k): give eval.py's .json")
    k = result.get("k", "k")
    if "sweep" in result:
        return plot_sweep(result, out)
    names = ["overall", *result.get("categories", {})]
    values = [result] + list(result.get("categories", {}).values())
    figure, axis = plt.subplots(figsize=(max(6.0, 0.6 * len(names) + 2), 4))
    x = range(len(names))
    axis.bar([i - 0.2 for i in x], [v["avg@k"] for v in values], width=0.4, label=f"Avg@{k}")
    axis.bar([i + 0.2 for i in x], [v["pass@k"] for v in values], width=0.4, label=f"Pass@{k}")
    axis.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
    axis.set_title(f"{result.get('model', '')}: {result.get('env', '')} {result.get('split', '')}, "
                   f"{result.get('tasks', '?')} tasks x {k}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    save(figure, out)


def plot_sweep(result: dict, out: Path) -> None:
    """A sweep of horizons (eval.py --horizon 5 10 20 ...): Avg@k and Pass@k against the horizon, overall and
    per category, as the paper's figure on scaling test-time interaction."""
    k, sweep = result.get("k", "k"), result["sweep"]
    horizons = [row["horizon"] for row in sweep]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, key, label in ((axes[0], "avg@k", f"Avg@{k}"), (axes[1], "pass@k", f"Pass@{k}")):
        axis.plot(horizons, [row[key] for row in sweep], marker="o", color="black", linewidth=2, label="overall")
        for name in sweep[0].get("categories", {}):
            axis.plot(horizons, [row["categories"][name][key] for row in sweep], marker=".", alpha=0.7, label=name)
        axis.set_xlabel("horizon (turns)")
        axis.set_ylabel(label)
        axis.set_xticks(horizons)
        axis.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    figure.suptitle(f"{result.get('model', '')}: {result.get('env', '')} {Path(str(result.get('split', ''))).name}, "
                    f"{result.get('tasks', '?')} tasks x {k}, agent {result.get('agent', 'react')}", fontsize=9)
    figure.tight_layout()
    save(figure, out)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<run>), or one eval result (.json)")
    parser.add_argument("--out", type=Path, help="default: <run>/curves.png (first run), <result>.png")
    args = parser.parse_args(argv)
    if args.runs[0].suffix == ".json":
        out = args.out or args.runs[0].with_suffix(".png")
        plot_eval(args.runs[0], out)
        print(f"wrote {out}")
        return out
    names = [run.name if [r.name for r in args.runs].count(run.name) == 1 else f"{run.parent.name}/{run.name}"
             for run in args.runs]
    runs = {name: run_metrics(run) for name, run in zip(names, args.runs)}
    out = args.out or args.runs[0] / "curves.png"
    plot(runs, out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
