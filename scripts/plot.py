"""Plots of a run's curves from its metrics.jsonl, as PNGs, with no service: training reward and success
per step (and their running mean), the test success of every evaluation (step 0 is the initial policy),
turns against the horizon cap with ScalingInter-RL's stages shaded, KL and entropy, and throughput.

    python scripts/plot.py runs/<run>                                  # -> runs/<run>/curves.png
    python scripts/plot.py runs/a runs/b runs/c --out curves.png       # several runs (e.g. seeds) overlaid

A run that is still going is plotted as far as it got; a line torn by a crash is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [  # (title, [(metric, label)], y limits or None)
    ("training episodes", [("rollout/success", "success"), ("rollout/reward", "reward")], (0, 1)),
    ("held-out test tasks", [("eval/success", "success")], (0, 1)),
    ("turns", [("rollout/turns", "turns"), ("rollout/horizon", "horizon cap")], None),
    ("policy", [("losses/kl", "KL to the initial policy"), ("losses/entropy", "entropy")], None),
    ("throughput", [("perf/tokens_per_s", "sampled tokens/s"), ("perf/update_tokens_per_s", "update tokens/s")], None),
    ("time", [("perf/step_s", "step s"), ("perf/rollout_s", "rollout s"), ("perf/update_s", "update s")], None),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give a run directory (runs/<run>)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["charts/step"], row[key]) for row in rows if key in row and "charts/step" in row]
    return [p[0] for p in points], [p[1] for p in points]


def running_mean(values: list[float], width: int) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def shade_stages(axis, rows: list[dict]) -> None:
    """Alternate shading for each stretch of steps under one horizon cap (ScalingInter-RL's stages)."""
    steps, caps = series(rows, "rollout/horizon")
    start = 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or caps[i] != caps[start]:
            if len(set(caps)) > 1:
                axis.axvspan(steps[start] - 0.5, steps[i - 1] + 0.5, alpha=0.06 if caps[start] % 2 else 0.12, color="grey")
                axis.text(steps[start], axis.get_ylim()[1], f" {caps[start]} turns", va="top", fontsize=7, color="grey")
            start = i


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for axis, (title, keys, limits) in zip(axes.flat, PANELS):
        for k, (name, rows) in enumerate(runs.items()):
            for j, (key, label) in enumerate(keys):
                steps, values = series(rows, key)
                if not steps:
                    continue
                color = f"C{(k * len(keys) + j) % 10}"
                tag = f"{label} ({name})" if len(runs) > 1 else label
                smooth = key.startswith("rollout/") and key != "rollout/horizon" and len(values) > 4
                axis.plot(steps, values, color=color, alpha=0.3 if smooth else 1.0, marker="o" if key.startswith("eval/") else None,
                          label=None if smooth else tag)
                if smooth:
                    axis.plot(steps, running_mean(values, 5), color=color, label=f"{tag}, mean of 5")
        if limits:
            axis.set_ylim(*limits)
        shade_stages(axis, next(iter(runs.values())))
        axis.set_title(title)
        axis.set_xlabel("step")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<run>)")
    parser.add_argument("--out", type=Path, help="default: <run>/curves.png (first run)")
    args = parser.parse_args(argv)
    names = [run.name if [r.name for r in args.runs].count(run.name) == 1 else f"{run.parent.name}/{run.name}"
             for run in args.runs]
    runs = {name: read_metrics(run) for name, run in zip(names, args.runs)}
    out = args.out or args.runs[0] / "curves.png"
    plot(runs, out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
