"""The same rollout on the HF engine and on vLLM, side by side: tokens/s, rollout wall / generation wall,
the engine's idle share, weight-sync seconds and the engine-vs-trainer log-prob mismatch.

    python scripts/bench_rollout.py                       # the embedded model, BabyAI, a default step's rollout
    python scripts/bench_rollout.py --model Qwen/Qwen2.5-0.5B-Instruct --env textcraft --tasks 16 --n 8 --horizon 15
    python scripts/bench_rollout.py --env-delay 0.2       # envs that take 0.2 s a step: continuous batching vs rounds

Every engine plays the same tasks with the same limits (the samples differ: each engine draws its own).
"vllm (rounds)" is vLLM held to the HF engine's per-round barrier, to show what continuous batching buys.
Timing on a shared machine is noisy: compare the ratios within one run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl  # noqa: E402,F401 - first: sets OpenMP's wait policy before torch loads

import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import tyro  # noqa: E402

import envs  # noqa: E402
from rl.engines import HFEngine, VLLMEngine  # noqa: E402
from rl.logprobs import token_logprobs  # noqa: E402
from rl.model import EMBEDDED_ROLLOUT, load_model, load_tokenizer, resolve  # noqa: E402
from rollout import ChatFormat, rollout  # noqa: E402


@dataclass
class Args:
    model: str = "tiny-agent"
    """Hugging Face id or local directory"""
    env: str = EMBEDDED_ROLLOUT["env"]
    tasks: int = 8
    """tasks, each played n times"""
    n: int = 4
    horizon: int = EMBEDDED_ROLLOUT["horizon"]
    max_new_tokens: int = EMBEDDED_ROLLOUT["max_new_tokens"]
    max_tokens: int = EMBEDDED_ROLLOUT["max_tokens"]
    temperature: float = 1.0
    env_delay: float = 0.0
    """seconds added to every env step (a stand-in for slow simulators, browsers or search APIs)"""
    syncs: int = 5
    """weight syncs timed (each with its probe check)"""
    engines: tuple[str, ...] = ("hf", "vllm-rounds", "vllm")
    """which to run, in this order"""


class Delayed:
    """An env whose every step takes `delay` seconds longer."""

    def __init__(self, env, delay):
        self.env, self.delay = env, delay

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, text):
        time.sleep(self.delay)
        return self.env.step(text)


def mismatch(model, trajectories) -> tuple[float, float]:
    """Mean and max |engine log-prob - trainer log-prob| over every sampled token."""
    diffs = []
    for traj in trajectories:
        ids = torch.tensor([traj.token_ids], device=model.device)
        mask = torch.tensor([traj.loss_mask], device=model.device)
        with torch.no_grad():
            trainer, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, 1.0)
        sampled = torch.tensor(traj.logprobs)
        diffs.append((sampled - trainer[0].float().cpu()).abs()[mask[0].bool().cpu()])
    every = torch.cat(diffs) if diffs else torch.zeros(1)
    return float(every.mean()), float(every.max())


def main(args: Args) -> None:
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    task_ids = envs.splits(args.env)["train"][:args.tasks]
    rows = [t for t in task_ids for _ in range(args.n)]
    groups = [g for g in range(len(task_ids)) for _ in range(args.n)]
    environments = [Delayed(envs.make(args.env), args.env_delay) if args.env_delay else envs.make(args.env) for _ in rows]
    print(f"{args.model} on {args.env}: {len(task_ids)} tasks x {args.n}, {args.horizon} turns of <= "
          f"{args.max_new_tokens} tokens, env delay {args.env_delay}s, {torch.get_num_threads()} threads")

    vllm = None
    results = {}
    for name in args.engines:
        if name == "hf":
            engine = HFEngine(model, fmt, temperature=args.temperature, seed=0)
        else:
            if vllm is None:
                start = time.perf_counter()
                vllm = VLLMEngine(resolve(args.model), fmt, temperature=args.temperature, seed=0,
                                  max_model_len=args.max_tokens, gpu_memory_utilization=0.5)
                print(f"vLLM engine started in {time.perf_counter() - start:.1f}s")
            vllm.continuous = name == "vllm"
            engine = vllm
        stats: dict = {}
        trajectories = rollout(engine, fmt, environments, rows, groups, horizon=args.horizon,
                               max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens, stats=stats)
        mean_diff, max_diff = mismatch(model, trajectories)
        results[name] = {
            "tokens": stats["sampled_tokens"], "rollout_s": stats["rollout_s"], "generate_s": stats["generate_s"],
            "tokens/s": stats["sampled_tokens"] / stats["rollout_s"],
            "wall/gen": stats["rollout_s"] / max(stats["generate_s"], 1e-9),
            "idle": stats["idle_s"] / stats["rollout_s"], "prefix hits": engine.metrics().get("prefix_hit_rate"),
            "logp diff mean": mean_diff, "logp diff max": max_diff,
        }
    syncs = []
    if vllm is not None:
        for _ in range(args.syncs):
            syncs.append(vllm.load_weights(model))
        vllm.close()
    for env in environments:
        env.close()

    columns = ["tokens", "rollout_s", "generate_s", "tokens/s", "wall/gen", "idle", "prefix hits",
               "logp diff mean", "logp diff max"]
    print(f"\n{'engine':<14}" + "".join(f"{c:>15}" for c in columns))
    for name, row in results.items():
        cells = [("-" if row[c] is None else f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]))
                 for c in columns]
        print(f"{name:<14}" + "".join(f"{cell:>15}" for cell in cells))
    if "hf" in results and "vllm" in results:
        print(f"\nvLLM / HF rollout tokens/s: {results['vllm']['tokens/s'] / results['hf']['tokens/s']:.1f}x")
    if syncs:
        seconds = sorted(s["sync_s"] for s in syncs)
        print(f"weight sync: median {seconds[len(seconds) // 2]:.3f}s, max {seconds[-1]:.3f}s over {len(syncs)}; "
              f"probe |diff| mean {max(s['probe_diff'] for s in syncs):.2g}, max {max(s['probe_diff_max'] for s in syncs):.2g}")


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
