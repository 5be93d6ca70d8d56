"""Expert trajectories for SFT, in AgentGym's AgentTraj format: each env's scripted oracle, played
through the text interface with exactly the token layout of RL rollouts (rollout.py, ExpertEngine).

    python scripts/make_expert_data.py --env babyai --split train              # -> data/babyai_train_expert.jsonl
    python scripts/make_expert_data.py --env textcraft --split train --limit 100 --out tc.jsonl
    python scripts/make_expert_data.py --env babyai --agent tools   # each action as a native tool call (SFT for --agent tools)

One JSON line per episode the oracle solved (rl/data.py: item_id, conversations, reward); an episode
it could not solve (the oracle gave up, the env failed, or the horizon or token budget ran out first)
is skipped and counted. The file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from rl.checkpoint import write_atomic  # noqa: E402
from rl.data import to_record  # noqa: E402
from rl.model import load_tokenizer  # noqa: E402
from rl.agent import make_agent  # noqa: E402
from rl.agent import LayoutArgs, chat_format  # noqa: E402
from rl.progress import Progress, progress_bar  # noqa: E402
from rollout import ExpertEngine, play  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, help=f"one of {', '.join(envs.ENVS)}: an env with a scripted expert")
    parser.add_argument("--split", default="train", choices=("train", "test"), help="the env's shipped split")
    parser.add_argument("--tasks", help="a task id file (AgentGym-RL-Data-ID format) instead of the split")
    parser.add_argument("--limit", type=int, help="the first N tasks only")
    parser.add_argument("--horizon", type=int, default=30, help="turns an episode may take")
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens an episode may take")
    parser.add_argument("--model", default="tiny-agent", help="whose chat template lays out the tokens")
    parser.add_argument("--batch-size", type=int, default=32, help="episodes played at once")
    parser.add_argument("--agent", default="react", choices=("react", "tools"),
                        help="react: AgentGym's Thought/Action replies; tools: each action as the tool call that stands "
                             "for it, in the chat template's format, with the env's tools in the first prompt")
    parser.add_argument("--out", help="default: data/<env>_<split>_expert.jsonl, <split> the task file's name under "
                                      "--tasks (_expert_tools.jsonl with --agent tools)")
    return parser.parse_args(argv)


def why_unsolved(trajectory) -> str:
    if trajectory.error is not None:
        return "oracle gave up" if trajectory.error.startswith("expert failed") else "env failed"
    return {"horizon": "out of turns", "max_tokens": "out of tokens"}.get(trajectory.finish, "ended unsolved")


def main(argv=None) -> dict:
    args = parse_args(argv)
    envs.check_env(args.env)
    if not envs.has_oracle(args.env):
        raise SystemExit(f"--env {args.env} has no scripted expert (an env in a standard shape has none): its episodes "
                         "come from a model (train.py, eval.py), not from this script")
    task_ids = envs.load_task_ids(args.tasks, args.env) if args.tasks else envs.splits(args.env)[args.split]
    source = Path(args.tasks).stem if args.tasks else args.split  # (named in the default file and the summary line)
    task_ids = task_ids[:args.limit] if args.limit else task_ids
    fmt = chat_format(load_tokenizer(args.model), LayoutArgs(args.agent))
    environments = [envs.make(args.env) for _ in range(min(args.batch_size, len(task_ids)))]
    solved, skipped, tokens = [], collections.Counter(), 0
    progress = progress_bar(total=len(task_ids), desc=f"{args.env} experts", bar_format="{desc}{postfix} [{elapsed}]")
    try:
        played = play(ExpertEngine(fmt, environments), fmt, environments, task_ids, horizon=args.horizon,
                      max_new_tokens=4096, max_tokens=args.max_tokens, agent=make_agent(args.agent),
                      progress=Progress(progress, "", len(task_ids), args.horizon))
        for trajectory in played:
            if trajectory.error is None and trajectory.success:
                solved.append(to_record(trajectory))
                tokens += len(trajectory.token_ids)
            else:
                skipped[why_unsolved(trajectory)] += 1
    finally:
        progress.close()
        for env in environments:
            env.close()
    out = Path(args.out or f"data/{args.env}_{source}_expert{'_tools' if args.agent == 'tools' else ''}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(record) + "\n" for record in solved))
    summary = {"episodes": len(solved), "skipped": dict(skipped), "success_rate": len(solved) / max(len(task_ids), 1),
               "tokens": tokens, "out": str(out)}
    why = ", ".join(f"{n} {reason}" for reason, n in skipped.most_common())
    print(f"{args.env} {source}: wrote {len(solved)} expert episodes to {out} (success {summary['success_rate']:.1%}, "
          f"{tokens} tokens); skipped {sum(skipped.values())}" + (f": {why}" if why else ""))
    return summary


if __name__ == "__main__":
    main()
