"""Which tasks a model can reach: its expert episodes scored teacher-forced, before any RL run.

    python scripts/reach.py --model tiny-generalist --env textcraft --tasks train test envs/data/textcraft_rest.json
    python scripts/reach.py --model runs/<run>/checkpoints/step_16 --env babyai --tasks test --limit 64
    python scripts/reach.py --model tiny-generalist --env textcraft --tasks train --categories depth1 depth2 \\
        --band 0.02:0.8 --pick envs/data/textcraft_reach.json --pick-count 32 --seed 1   # RL's tasks in reach

Each env's scripted expert plays every task once (rollout.py's ExpertEngine: the token layout of RL rollouts, under
the model's chat template), and the model scores the expert's tokens without sampling: the mean loss per action token
(-log p of the expert's token) and each episode's probability, exp of the sum of its action tokens' log-probs at
temperature 1: the chance that the model, sampling, plays the expert's episode token for token.

What it tells before an RL run. Group-relative RL (GRPO, RLOO, GiGPO) learns from a task only when its n samples
differ in outcome. An episode probability near 1 means the task is solved already (nothing to learn); far below 1/n
(0.001 and less for groups of 8) means no sample is likely to succeed, so its groups are all failures (no signal,
whatever the temperature or --dynamic-sampling). The band in between (`--band`, 0.02 to 0.8 by default) is the
reach: tasks there give mixed groups. The expert's path is one of the successful ones, so an episode probability is
a lower bound of the chance of success; for envs whose tasks have one short solution (TextCraft, BabyAI's fixed-goal
levels) it is close. Per action token, a loss well above the train tasks' on held-out tasks says what the model
learned by heart (docs/environments.md, "The embedded generalist").

Tasks the expert does not solve (it gave up, the horizon or token budget ran out) are counted and not scored. The
per-episode figures go to `--out` (JSONL), the tasks within the band to `--pick` (AgentGym-RL-Data-ID format); both are
written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rl  # noqa: E402, F401 - before torch: the OpenMP wait policy (rl/__init__.py)
import torch  # noqa: E402

import envs  # noqa: E402
from rl.agent import LayoutArgs, chat_format, make_agent  # noqa: E402
from rl.checkpoint import write_atomic  # noqa: E402
from rl.logprobs import collate, token_logprobs  # noqa: E402
from rl.model import load_model, load_tokenizer  # noqa: E402
from rollout import ExpertEngine, play  # noqa: E402

UNREACHABLE = 1e-3  # an episode probability at or below this: no group of 8 samples is likely to hold a success


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-generalist", help="a hub id, a local or checkpoint directory, or an "
                                                                   "embedded model (tiny-agent, tiny-generalist)")
    parser.add_argument("--env", required=True, choices=envs.ENVS)
    parser.add_argument("--tasks", nargs="+", default=["train", "test"],
                        help="task sets, each `train`, `test` (the env's shipped split) or a task id file")
    parser.add_argument("--limit", type=int, help="the first N tasks of each set only")
    parser.add_argument("--categories", nargs="+", help="only the tasks of these eval categories (e.g. depth1)")
    parser.add_argument("--horizon", type=int, default=30, help="turns an expert episode may take")
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens an expert episode may take")
    parser.add_argument("--agent", default="react", choices=("react", "tools"), help="the episodes' layout")
    parser.add_argument("--band", default="0.02:0.8", help="LO:HI, the episode probabilities counted as in reach")
    parser.add_argument("--batch-size", type=int, default=8, help="episodes played, and scored, at once")
    parser.add_argument("--out", help="a JSONL file of every scored episode: set, task id, probability, loss, tokens")
    parser.add_argument("--pick", help="write the tasks of all sets whose probability is within --band to this task "
                                       "file (AgentGym-RL-Data-ID format, `<env>_<id>` items)")
    parser.add_argument("--pick-count", type=int, help="--pick at most this many, drawn at random (--seed)")
    parser.add_argument("--seed", type=int, default=1, help="the draw of --pick-count")
    args = parser.parse_args(argv)
    try:
        low, high = (float(x) for x in args.band.split(":"))
    except ValueError:
        parser.error(f"--band takes LO:HI, two probabilities, not {args.band!r}")
    if not 0 <= low < high <= 1:
        parser.error(f"--band {args.band}: give 0 <= LO < HI <= 1")
    args.band = (low, high)
    return args


def task_set(name: str, env: str, limit: int | None, categories: list[str] | None = None) -> list[int]:
    """A set's task ids: the env's shipped split by name, else a task id file's; those of `categories` only."""
    if name in ("train", "test"):
        ids = envs.splits(env)[name]
    else:
        try:
            ids = envs.load_task_ids(name, env)
        except envs.TaskFileError as error:
            raise SystemExit(f"reach: {error}")
    ids = [i for i in ids if envs.category(env, i) in categories] if categories else ids
    return ids[:limit] if limit else ids


@torch.no_grad()
def scores(model, trajectories: list, pad_id: int, batch_size: int) -> list[tuple[float, int]]:
    """Each trajectory's (sum of its action tokens' log-probs under `model`, its action tokens)."""
    out = []
    for start in range(0, len(trajectories), batch_size):
        batch = collate(trajectories[start:start + batch_size], pad_id)
        logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        sums = (logprobs * batch["loss_mask"]).sum(1)
        out += [(float(s), int(n)) for s, n in zip(sums, batch["loss_mask"].sum(1))]
    return out


def summary(rows: list[dict], tasks: int, band: tuple[float, float]) -> dict:
    """A set's figures from its scored episodes (`rows`) out of `tasks` played."""
    tokens = sum(r["tokens"] for r in rows)
    probabilities = [r["probability"] for r in rows]
    return {"tasks": tasks, "scored": len(rows),
            "loss_per_token": -sum(r["logprob"] for r in rows) / tokens if tokens else math.nan,
            "median_probability": statistics.median(probabilities) if rows else math.nan,
            "in_reach": sum(band[0] <= p <= band[1] for p in probabilities) / len(rows) if rows else math.nan,
            "above": sum(p > band[1] for p in probabilities) / len(rows) if rows else math.nan,
            "unreachable": sum(p <= UNREACHABLE for p in probabilities) / len(rows) if rows else math.nan}


def table(sets: dict[str, dict], band: tuple[float, float]) -> str:
    lines = [f"| task set | tasks | expert solved, scored | loss / action token | median episode probability | "
             f"in reach ({band[0]:g}-{band[1]:g}) | above {band[1]:g} | at most {UNREACHABLE:g} |", "|---" * 8 + "|"]
    for name, s in sets.items():
        lines.append(f"| {name} | {s['tasks']} | {s['scored']} | {s['loss_per_token']:.3f} | "
                     f"{s['median_probability']:.3g} | {s['in_reach']:.0%} | {s['above']:.0%} | "
                     f"{s['unreachable']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sets = {name: task_set(name, args.env, args.limit, args.categories) for name in args.tasks}
    tokenizer = load_tokenizer(args.model)
    fmt = chat_format(tokenizer, LayoutArgs(args.agent))
    model = load_model(args.model).eval()
    environments = [envs.make(args.env) for _ in range(args.batch_size)]
    rows, figures = [], {}
    try:
        for name, ids in sets.items():
            played = play(ExpertEngine(fmt, environments), fmt, environments, ids, horizon=args.horizon,
                          max_new_tokens=4096, max_tokens=args.max_tokens, agent=make_agent(args.agent))
            solved = [t for t in played if t.error is None and t.success]
            mine = [{"set": name, "task_id": t.task_id, "logprob": s, "tokens": n, "probability": math.exp(s),
                     "loss_per_token": -s / max(n, 1)}
                    for t, (s, n) in zip(solved, scores(model, solved, fmt.pad_id, args.batch_size))]
            rows += mine
            figures[name] = summary(mine, len(ids), args.band)
            print(f"reach {args.env} {name}: {len(mine)} of {len(ids)} tasks scored", file=sys.stderr)
    finally:
        for env in environments:
            env.close()
    print(f"{args.env}, {args.model}, expert episodes teacher-forced (temperature 1):")
    print(table(figures, args.band))
    if args.out:
        write_atomic(Path(args.out), "".join(json.dumps(r) + "\n" for r in rows))
    if args.pick:
        picked = sorted({r["task_id"] for r in rows if args.band[0] <= r["probability"] <= args.band[1]})
        if args.pick_count is not None and len(picked) > args.pick_count:
            picked = sorted(random.Random(args.seed).sample(picked, args.pick_count))
        items = ",\n".join(json.dumps({"item_id": f"{args.env}_{i}"}) for i in picked)  # (one a line, as envs/data's)
        write_atomic(Path(args.pick), f"[\n{items}\n]\n")
        print(f"picked {len(picked)} tasks within {args.band[0]:g}-{args.band[1]:g} -> {args.pick}")
    return figures


if __name__ == "__main__":
    main()
