"""bench section context: what each --context mode costs and buys on long horizons (docs/long-horizons.md). For each
env of --context-envs and each mode of --contexts, `python train.py` for --context-steps steps at --context-horizon
turns from the same seed: the prompt tokens a turn was sampled after (mean, and the largest), the sequences an
episode trained as, a training step's wall time (perf/step_s, the rollout's and the update's), the share of episodes
the token budget ended, the reward and success of the steps' episodes; and a plot of the mean prompt against the
sampled turn's index, a panel an env (flat under a window, growing under full), beside the JSON (--out with
_context.png).

    python scripts/bench.py --sections context --model tiny-generalist
    python scripts/bench.py --sections context --contexts full window:8 summary:10 --context-horizon 30
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from bench.common import Args, pyplot, save, train_metrics


def section_context(args: Args, work: Path) -> dict:
    """Every env x mode's run, read off its metrics.jsonl and rollouts.jsonl; the figures and the plot."""
    result = {"horizon": args.context_horizon, "steps": args.context_steps, "runs": {}}
    curves = {}
    for env in args.context_envs:
        for mode in args.contexts:
            name = f"{env}-{mode.replace(':', '')}"
            command = [sys.executable, "train.py", "--model", args.model, "--env", env, "--context", mode,
                       "--steps", str(args.context_steps), "--horizon", str(args.context_horizon), "--eval-every", "0",
                       "--save-every", "0", "--log-rollouts-every", "1", "--out-dir", str(work), "--run-name", name,
                       *shlex.split(args.context_args)]
            rows = [r for r in train_metrics("context", command, work / name) if r.get("charts/step", 0) >= 1]
            records = [json.loads(line) for line in (work / name / "rollouts.jsonl").read_text().splitlines()]
            result["runs"][name] = {"env": env, "context": mode, **context_figures(rows, records)}
            curves[name] = prompt_curve(records)
    result["plot"] = plot_context(curves, result["runs"], Path(args.out).with_name(Path(args.out).stem + "_context.png"))
    return result


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def context_figures(rows: list[dict], records: list[dict]) -> dict:
    """A run's figures: its steps' means (prompt tokens, segments, step time, rollout and update time, reward,
    success, the share the budget ended), the largest prompt, and the env turns its episodes played."""
    figures = {key.split("/")[-1]: mean([r[key] for r in rows]) for key in
               ("rollout/prompt_tokens", "rollout/segments", "perf/step_s", "rollout/reward", "rollout/success",
                "finish/max_tokens", "rollout/turns")}
    return figures | {"prompt_tokens_max": max(r["rollout/prompt_tokens_max"] for r in rows),
                      "rollout_s": mean([r.get("perf/rollout_s", 0.0) for r in rows]),
                      "update_s": mean([r.get("perf/update_s", 0.0) for r in rows]), "episodes": len(records)}


def prompt_curve(records: list[dict]) -> list[float]:
    """The mean prompt tokens of the k-th sampled turn over the episodes that sampled one, for every k."""
    longest = max((len(r.get("prompt_tokens", [])) for r in records), default=0)
    return [mean([r["prompt_tokens"][k] for r in records if len(r.get("prompt_tokens", [])) > k])
            for k in range(longest)]


def plot_context(curves: dict[str, list[float]], runs: dict[str, dict], path: Path) -> str | None:
    """Mean prompt tokens against the sampled turn, a line per mode, a panel per env."""
    plt = pyplot()
    if plt is None:
        return None
    env_names = list(dict.fromkeys(run["env"] for run in runs.values()))
    figure, axes = plt.subplots(1, len(env_names), figsize=(5 * len(env_names), 3.6), squeeze=False)
    for axis, env in zip(axes[0], env_names):
        for name, curve in curves.items():
            if runs[name]["env"] == env:
                axis.plot(range(1, len(curve) + 1), curve, marker="o", markersize=3, label=runs[name]["context"])
        axis.set_title(env)
        axis.set_xlabel("sampled turn")
        axis.set_ylabel("prompt tokens (mean over episodes)")
        axis.legend(fontsize=8)
    return save(figure, path)


def context_rows(result: dict) -> list[str]:
    """The context section's rows: an env x mode each."""
    lines = []
    for name, f in result.get("runs", {}).items():
        lines.append(f"| context | {f['env']} {f['context']} ({result['horizon']} turns, {result['steps']} steps): prompt "
                     f"tokens a turn mean / max, segments an episode, step s (rollout, update), ended by the budget, "
                     f"reward / success | {f['prompt_tokens']:,.0f} / {f['prompt_tokens_max']:,.0f}, "
                     f"{f['segments']:.1f}, {f['step_s']:.1f} ({f['rollout_s']:.1f}, {f['update_s']:.1f}), "
                     f"{f['max_tokens']:.0%}, {f['reward']:.3f} / {f['success']:.2f} | flat under window and summary |")
    return lines
