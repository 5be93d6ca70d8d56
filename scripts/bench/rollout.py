"""bench section rollout: a training step's rollout (--tasks x --n episodes of --env) on the HF engine and on vLLM (and
vLLM held to the HF engine's per-turn rounds, to show what continuous batching buys): rollout wall time / the time
spent generating the same tokens (target <= 1.15), tokens/s, the engine's idle share, the engine-vs-trainer log-prob
mismatch and the weight-sync time. Its step (`step_inputs`) is the server section's too.

    python scripts/bench.py --sections rollout --engines hf vllm --env-delay webarena
"""

from __future__ import annotations

from bench.common import Args


def mismatch(model, trajectories) -> tuple[float, float]:
    """Mean and max |engine log-prob - trainer log-prob| over every sampled token."""
    import torch

    from rl.logprobs import token_logprobs

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


def step_inputs(args: Args, section: str) -> tuple[list[int], list[int], list]:
    """A training step's tasks (--tasks train tasks of --env, each --n times), their groups, and an env for each."""
    import torch

    import envs
    from envs.latency import Delayed, Draws, parse

    task_ids = envs.splits(args.env)["train"][:args.tasks]
    rows = [t for t in task_ids for _ in range(args.n)]
    groups = [g for g in range(len(task_ids)) for _ in range(args.n)]
    latency = parse(args.env_delay)
    environments = [Delayed(envs.make(args.env), Draws(latency, 0, i)) if latency else envs.make(args.env)
                    for i in range(len(rows))]
    print(f"{section}: {args.model} on {args.env}, {len(task_ids)} tasks x {args.n}, {args.horizon} turns of <= "
          f"{args.max_new_tokens} tokens, env delay {args.env_delay}, {torch.get_num_threads()} threads", flush=True)
    return rows, groups, environments


def phase_rollout(args: Args) -> dict:
    import torch

    from rl.engines.hf import HFEngine
    from rl.engines.vllm import VLLMEngine
    from rl.memory import peak_gib, reset_peak
    from rl.model import load_model, load_tokenizer, resolve
    from rollout import ChatFormat, RolloutStats, rollout

    device = "cuda" if torch.cuda.is_available() else "cpu"

    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    model = load_model(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    rows, groups, environments = step_inputs(args, "rollout")
    vllm, results, syncs = None, {}, []
    for name in args.engines:
        reset_peak()
        if name == "hf":
            engine = HFEngine(model, fmt, temperature=args.temperature, seed=0)
        else:
            if vllm is None:
                vllm = VLLMEngine(resolve(args.model), fmt, temperature=args.temperature, seed=0,
                                  max_model_len=args.max_tokens, gpu_memory_utilization=0.5)
            vllm.continuous = name == "vllm"
            engine = vllm
        stats = RolloutStats()
        trajectories = rollout(engine, fmt, environments, rows, groups, horizon=args.horizon,
                               max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens, stats=stats)
        mean_diff, max_diff = mismatch(model, trajectories)
        results[name] = {
            "tokens": stats.sampled_tokens, "rollout_s": stats.rollout_s, "generate_s": stats.generate_s,
            "env_s": stats.env_s, "tokens_per_s": stats.sampled_tokens / stats.rollout_s,
            "wall_over_generation": stats.rollout_s / max(stats.generate_s, 1e-9),
            "idle_share": stats.idle_s / stats.rollout_s, "prefix_hit_rate": engine.metrics().get("prefix_hit_rate"),
            "logprob_diff_mean": mean_diff, "logprob_diff_max": max_diff, "peak_gib": peak_gib(),
        }
        print(f"rollout {name}: {results[name]}", flush=True)
    if vllm is not None:
        syncs = [vllm.load_weights(model) for _ in range(args.syncs)]
        vllm.close()
    for env in environments:
        env.close()
    return {"engines": results, "syncs": syncs, "peak_gib": peak_gib()}


def rollout_rows(rollout: dict) -> list[str]:
    """The rollout section's rows: an engine each, vLLM's speed against HF's, the weight sync."""
    engines = rollout.get("engines") or {}
    lines = []
    for name, r in engines.items():
        lines.append(f"| rollout | {name}: rollout wall / generation time ({r['tokens']} tokens, "
                     f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_gib']:.2f} GiB) "
                     f"| {r['wall_over_generation']:.2f}x | <= 1.15x |")
    if "hf" in engines and "vllm" in engines:
        lines.append(f"| rollout | vLLM / HF rollout tokens/s | {engines['vllm']['tokens_per_s'] / engines['hf']['tokens_per_s']:.1f}x | |")
    if rollout.get("syncs"):
        seconds = sorted(s["sync_s"] for s in rollout["syncs"])
        lines.append(f"| rollout | vLLM weight sync, median of {len(seconds)} (probe log-prob diff, max) | "
                     f"{seconds[len(seconds) // 2]:.3f} s ({max(s['probe_diff_max'] for s in rollout['syncs']):.1g}) | |")
    return lines
