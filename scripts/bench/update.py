"""bench sections update and trl: our update, and the same GRPO update in TRL's GRPOTrainer on the same batches.

update: `python train.py` for --update-steps steps on --model, read off its metrics.jsonl: update tokens/s (the
reference log-probs, every forward/backward and optimizer step), the padding share of the update's micro-batches (target
<= 5%), the rollout's and the update's peak memory. Step 1 is warm-up; the figures are the mean of the later steps.

trl: the same GRPO update in TRL's GRPOTrainer, on the same model and the update section's own trajectories (its
rollouts.jsonl: the same tokens, observations masked as ours through TRL's env_mask, the same rewards and groups,
micro-batch size, learning rate, clip, KL and entropy coefficients, loss aggregation), each step's trajectories fed in
by TRL's rollout_func hook so that TRL generates nothing. Our update tokens/s / TRL's (target >= 1.5). TRL is installed
in a throwaway venv (--trl-venv, --system-site-packages, so on this project's torch and transformers), never into the
project's environment.

    python scripts/bench.py --sections update trl --train-args="--tasks-per-step 8 --n 4"
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import TRL_VERSION, Args, train_metrics


def section_update(args: Args, work: Path) -> dict:
    """Run train.py for --update-steps steps into `work` and read its update figures off metrics.jsonl."""
    run = work / "update"
    command = [sys.executable, "train.py", "--model", args.model, "--steps", str(args.update_steps),
               "--eval-every", "0", "--save-every", "0", "--out-dir", str(work), "--run-name", "update",
               *shlex.split(args.train_args)]
    rows = train_metrics("update", command, run)
    measured = [r for r in rows if r.get("charts/step", 0) > 1] or rows
    keys = ("perf/update_s", "perf/update_tokens_per_s", "perf/update_padding_share", "perf/rollout_peak_gib",
            "perf/update_peak_gib", "perf/rollout_s")
    result = {key.split("/", 1)[1]: sum(r[key] for r in measured) / len(measured)
              for key in keys if all(key in r for r in measured)}
    result["tokens"] = sum(r["perf/update_s"] * r["perf/update_tokens_per_s"] for r in measured) / len(measured)
    return {**result, "steps": [r["charts/step"] for r in measured], "run_dir": str(run)}


# ----------------------------------------------------------------------------------------------
# trl: the same update in TRL's GRPOTrainer


def trl_python(args: Args) -> str:
    """The throwaway venv's python, with TRL installed (made on first use)."""
    venv = Path(os.path.expanduser(args.trl_venv))
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import trl, sys; sys.exit(trl.__version__ != '{TRL_VERSION}')"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    print(f"trl: installing trl=={TRL_VERSION} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    # the project's torch, transformers and accelerate stay as they are: pip only adds what TRL lacks
    pins = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(line for line in pins.splitlines() if "==" in line) + "\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", "-c", str(constraints)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install trl=={TRL_VERSION} into {venv}: {done.stderr.strip()[-1500:]}")
    return str(python)



LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "dr_grpo",
              "seq-mean-token-sum-norm": "dr_grpo"}  # (TRL's dr_grpo divides by max_completion_length: the last)


def step_batches(run_dir: Path) -> tuple[dict, list[dict]]:
    """The run's config and its trajectories, in the order they were played."""
    config = json.loads((run_dir / "config.json").read_text())
    from rl.records import decode_array

    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    return config, [r | {"token_ids": decode_array(r["token_ids"])} for r in records
                    if "token_ids" in r and r.get("action_spans")]


def phase_trl(args: Args) -> dict:
    """GRPOTrainer replaying the update run's steps: rollout_func hands it each step's recorded trajectories."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl.memory import peak_gib, reset_peak
    from rl.model import load_model, load_tokenizer

    config, records = step_batches(Path(args.run_dir))
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_prompt[f"step {r['step']} group {r['group']}"].append(r)
    prompts = list(by_prompt)
    n, per_step = config["n"], config["tasks_per_step"]
    steps = len(prompts) // per_step
    if steps < 1 or any(len(v) != n for v in by_prompt.values()):
        raise RuntimeError(f"{args.run_dir}: expected groups of {n} trajectories in rollouts.jsonl")
    served: dict[str, int] = defaultdict(int)

    def rollout_func(batch_prompts, trainer) -> dict:
        out = defaultdict(list)
        for prompt in batch_prompts:
            r = by_prompt[prompt][served[prompt] % n]
            served[prompt] += 1
            ids, first = r["token_ids"], r["action_spans"][0][0]
            mask = [0] * len(ids)
            for start, end in r["action_spans"]:
                mask[start:end] = [1] * (end - start)
            out["prompt_ids"].append(ids[:first])
            out["completion_ids"].append(ids[first:])
            out["env_mask"].append(mask[first:])
            out["logprobs"].append([0.0] * (len(ids) - first))
            out["recorded_reward"].append(float(r["reward"]))
        return dict(out)

    def recorded_reward(completions, recorded_reward, **kwargs) -> list[float]:
        return recorded_reward

    cuda = torch.cuda.is_available()
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(args.model)
    positions = {"tokens": 0, "positions": 0}

    def count_padding(module, inputs, kwargs):
        if module.training and kwargs.get("attention_mask") is not None:
            positions["tokens"] += int(kwargs["attention_mask"].sum())
            positions["positions"] += kwargs["attention_mask"].numel()

    model.register_forward_pre_hook(count_padding, with_kwargs=True)
    micro = config["micro_batch_size"]
    grpo = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), report_to=[], save_strategy="no", logging_steps=1,
        max_steps=steps, per_device_train_batch_size=micro, gradient_accumulation_steps=n * per_step // micro,
        num_generations=n, shuffle_dataset=False, learning_rate=config["lr"], weight_decay=config["weight_decay"],
        max_grad_norm=config["grad_clip"], beta=config["kl_coef"], entropy_coef=config["entropy_coef"],
        epsilon=config["clip"], temperature=config["temperature"], loss_type=LOSS_TYPES[config["loss_agg"]],
        scale_rewards="group" if config["grpo_scale"] else "none", max_completion_length=config["max_tokens"],
        mask_truncated_completions=False, lr_scheduler_type="constant", use_cpu=not cuda, bf16=cuda, seed=config["seed"], disable_tqdm=True)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            reset_peak()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(model=model, reward_funcs=recorded_reward, args=grpo, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func,
                          callbacks=[StepTimer()])
    trainer.train()
    tokens = [sum(len(r["token_ids"]) for p in prompts[s * per_step:(s + 1) * per_step] for r in by_prompt[p])
              for s in range(steps)]
    measured = list(range(1, steps)) or [0]  # step 1 is warm-up, as in the update section
    update_s = sum(times[s] for s in measured) / len(measured)
    return {"trl": trl.__version__, "steps": steps, "update_s": update_s,
            "update_tokens_per_s": sum(tokens[s] / times[s] for s in measured) / len(measured),
            "update_padding_share": 1 - positions["tokens"] / max(positions["positions"], 1),
            "update_peak_gib": peak_gib()}


def update_rows(update: dict) -> list[str]:
    """The update section's rows: our update's tokens/s, padding share and peak memory."""
    if "update_tokens_per_s" not in update:
        return []

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    return [f"| update | ours: tokens/s ({update['tokens']:,.0f} tokens a step) | {update['update_tokens_per_s']:,.0f} | |",
            f"| update | ours: padding share | {update['update_padding_share']:.1%} | <= 5% |",
            f"| update | ours: peak memory, rollout / update (resident set with the vLLM engine; GPU: allocated) | {fmt(update.get('rollout_peak_gib'), '.2f')} / "
            f"{fmt(update.get('update_peak_gib'), '.2f')} GiB | |"]


def trl_rows(trl: dict, update: dict) -> list[str]:
    """The trl section's rows: TRL's tokens/s, padding share and peak memory, and ours against TRL's."""
    if "update_tokens_per_s" not in trl:
        return []
    lines = [f"| trl | TRL {trl['trl']} GRPOTrainer: tokens/s, same batches | {trl['update_tokens_per_s']:,.0f} | |",
             f"| trl | TRL: padding share / peak memory | {trl['update_padding_share']:.1%} / "
             f"{trl['update_peak_gib']:.2f} GiB | |"]
    if "update_tokens_per_s" in update:
        lines.append(f"| trl | ours / TRL update tokens/s | "
                     f"{update['update_tokens_per_s'] / trl['update_tokens_per_s']:.2f}x | >= 1.5x |")
    return lines
