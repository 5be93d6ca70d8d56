"""A model's baseline on the five envs, on the HF and vLLM engines side by side: eval.py on a fixed subset of each env's
test tasks (--limit, spread over the split), greedy, under upstream's limits (--protocol agentgym), once per engine;
then a Markdown table of success, invalid-action share and how the episodes ended, and whether the two engines played
the same episodes (the same actions, turn by turn, and the same per-task results).

    python scripts/baseline.py --model smollm2-135m --limit 3 --out runs/baseline-smollm2

Each (env, engine) is `python eval.py --model M --env E --engine X --protocol agentgym --temperature 0 --limit N
--out <out>/<env>-<engine>`; a pair whose result is already there is read, not run again (so a long run can be
resumed, and an env added later). --engines vllm alone skips the comparison. Writes <out>/baseline.json and prints the
table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rl.scores import FINISHES  # noqa: E402

ENVS = ("babyai", "textcraft", "sciworld", "searchqa", "webarena")


def evaluate(model: str, env: str, engine: str, limit: int, out: Path, extra: list[str]) -> dict | None:
    """One eval.py run's results (read from <out>.json when it is already there); None, with a line, when it failed."""
    results = out.with_suffix(".json")
    if not results.is_file():
        command = [sys.executable, "eval.py", "--model", model, "--env", env, "--engine", engine, "--protocol", "agentgym",
                   "--temperature", "0", "--limit", str(limit), "--out", str(out), *extra]
        print(f"{env} on {engine}: {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not results.is_file():
            lines = (done.stderr or done.stdout).strip().splitlines()
            print(f"{env} on {engine}: eval.py failed ({lines[-1] if lines else f'exit {done.returncode}'})")
            return None
    return json.loads(results.read_text())


def episodes(out: Path) -> dict[tuple[str, int], list[str]]:
    """Each episode of an eval's .jsonl by (task, its k-th episode of the task): the actions it sent to the env, turn by
    turn."""
    played = {}
    for line in out.with_suffix(".jsonl").read_text().splitlines():
        record = json.loads(line)
        k = sum(task == record["item_id"] for task, _ in played)
        played[record["item_id"], k] = record["env_actions"]
    return played


def agreement(a: Path, b: Path, results_a: dict, results_b: dict) -> str:
    """How two engines' evals of the same tasks agree: episodes with the same actions, tasks with the same results."""
    played_a, played_b = episodes(a), episodes(b)
    same = sum(played_a[key] == played_b.get(key) for key in played_a)
    tasks = results_a["per_task"]
    equal = sum(tasks[task] == results_b["per_task"].get(task) for task in tasks)
    return f"{same}/{len(played_a)} episodes, {equal}/{len(tasks)} tasks"


def row(env: str, engine: str, results: dict) -> str:
    finish = ", ".join(f"{name} {results['finish'][name]:.0%}" for name in FINISHES.values() if results["finish"][name])
    return (f"| {env} | {engine} | {results['tasks']} | {results['avg@k']:.3f} | {results['turns']:.1f} | "
            f"{results['invalid_action_rate']:.0%} | {finish} | {results['seconds']:.0f} s |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=3, help="test tasks an env, spread over its split")
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=ENVS)
    parser.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    parser.add_argument("--out", default="runs/baseline")
    parser.add_argument("--eval-args", default="", help="more eval.py flags, e.g. --eval-args='--horizon 10'")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = ["| env | engine | tasks | Avg@1 (SciWorld: its 0-100 score) | turns | invalid actions | ended | eval time |",
             "|---|---|---:|---:|---:|---:|---|---:|"]
    summary = {}
    for env in args.envs:
        results = {engine: evaluate(args.model, env, engine, args.limit, out / f"{env}-{engine}", args.eval_args.split())
                   for engine in args.engines}
        for engine, result in results.items():
            if result is not None:
                table.append(row(env, engine, result))
        summary[env] = {engine: result for engine, result in results.items() if result is not None}
        if len(summary[env]) == 2:
            first, second = args.engines
            summary[env]["same"] = agreement(out / f"{env}-{first}", out / f"{env}-{second}", results[first],
                                             results[second])
    (out / "baseline.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(table))
    for env, engines in summary.items():
        if "same" in engines:
            print(f"{env}: {' and '.join(args.engines)} played the same actions in {engines['same']}")
    return summary


if __name__ == "__main__":
    main()
