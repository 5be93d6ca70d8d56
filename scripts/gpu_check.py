"""One command for a lent GPU: the trainer at Qwen2.5-1.5B and -3B sizes, random weights and the real Qwen tokenizer,
bf16 and gradient checkpointing, in one run sized for a 15-minute lease; each section's figures as it ends, then a
table.

    bash scripts/gpu_check.sh --prepare   # here, once, with the network: .gpu/ gets what the GPU machine lacks
    bash scripts/gpu_check.sh             # on the GPU machine: 3.5 minutes on an H200 (docs/engines.md: its figures)
    bash scripts/gpu_check.sh --smoke     # on a CPU: tiny sizes, the same code (tests/test_gpu_check.py, ~1 minute)

On this workplace's lent machine (the tool `run`: torch, transformers, accelerate and peft are there; no vLLM, no
network, no project package beyond those; only the working tree travels, and .gpu/ when carried):

    run(command="set -o pipefail; bash scripts/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log", carry=[".gpu"], timeout_s=600)

.gpu/ (in .gitignore, ~25 MB): the Qwen tokenizer and the Qwen2.5 chat template from set-up's checked artifacts
(rl/artifacts.py), and the wheels of the pure-Python packages train.py and BabyAI import that the machine lacks (tyro
and its dependencies, minigrid, gymnasium; pygame-ce, which minigrid imports, is a binary wheel for Python 3.12 x86-64),
at the versions installed here; gpu_check.sh installs them into the work folder when they are missing.

Sections, per size (random weights: the figures are about speed, memory and exactness, not about what a model learnt):
- rollout: BabyAI episodes on train.py's HF engine (sampling with the policy's own weights under bf16 autocast), checked
  token-exact by tests/test_token_exactness.py's own check (imported: each turn's prompt extends the last by the sampled
  tokens and the observation, the loss mask is exactly the sampled tokens, the model's text is never tokenized again,
  whole sequences render as the chat template does), and the trainer's log-probs of the sampled tokens against the
  engine's, within bf16's tolerance (TOLERANCE).
- update full / update lora (rank 16, all linear layers): train.py's update phase (batch_of, old_logprobs,
  advantages_for, update: GRPO, one optimizer step a step, no reference model) on synthetic trajectories that each fill
  --max-tokens (the memory plan's worst case, so plan and run hold the same tokens), the first step a warm-up. Tokens/s
  and MFU: model FLOPs over the card's bf16 dense peak (PEAKS), 6 per parameter and token (4 under LoRA: no gradients
  of the frozen weights), the LM head counted on the action tokens only, the ones it scores (rl/logprobs.py),
  attention's own FLOPs not counted; the peak of torch.cuda.max_memory_allocated over the measured steps against
  `train.py --dry-run`'s update phase for the same flags (rl/memory.plan; aim: within 15%); that the log-probs leave
  the model in fp32; and ours over a bare forward + backward + AdamW loop on the same micro-batches (bare_rate; aim:
  0.8 or more).
- fsdp2: the full update again under Accelerate's FSDP2 (configs/fsdp2.yaml) in one process, launched apart
  (`accelerate launch --num_processes 1`; on a CPU through tests/cpu_fsdp.py), planned as sharded over one process.
A section that fails says so in one line and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # (the project's modules, and the token-exactness check's)

# Qwen2.5's configs, and a size small enough for a CPU (the same vocabulary: the real tokenizer's)
SIZES = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128),
}
QWEN = dict(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
            rms_norm_eps=1e-6)
# bf16 dense tensor-core peaks (TFLOP/s, without sparsity) by the name torch.cuda.get_device_name gives, first match
PEAKS = (("H100 PCIe", 756.0, "H100 PCIe"), ("H100 NVL", 835.0, "H100 NVL"), ("H100", 989.0, "H100 SXM"),
         ("H200", 989.0, "H200 SXM"), ("A100", 312.0, "A100"))
# trainer's vs engine's log-probs of the sampled tokens (mean, max of |difference|): the same weights, with bf16's
# rounding in different matrix shapes (a left-padded KV-cache decode against one right-padded forward); fp32 on a CPU
TOLERANCE = {"bf16": (0.05, 1.0), "no": (1e-4, 1e-3)}
LORA_RANK = 16
TURNS = 6  # of a synthetic trajectory
TOKENIZER, TEMPLATE = "tokenizers/qwen3", "templates/qwen2_5.jinja"  # (rl/artifacts.py's names)
WHEELS = ("tyro", "docstring-parser", "typeguard", "typing-extensions", "minigrid", "gymnasium", "farama-notifications",
          "pygame-ce")


@dataclass(frozen=True)
class Workload:
    trajectories: int = 8  # an update step's
    max_tokens: int = 4096  # each synthetic trajectory's length, and --max-tokens
    micro_batch_size: int = 4
    steps: int = 4  # update steps, the first a warm-up
    episodes: int = 8  # rollout: two of each task
    horizon: int = 3
    max_new_tokens: int = 32
    context: int = 4096  # the rollout's --max-tokens (BabyAI's first prompt is 370-640 tokens of Qwen's)
    precision: str = "auto"  # --mixed-precision (auto: bf16 on a GPU)


GPU = Workload()
# (the logits of 150k-token vocabulary dominate a tiny model's update: few tokens, to stay within a minute on a CPU)
# (bf16 as on a GPU: this CPU has bf16 instructions, and the FSDP2 section then runs under the GPU's precision policy)
SMOKE = Workload(trajectories=2, max_tokens=128, micro_batch_size=1, steps=2, episodes=4, horizon=2, max_new_tokens=8,
                 context=2048, precision="bf16")


# ----------------------------------------------------------------------------------------------
# What the GPU machine needs from here: .gpu/


def prepare(folder: Path) -> None:
    """Copy the checked tokenizer and template into `folder` (which .gitignore names), and download the wheels."""
    from rl import artifacts

    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(artifacts.path(f"{TOKENIZER}/{name}"), folder / "tokenizer" / name)
    shutil.copy(artifacts.path(TEMPLATE), folder / Path(TEMPLATE).name)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    shutil.rmtree(folder / "whl", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.12", "--implementation=cp", *platforms, "-d", str(folder / "whl"), *pins],
                   check=True)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{folder}: {size / 2**20:.0f} MiB ({', '.join(pins)}); carry it: carry=[\"{folder.relative_to(ROOT)}\"]")


def tokenizer_source(folder: Path) -> tuple[Path, str]:
    """The tokenizer's folder and the template's text: from .gpu/ when prepared, else set-up's checked artifacts."""
    if (folder / "tokenizer" / "tokenizer.json").is_file():
        return folder / "tokenizer", (folder / Path(TEMPLATE).name).read_text()
    from rl import artifacts

    return artifacts.path(f"{TOKENIZER}/tokenizer.json").parent, artifacts.path(TEMPLATE).read_text()


def random_model(size: str, work: Path, tokenizer_folder: Path, template: str) -> Path:
    """A Qwen2.5-shaped model of `size`, random weights (bf16 on disk) and the real tokenizer, made once in `work`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    from transformers.utils import logging

    logging.disable_progress_bar()  # (its "Writing model shards" bar)
    folder = work / f"qwen2.5-{size}-random"
    if (folder / "done").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], **QWEN)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (initialised where it is fast)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    (folder / "done").touch()
    return folder


# ----------------------------------------------------------------------------------------------
# The sections


def train_args(model: Path, work: Workload, lora: bool):
    """train.py's Args for these flags, parsed as train.py parses them (the paper preset: a real model)."""
    import train

    flags = ["--model", str(model), "--env", "babyai", "--engine", "hf", "--algo", "grpo", "--kl-coef", "0",
             "--max-tokens", str(work.max_tokens), "--micro-batch-size", str(work.micro_batch_size), "--minibatches",
             "1", "--horizon", str(work.horizon), "--max-new-tokens", str(work.max_new_tokens), "--gen-batch-size",
             str(work.episodes), "--save-every", "0", "--mixed-precision", work.precision,
             *(["--lora-rank", str(LORA_RANK)] if lora else [])]
    return train.parse_args(flags), flags


def synthetic(count: int, length: int, vocab: int, seed: int) -> list:
    """`count` trajectories of `length` random tokens laid out as an agent's: a prompt (a quarter), then TURNS turns of
    a reply (trained) and an observation of the same length; rewards 0 and 1 in each group of two (GRPO's advantages
    are then not 0)."""
    import torch

    from rollout import Trajectory

    prompt = length // 4
    turn = (length - prompt) // TURNS
    mask = ([0] * prompt + ([1] * (turn // 2) + [0] * (turn - turn // 2)) * TURNS + [0] * length)[:length]
    generator = torch.Generator().manual_seed(seed)
    return [Trajectory(env="synthetic", task_id=i, group=i // 2, row=i, messages=[],
                       token_ids=torch.randint(0, vocab, (length,), generator=generator).tolist(), loss_mask=mask,
                       logprobs=[0.0] * length, turns=TURNS, reward=float(i % 2), finish="done", states=[None] * TURNS)
            for i in range(count)]


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_flops(override: float) -> tuple[float | None, str]:
    """The card's bf16 dense peak (FLOP/s) and its name, or None where none is known (a CPU, an unlisted GPU)."""
    import torch

    if override:
        return override * 1e12, f"of {override:g} TFLOP/s (--peak-tflops)"
    if not torch.cuda.is_available():
        return None, "no GPU"
    name = torch.cuda.get_device_name()
    for key, tflops, card in PEAKS:
        if key in name:
            return tflops * 1e12, f"of {tflops:g} TFLOP/s, the {card}'s bf16 dense peak ({name})"
    return None, f"no bf16 peak listed for the {name}: give --peak-tflops"


def matmul_tflops() -> float | None:
    """The card's bf16 matrix-product TFLOP/s, measured (8192^3, median of 10 after 3 warm-ups): MFU's real ceiling."""
    import torch

    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for k in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if k >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return 2 * 8192**3 / sorted(times)[len(times) // 2] / 1e12


def planned_update(args, accelerator) -> float:
    """`train.py --dry-run`'s update phase for these flags (rl/memory.plan, as print_plan calls it), GiB: the trainer's
    bytes alone. The HF engine's KV cache, which the plan also counts in that phase, lives only while it generates."""
    import torch

    from rl.logprobs import CHUNK_ELEMENTS
    from rl.memory import GiB, plan
    from rl.model import load_config, sharded

    config = load_config(args.model)
    micro_tokens = args.max_tokens_per_micro_batch or args.micro_batch_size * args.max_tokens
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB if torch.cuda.is_available() else 80.0
    estimate = plan(config, algo=args.algo, lora_rank=args.model_args.lora_rank,
                    lora_targets=args.model_args.lora_target_modules,
                    processes=accelerator.num_processes, sharded=sharded(accelerator),
                    reference=args.algo == "dpo" or args.objective.kl_coef > 0, offload_reference=args.model_args.offload_reference,
                    micro_tokens=micro_tokens, checkpointing=args.model_args.gradient_checkpointing, engine="server",
                    engine_share=0.0, engine_sleeps=True, gpu_gib=gpu_gib, batch=args.gen_batch_size,
                    context=args.max_tokens, logits_elements=min(CHUNK_ELEMENTS, micro_tokens * config.vocab_size),
                    mixed=accelerator.mixed_precision)
    return sum(estimate["phases"]["update"].values()) / GiB


def model_flops(config, tokens: float, action_tokens: float, lora: bool) -> float:
    """An update's model FLOPs: 6 per parameter and token (forward 2, backward 4), 4 under LoRA (no gradients of the
    frozen weights); the LM head (tied: the embedding) only on the action tokens, the positions it scores."""
    from rl.memory import parameters

    head = config.vocab_size * config.hidden_size
    body = parameters(config)[0] - head * (1 if config.tie_word_embeddings else 2)
    return (4 if lora else 6) * (body * tokens + head * action_tokens)


def check_update(label: str, args, accelerator, models, work: Workload, vocab: int, pad_id: int, peak) -> dict:
    """train.py's update phase, `work.steps` times on the same synthetic trajectories: tokens/s and MFU over the steps
    after the first, their peak memory against the plan's."""
    import torch

    import train
    from rl.batch import attach
    from rl.logprobs import token_logprobs
    from rl.memory import peak_gib, reset_peak
    from rl.optimizer import reducer

    trajectories = synthetic(work.trajectories, work.max_tokens, vocab, args.seed)
    seconds, tokens, action_tokens, finite = 0.0, 0, 0.0, True
    for step in range(1, work.steps + 1):
        synchronize()
        if step == 2:  # (after the warm-up, which also made AdamW's moments)
            reset_peak()
        start = time.perf_counter()
        batch = train.batch_of(trajectories, args, accelerator, pad_id, step)
        train.old_logprobs(models, batch, args, accelerator)
        advantages, returns = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok,
                                                   reducer(accelerator), batch.episodes, batch.anchors)
        attach(batch, advantages, returns)
        if step == 1:  # (the scores leave the model as rl/logprobs makes them, in fp32, under any precision policy)
            micro = batch.micro[0]
            with torch.no_grad(), accelerator.autocast():
                scored, _ = token_logprobs(models.policy, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                           position_ids=micro.position_ids)
            fp32 = scored.dtype == torch.float32
        sums, norms = train.update(models, batch, args, accelerator, step)
        synchronize()
        finite &= sums.nonfinite_updates == 0 and all(math.isfinite(n) for n in norms.get("policy", [math.nan]))
        if step > 1:
            seconds += time.perf_counter() - start
            tokens += batch.tokens
            action_tokens += float(batch.full.loss_mask.sum())
    measured, planned = peak_gib(), planned_update(args, accelerator)
    config = accelerator.unwrap_model(models.policy).config
    rate = tokens / seconds
    bare = bare_rate(models, batch, accelerator, work.steps)
    flops = model_flops(config, tokens, action_tokens, bool(args.model_args.lora_rank)) / seconds
    mfu = flops / peak[0] if peak[0] else None
    gpu = torch.cuda.is_available()
    memory = (f"peak {measured:.2f} GiB measured (torch.cuda.max_memory_allocated), {planned:.2f} GiB planned "
              f"(--dry-run's update phase): plan/measured {planned / measured:.2f}, "
              + ("within" if abs(planned / measured - 1) <= 0.15 else "outside") + " the 15% aim" if gpu else
              f"peak {measured:.2f} GiB resident set (a CPU: not comparable with the plan's {planned:.2f} GiB)")
    print(f"[{label}] {work.steps - 1} steps of {work.trajectories} x {work.max_tokens:,} tokens "
          f"({action_tokens / (work.steps - 1):,.0f} trained a step), {args.micro_batch_size} a micro-batch: "
          f"{rate:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s model FLOPs, MFU "
          + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a") + f" ({peak[1]}); {memory}; "
          f"losses and gradients finite: {'yes' if finite else 'NO'}; log-probs in fp32: {'yes' if fp32 else 'NO'}; "
          f"a bare forward + backward + AdamW loop over the same micro-batches: {bare:,.0f} tokens/s, ours / bare "
          f"{rate / bare:.2f}")
    return {"tokens_s": rate, "tflops": flops / 1e12, "mfu": mfu, "peak_gib": measured, "plan_gib": planned,
            "ratio": planned / measured if gpu else None, "bare": rate / bare, "ok": finite and fp32}


def bare_rate(models, batch, accelerator, steps: int) -> float:
    """The floor of the update (scripts/bench/bare.py's loop): `batch`'s micro-batches each through one forward (the
    sampled tokens' log-probs) and one backward of their mean, then an AdamW step; no old log-probs, advantages or
    clipping, the same model, precision and checkpointing. Tokens/s over `steps` steps after a warm-up."""
    import torch

    from rl.logprobs import token_logprobs

    models.policy.train()
    seconds, tokens = 0.0, 0
    for step in range(steps):
        synchronize()
        start = time.perf_counter()
        for micro in batch.micro:
            with accelerator.autocast():
                logprobs, _ = token_logprobs(models.policy, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                             position_ids=micro.position_ids)
            mask = micro.loss_mask.to(torch.float32)
            accelerator.backward(-(logprobs * mask).sum() / mask.sum().clamp(min=1))
        models.optimizer.step()
        models.optimizer.zero_grad(set_to_none=True)
        synchronize()
        if step:
            seconds, tokens = seconds + time.perf_counter() - start, tokens + batch.tokens
    return tokens / seconds


def check_rollout(label: str, args, accelerator, models, tokenizer, work: Workload, precision: str) -> dict:
    """BabyAI on train.py's HF engine: token-exact (tests/test_token_exactness.check_exact), and the trainer's
    log-probs of the sampled tokens against the engine's."""
    import torch

    import envs
    import train
    from rl.agent import chat_format
    from rl.engines.setup import build_engine
    from rl.logprobs import token_logprobs
    from rollout import rollout
    from test_token_exactness import Spy, check_exact

    args = replace(args, max_tokens=work.context)
    fmt = chat_format(tokenizer, args.layout_args)
    spy = Spy(build_engine(args.engine_args, fmt, args.model, args.max_tokens, args.seed + accelerator.process_index,
                           args.gen_batch_size, accelerator=accelerator, policy=models.policy), fmt)
    tasks = envs.splits("babyai")["test"][:work.episodes // 2]
    environments = [envs.make("babyai") for _ in range(2 * len(tasks))]
    start = time.perf_counter()
    try:
        trajectories = rollout(spy, fmt, environments, [t for t in tasks for _ in (0, 1)],
                               [g for g in range(len(tasks)) for _ in (0, 1)], horizon=work.horizon,
                               max_new_tokens=work.max_new_tokens, max_tokens=args.max_tokens,
                               agent=args.layout_args.make_agent())
    finally:
        for env in environments:
            env.close()
    seconds = time.perf_counter() - start
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    if not sampled:
        raise RuntimeError(f"no turn was played: {[t.error or t.finish for t in trajectories]}")
    try:
        rendered = check_exact(fmt, spy, trajectories)
        exact = "yes"
    except AssertionError as error:
        rendered, exact = 0, f"NO ({str(error).splitlines()[0][:200] if str(error) else 'an assertion of check_exact'})"
    batch = train.batch_of(trajectories, args, accelerator, fmt.pad_id)
    models.policy.eval()
    gaps = []
    with torch.no_grad():
        for micro in batch.micro:
            with accelerator.autocast():
                logprobs, _ = token_logprobs(models.policy, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                             args.engine_args.temperature, position_ids=micro.position_ids)
            gaps.append((logprobs.float() - micro.sampler_logprobs)[micro.loss_mask > 0].abs().cpu())
    gap = torch.cat(gaps)
    mean, worst = float(gap.mean()), float(gap.max())
    bound = TOLERANCE[precision]
    close = mean < bound[0] and worst < bound[1]
    print(f"[{label}] {len(trajectories)} episodes, {sum(t.turns for t in trajectories)} turns, {sampled:,} sampled "
          f"tokens in {seconds:.1f} s ({sampled / seconds:,.0f} tokens/s); token-exact: {exact} ({rendered} whole "
          f"sequences also render as the template does); trainer vs engine log-probs of the sampled tokens: mean "
          f"{mean:.2g}, max {worst:.2g} ({precision.replace('no', 'fp32')} tolerance: mean < {bound[0]:g}, "
          f"max < {bound[1]:g}): "
          + ("within" if close else "OUTSIDE"))
    return {"tokens_s": sampled / seconds, "logprob_diff": mean, "logprob_diff_max": worst,
            "ok": exact == "yes" and close}


def run_size(size: str, model: Path, accelerator, precision: str, work: Workload, sections: list[str], peak,
             record) -> None:
    """The sections of one size, each on models built afresh by rl/model.build_models (as train.py builds them)."""
    import torch
    from accelerate.utils import set_seed

    import train
    from rl.model import build_models, load_tokenizer

    prefix = "fsdp2 " if accelerator.distributed_type.value == "FSDP" else ""
    tokenizer = load_tokenizer(str(model))
    for mode in ("full", "lora"):
        wanted = [s for s in sections if s in (("rollout", "update") if mode == "full" else ("lora",))]
        if not wanted:
            continue
        args, flags = train_args(model, work, lora=mode == "lora")
        train.check(args, accelerator.num_processes, accelerator.distributed_type.value)
        set_seed(args.seed)
        start = time.perf_counter()
        models = None
        try:
            models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
            print(f"[{prefix}{mode} {size}] models built in {time.perf_counter() - start:.1f} s "
                  f"(train.py {' '.join(flags[2:])})")
            for section in wanted:
                label = f"{prefix}{'update ' + mode if section != 'rollout' else 'rollout'} {size}"
                start = time.perf_counter()
                try:
                    if section == "rollout":
                        row = check_rollout(label, args, accelerator, models, tokenizer, work, precision)
                    else:
                        row = check_update(label, args, accelerator, models, work, tokenizer.vocab_size,
                                           tokenizer.pad_token_id, peak)
                except Exception as error:  # (a section that fails says so, and the others still run)
                    row = failed(label, error)
                record(label, row | {"seconds": time.perf_counter() - start})
        except Exception as error:
            record(f"{prefix}{mode} {size}", failed(f"{prefix}{mode} {size}", error) | {"seconds": 0.0})
        finally:
            del models
            accelerator.free_memory()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def failed(label: str, error: Exception) -> dict:
    import traceback

    where = traceback.extract_tb(error.__traceback__)[-1]
    print(f"[{label}] FAILED: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
          f"({Path(where.filename).name}:{where.lineno})")
    return {"ok": False, "error": f"{type(error).__name__}: {error}"[:300]}


# ----------------------------------------------------------------------------------------------
# The run, and the table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="fill .gpu/ here (network) and exit")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on a CPU: the same code, in about a minute")
    parser.add_argument("--fsdp2", action="store_true", help="the FSDP2 section (accelerate launch: gpu_check.sh)")
    parser.add_argument("--summary", action="store_true", help="print the table of --work's results and exit")
    parser.add_argument("--sizes", nargs="+", choices=SIZES, help="default: 1.5b 3b (--smoke: smoke); fsdp2: the first")
    parser.add_argument("--sections", nargs="+", default=["rollout", "update", "lora"],
                        choices=["rollout", "update", "lora"])
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("GPU_CHECK_DIR", "/tmp/gpu_check")),
                        help="where the random models and the results go")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the card's bf16 dense peak, if not listed")
    args = parser.parse_args(argv)
    folder = ROOT / ".gpu"
    results = args.work / "results.jsonl"
    if args.prepare:
        prepare(folder)
        return 0
    if args.summary:
        return summary(results)
    missing = [name for name in ("tyro", "minigrid", "gymnasium", "pygame") if not _importable(name)]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not installed: run `bash scripts/gpu_check.sh --prepare` where the "
                         f"network is, and carry .gpu (gpu_check.sh installs its wheels)")
    import torch

    sizes = args.sizes or (["smoke"] if args.smoke else ["1.5b", "3b"])
    work = SMOKE if args.smoke else GPU
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.fsdp2:
        results.write_text("")
    tokenizer_folder, template = tokenizer_source(folder)

    def record(label: str, row: dict) -> None:
        with results.open("a") as f:
            f.write(json.dumps({"section": label} | row) + "\n")

    start = time.perf_counter()
    models = {size: random_model(size, args.work, tokenizer_folder, template) for size in sizes}
    accelerator, precision = accelerator_of(train_args(models[sizes[0]], work, lora=False)[0])
    peak = peak_flops(args.peak_tflops)
    if not args.fsdp2:
        ceiling = matmul_tflops()
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        print(f"[device] {device}, torch {torch.__version__}, {precision} mixed precision; MFU: {peak[1]}; "
              + (f"a bf16 8192^3 matrix product runs at {ceiling:.0f} TFLOP/s here" if ceiling else
                 "no matrix-product ceiling (no GPU)")
              + f"; random models of {', '.join(sizes)} made in {time.perf_counter() - start:.1f} s")
        record("device", {"seconds": time.perf_counter() - start, "tflops": ceiling, "ok": True, "device": device})
        for size in sizes:
            run_size(size, models[size], accelerator, precision, work, args.sections, peak, record)
    else:
        if accelerator.distributed_type.value != "FSDP":
            raise SystemExit("--fsdp2 runs under `accelerate launch --config_file configs/fsdp2.yaml` (gpu_check.sh)")
        run_size(sizes[0], models[sizes[0]], accelerator, precision, work, ["update"], peak, record)
    return 0


def accelerator_of(args):
    """rl/model.make_accelerator for train.py's Args `args`, as train.py's main makes it."""
    from rl.model import make_accelerator

    return make_accelerator(args.model_args.mixed_precision, args.grad_clip, args.engine_args.deterministic)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def summary(results: Path) -> int:
    """The table of every section's figures; 1 if a section failed (or none ran)."""
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []

    columns = (("seconds", "8.1f"), ("tokens_s", "10,.0f"), ("tflops", "8.1f"), ("mfu", "6.1%"), ("peak_gib", "9.2f"),
               ("plan_gib", "9.2f"), ("ratio", "9.2f"), ("bare", "9.2f"), ("logprob_diff", "8.2g"))

    def cell(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) else "-".rjust(int(spec.split(".")[0].strip(",")))

    print(f"{'section':<26} {'seconds':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9} "
          f"{'plan/peak':>9} {'ours/bare':>9} {'lp diff':>8}  ok")
    for row in rows:
        print(f"{row['section']:<26} " + " ".join(cell(row.get(key), spec) for key, spec in columns)
              + f"  {'yes' if row.get('ok') else 'NO'}")
    bad = [row["section"] for row in rows if not row.get("ok")]
    total = sum(row.get("seconds") or 0.0 for row in rows)
    print(f"{len(rows)} sections in {total:.0f} s (models' loading aside): "
          + (f"FAILED: {', '.join(bad)}" if bad else "all checks passed" if rows else "none ran"))
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
