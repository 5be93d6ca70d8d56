"""bench section bare: the floor of our update. A bare loop over the update section's own steps (its rollouts.jsonl):
the same trajectories in the same micro-batches (rl/batch.arrange with the run's --micro-batch-size,
--max-tokens-per-micro-batch and --pack), each one forward (the sampled tokens' log-probs, rl/logprobs) and one
backward of their mean, then an AdamW step per training step: no reference or old log-probs, no advantages, no
clipping. Our update tokens/s over the bare loop's (target >= 0.8).

    python scripts/bench.py --model smollm2-135m --sections update bare \
        --train-args="--tasks-per-step 2 --n 2 --horizon 2 --max-new-tokens 16"
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from bench.common import Args


def phase_bare(args: Args) -> dict:
    import torch

    from rl.batch import arrange, pack, padded
    from rl.logprobs import token_logprobs
    from rl.model import load_model, load_tokenizer
    from bench.update import step_batches

    config, records = step_batches(Path(args.run_dir))
    steps: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        steps[r["step"]].append(r)
    cuda = torch.cuda.is_available()
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32).to("cuda" if cuda else "cpu")
    model.train()
    pad_id = load_tokenizer(args.model).pad_token_id or 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    times, tokens = [], []
    for step in sorted(steps):
        sequences = []
        for r in steps[step]:
            mask = [0] * len(r["token_ids"])
            for start, end in r["action_spans"]:
                mask[start:end] = [1] * (end - start)
            sequences.append((list(r["token_ids"]), mask))
        layout = arrange([len(ids) for ids, _ in sequences], config["micro_batch_size"],
                         config["max_tokens_per_micro_batch"], config["pack"])
        start = time.perf_counter()
        for micro in layout:
            chosen = [sequences[i] for row in micro for i in row]
            if config["pack"]:
                inputs = pack(chosen, config["max_tokens_per_micro_batch"], pad_id)
                ids, attention, positions = inputs["input_ids"], None, inputs["position_ids"]
                loss_mask = inputs["loss_mask"]
            else:
                batch = padded(chosen, pad_id)
                ids, attention, positions, loss_mask = batch.input_ids, batch.attention_mask, None, batch.loss_mask
            device = model.device
            logprobs, _ = token_logprobs(model, ids.to(device), None if attention is None else attention.to(device),
                                         loss_mask.to(device), position_ids=None if positions is None else positions.to(device))
            mask = loss_mask.to(device).float()
            (-(logprobs * mask).sum() / mask.sum().clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(ids) for ids, _ in sequences))
    measured = list(range(1, len(times))) or [0]  # step 1 is warm-up, as in the update section
    return {"steps": len(times), "update_s": sum(times[s] for s in measured) / len(measured),
            "update_tokens_per_s": sum(tokens[s] / times[s] for s in measured) / len(measured)}


def bare_rows(bare: dict, update: dict) -> list[str]:
    """The bare section's rows: the bare loop's tokens/s, and ours over it."""
    if "update_tokens_per_s" not in bare:
        return []
    lines = [f"| bare | bare forward + backward + AdamW over the update's micro-batches: tokens/s | "
             f"{bare['update_tokens_per_s']:,.0f} | |"]
    if "update_tokens_per_s" in update:
        lines.append(f"| bare | ours / bare update tokens/s | "
                     f"{update['update_tokens_per_s'] / bare['update_tokens_per_s']:.2f}x | >= 0.8x |")
    return lines
