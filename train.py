"""Multi-turn RL for LLM agents on AgentGym environments: AgentGym-RL and ScalingInter-RL.

    python train.py                                              # tiny embedded model, BabyAI, CPU, minutes
    python train.py --model Qwen/Qwen2.5-3B-Instruct --env babyai  # the paper's recipe, one GPU
    accelerate launch --num_processes 8 train.py --model Qwen/Qwen2.5-3B-Instruct --env textcraft \
        --algo grpo --horizon 10 20 30 --horizon-every 100          # ScalingInter-RL, data-parallel

Each step: sample `tasks_per_step` tasks from the env's train split, roll out `n` episodes of each
(rollout.py: batched generation, envs stepped in parallel, exact sampled tokens) with at most as many
turns as the horizon schedule allows at this step (rl/horizon.py), score each episode by its last
reward, turn scores into advantages (rl/advantages.py: `--algo` grpo, rloo, reinforce_pp, or ppo with
a critic and GAE), and update the policy with PPO's clipped loss, a KL penalty to the frozen initial
model and an entropy bonus (rl/losses.py). Every trajectory goes to runs/<run>/rollouts.jsonl,
metrics to runs/<run>/metrics.jsonl (and wandb with --track), checkpoints to
runs/<run>/checkpoints/step_<k>.

Beside RL, the same script learns from trajectory files (--data: AgentGym's AgentTraj JSON/JSONL, a
run's rollouts.jsonl, eval.py's episodes) on the same model loading, chat layout, loss mask (rl/data.py),
Accelerate set-up, logs and checkpoints, so that each one's checkpoint is the next one's --model:

    python scripts/make_expert_data.py --env babyai --split train --horizon 6      # the oracle's episodes
    python train.py --algo sft --data data/babyai_train_expert.jsonl --epochs 2   # behaviour cloning
    python train.py --algo dpo --data expert.jsonl --experience runs/<run>/rollouts.jsonl
    python train.py --algo agentevol --data data/babyai_train_expert.jsonl --iterations 3 --n 4

- sft: token-mean cross-entropy on the assistant tokens, several conversations packed per row with no
  attention across them (rl/sft.py), a seeded share of the tasks held out for the validation loss.
- dpo: pairs of episodes of one task, the chosen one scoring at least --margin more (rl/dpo.py), from
  --data alone or, as AgentGym's make_dpo_dataset, --data's expert episodes against --experience; the
  DPO loss on summed assistant-token log-probs against the frozen --model, with --beta.
- agentevol: AgentGym's self-evolution: behaviour cloning on --data, then per iteration explore the
  train split with the current policy (--n episodes a task), keep the episodes reaching --threshold,
  retrain --model on --data plus those, and play the test split.
--eval-every plays the test split during any run (RL too), scored as eval.py scores.

Presets: flags default to the paper's recipe (lr 1e-6, clip 0.2, KL 0.001, entropy 0.001,
temperature 1.0) for a real model; with the embedded tiny model (the default) they default to the
`tiny` preset instead, sized to finish on two CPU cores in minutes. `--preset` picks one
explicitly; any flag you pass overrides the preset.

Rollouts run on `--engine`: vLLM where it is installed (`bash setup.sh` installs it; the CPU build
here), in every process, with the trainer's weights copied in after every update and checked on a
probe sequence (the run stops if they differ); or Hugging Face sampling on the trainer's own weights.
Each process of a multi-GPU run rolls out its own share of tasks, so groups never straddle
processes. Launches are Accelerate's (configs/): data-parallel, or FSDP2 with the reference and critic sharded
as the policy is and the engines fed weights gathered one parameter at a time; --lora-rank trains PEFT adapters
(the reference is then the policy with its adapters off); --dry-run prints the memory plan (rl/memory.py).
DeepSpeed ZeRO-3 (configs/zero3.yaml) shards them too: its engines step their optimizers themselves, once per
mini-batch here, however many micro-batches it holds (rl/zero3.py).

Where the loop deliberately differs from upstream's (AgentGym-RL's verl fork), and why:
- `--ppo-epochs` is honoured: upstream's actor makes one pass whatever its ppo_epochs says, so the
  recipes pass --ppo-epochs 1 to reproduce it.
- Under data parallelism the loss of a mini-batch is normalised by its token (or sequence) count
  over all processes, so every token weighs the same wherever it was played; upstream normalises
  per micro-batch on each GPU, which `--loss-agg seq-mean-token-mean` (the paper preset's) matches
  when micro-batches hold one trajectory, as in its scripts.
- The reference model is loaded and run exactly as the policy (fp32 under autocast; both with bf16 weights
  under DeepSpeed's bf16), so the KL is 0 while their weights agree; upstream runs it in bf16 with CPU offload
  (here: --offload-reference, or configs/fsdp2_offload.yaml).
- Resume restores the samplers' random state and takes the run's own settings; upstream re-seeds
  and takes whatever the command line says.
- SFT packs conversations into rows (block-causal masks, positions restarting per conversation) and
  averages the loss over the action tokens of the whole batch however it is split into micro-batches
  and processes; AgentGym pads each conversation and averages per micro-batch, which weighs a token of
  a short conversation more. The log-probs, and so the optimum, are the same (tests/test_sft.py).
- SFT, DPO and AgentEvol hold out a share of the tasks (--validation) for a validation loss; AgentGym
  trains on every record and only evaluates by playing.
- DPO also pairs episodes within a task of one file (our rollout logs and eval outputs), besides
  AgentGym's expert-versus-experience pairs.
- AgentEvol explores --explore-tasks of the train split (default: all) --n times each at the run's
  temperature; AgentGym's script explores a set of its own greedily (do_sample False), which would make
  the samples of a task identical. It can also go on from the last iteration's weights (--retrain-from
  continue); AgentGym always retrains from the base.
(Reward placement, GAE over action tokens and groups of one are in rl/advantages.py; the horizon
schedule's resume in rl/horizon.py.)
"""

from __future__ import annotations

import rl  # noqa: F401 - first: sets OpenMP's wait policy before torch loads (see rl/__init__.py)

import argparse
import collections
import contextlib
import copy
import functools
import math
import json
import os
import random
import shutil
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

import torch
import tyro
from safetensors.torch import load_file, save_file
from safetensors.torch import load_model as load_safetensors_model
from tqdm import tqdm

import envs
from envs.guard import close_envs, make_envs
from rl import advantages as adv_lib
from rl.agent import make_agent
from rl.batch import Batch, attach, count_sequences, make_batch, plan, scatter
from rl import checkpoint as checkpoint_lib
from rl import plots
from rl import zero3
from rl.data import DataError, encode, read_trajectories, to_record
from rl.dpo import dpo_loss, expert_pairs, make_pairs
from rl.horizon import describe, horizon_at
from rl.logprobs import pad, token_logprobs, token_values
from rl.losses import aggregate, kl, policy_loss, value_loss
from rl.memory import peak_gib, reset_peak
from rl.model import EMBEDDED, EMBEDDED_ROLLOUT, add_lora, full_weights, is_adapter, load_model, load_tokenizer, load_value_model
from rl.records import action_positions, per_action
from rl.engines import SyncError, engine_kind, make_engine, own_stream, stream_seed
from rl.scores import FINISHES, endings, gain, score, spread
from rl.sft import pack
from rollout import ChatFormat, Trajectory, play, rollout


@dataclass
class Args:
    # -- what to train
    env: str = "babyai"
    """environment: babyai, textcraft, sciworld, searchqa, webarena"""
    model: str = "tiny-agent"
    """Hugging Face id or local directory; `tiny-agent` is the embedded CPU model"""
    preset: Literal["auto", "paper", "tiny"] = "auto"
    """default values: `paper` (the paper's recipe), `tiny` (CPU demo); auto: tiny for the embedded model"""
    env_options: dict[str, str] = field(default_factory=dict)
    """keyword options for envs.make, e.g. --env-options reward normalized"""
    train_tasks: str | None = None
    """task id file in AgentGym-RL-Data-ID format ([{"item_id": "babyai_12"}, ...]); default: the shipped train split
    (the tiny preset's on BabyAI: 5 levels where the embedded agent learns fastest, envs/data/babyai_tiny_train.json)"""
    test_tasks: str | None = None
    """task id file that evaluations play (--eval-every); default: the shipped test split (the tiny preset's on
    BabyAI: envs/data/babyai_tiny_test.json)"""

    # -- algorithm
    algo: Literal["grpo", "rloo", "reinforce_pp", "ppo", "sft", "dpo", "agentevol"] = "grpo"
    """RL by its advantage estimator: grpo (group-normalised), rloo (leave-one-out), reinforce_pp (discounted
    returns whitened over the batch), ppo (a critic and GAE); or learning from trajectory files (--data):
    sft (behaviour cloning), dpo (preference pairs), agentevol (AgentGym's self-evolution)"""
    grpo_scale: bool = True
    """grpo: divide by the group's std; --no-grpo-scale is Dr. GRPO"""
    gamma: float = 1.0
    """discount per action token (reinforce_pp, ppo)"""
    lam: float = 1.0
    """GAE lambda (ppo)"""

    # -- SFT, DPO, AgentEvol: learning from trajectory files
    data: tuple[str, ...] = ()
    """trajectory files to learn from: AgentGym's AgentTraj JSON/JSONL (scripts/make_expert_data.py writes
    them), a run's rollouts.jsonl or eval.py's episodes"""
    experience: tuple[str, ...] = ()
    """dpo: the model's own episodes, each paired (rejected) with its task's episode in --data (chosen),
    as AgentGym's make_dpo_dataset; without it, pairs are made within --data's tasks"""
    batch_size: int = 16
    """conversations (dpo: pairs) per optimizer step"""
    validation: float = 0.05
    """share of --data's tasks held out for the validation loss"""
    beta: float = 0.5
    """dpo: strength of the pull toward the reference model (AgentGym's train_dpo.sh: 0.5)"""
    margin: float = 0.5
    """dpo: a pair's chosen episode scored at least this much more than its rejected one"""
    iterations: int = 2
    """agentevol: rounds of explore, keep the successes, retrain, evaluate, after a first round of behaviour
    cloning on --data alone"""
    explore_tasks: int = 0
    """agentevol: train tasks explored per iteration (--n episodes each), spread over the split; 0: all"""
    threshold: float | None = None
    """agentevol: keep explored episodes with at least this reward; default: those the env counts as solved"""
    retrain_from: Literal["base", "continue"] = "base"
    """agentevol: each iteration retrains --model afresh on the merged data (base, as AgentGym), or goes on
    from the last iteration's weights (continue)"""

    # -- evaluation during training
    eval_every: int = 0
    """play the test split every k steps and at the end (agentevol: every iteration); 0: never
    (agentevol: every iteration)"""
    eval_tasks: int = 64
    """test tasks per evaluation, spread over the split; 0: all"""
    eval_k: int = 1
    """episodes per test task in an evaluation (Avg@k, Pass@k)"""

    # -- rollout
    steps: int = 200
    """training steps (one rollout + one update each; sft, dpo: optimizer steps, agentevol: per iteration)"""
    epochs: int | None = None
    """passes over the train split (sft, dpo, agentevol: over --data), each in a new shuffled order
    (upstream's total_epochs); sets --steps"""
    tasks_per_step: int = 16
    """tasks per step, over all processes (upstream's train_batch_size)"""
    n: int = 8
    """samples per task (the group of grpo and rloo)"""
    horizon: tuple[int, ...] = (15,)
    """turn cap per episode; several values are ScalingInter-RL's stages, e.g. --horizon 10 20 30"""
    horizon_every: int = 100
    """training steps per horizon stage"""
    max_new_tokens: int = 512
    """tokens per assistant turn"""
    max_tokens: int = 8192
    """tokens per trajectory (prompt + every turn); an episode ends when it is spent"""
    agent: Literal["react", "plan", "reflect"] = "react"
    """how episodes are laid out (rl/agent.py): react, AgentGym's Thought/Action; plan, a plan written before the
    first action and revised when needed (trained like any action); reflect, up to --attempts attempts a task,
    each after a reflection on the failed ones (each attempt its own trajectory and reward)"""
    attempts: int = 3
    """--agent reflect: attempts a task gets (it stops at its first success)"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores tokens under the same softmax(logits / T)"""
    top_p: float = 1.0
    """nucleus sampling: draw from the smallest set of tokens holding this much probability"""
    gen_batch_size: int = 64
    """trajectories per generation call (hf engine)"""
    env_timeout: float = 0.0
    """seconds an env reset or step may take before its trajectory ends as failed and the env is
    replaced; 0: the env's default (its call_timeout in envs.ENVS)"""
    env_url: str | None = None
    """play on an AgentGym env server (ours, `python -m envs.serve`, or upstream's) at this URL instead
    of in process"""
    max_error_rate: float = 0.25
    """stop the run when more than this share of a step's trajectories end in an env failure, rather
    than train on the rest; 1: never"""

    # -- rollout engine
    engine: Literal["auto", "vllm", "hf"] = "auto"
    """vllm: vLLM in every process (continuous batching, prefix caching), the trainer's weights copied
    in and checked after every update; hf: Hugging Face sampling on the trainer's own weights; auto:
    vllm when it is installed"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of the GPU's memory the vLLM engine takes (weights and KV cache); the trainer has the rest.
    0.3 leaves a 3B full fine-tune its ~50 GB on one 80 GB GPU"""
    vllm_max_model_len: int = 0
    """the vLLM engine's context length; 0: --max-tokens"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine (tensor parallel); 1: one engine per process, each generating its own tasks"""
    vllm_sleep: bool = True
    """GPU: the engine frees its KV cache and offloads its weights while the trainer scores and updates"""
    sync_tolerance: float = 0.0
    """largest mean engine-vs-trainer log-prob difference on the probe accepted after a weight sync
    (the run stops past it); 0: by the engine's dtype, 1e-3 for fp32, 0.1 for bf16"""
    deterministic: bool = False
    """the same seed, the same run, on vLLM too (HF sampling always is), resumed or not: vLLM generates in rounds,
    each request seeded from a stream that every rollout restarts from (seed, step); vLLM loses 10-20% of its
    tokens/s on CPU (README)"""

    # -- optimisation
    lr: float = 1e-6
    """policy learning rate (AdamW)"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps"""
    weight_decay: float = 0.01
    """AdamW weight decay, policy and critic"""
    grad_clip: float = 1.0
    """clip the gradient norm of each optimizer step to this"""
    ppo_epochs: int = 1
    """passes over the step's trajectories (upstream makes one, whatever its ppo_epochs says)"""
    minibatches: int = 2
    """optimizer steps per epoch over the step's trajectories"""
    micro_batch_size: int = 1
    """trajectories per forward/backward (gradient accumulation inside a mini-batch; sft: packed rows,
    dpo: pairs)"""
    max_tokens_per_micro_batch: int = 0
    """RL: choose micro-batches by tokens instead of --micro-batch-size: padded rows x width (with --pack: the
    tokens of a row) at most this many; a longer trajectory goes alone. 0: by --micro-batch-size"""
    pack: bool = False
    """RL: several trajectories a row, positions restarting and no attention across them (no padding); needs
    --max-tokens-per-micro-batch, the length of a row"""
    clip: float = 0.2
    """PPO ratio clip (the lower one when --clip-high is given)"""
    clip_high: float | None = None
    """upper ratio clip, e.g. 0.28 (DAPO's clip-higher); default: --clip"""
    dual_clip: float | None = None
    """bound the loss of negative advantages at -A * c (dual clip, c > 1, e.g. 3)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    """how per-token losses become one number: seq-mean-token-mean (every trajectory weighs the same,
    what upstream effectively optimises), token-mean (every token), seq-mean-token-sum (Dr. GRPO)"""
    kl_coef: float = 0.001
    """weight of KL(policy || initial policy); 0 drops the reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """k1 (log-ratio), k2 (squared, upstream's mse) or k3 (upstream's low_var_kl)"""
    kl_in_reward: bool = False
    """subtract the KL from the reward (per token) instead of adding it to the loss"""
    entropy_coef: float = 0.001
    """weight of the entropy bonus (subtracted from the loss)"""

    # -- critic (ppo)
    critic_lr: float = 1e-5
    """learning rate of PPO's critic (upstream's critic.optim.lr)"""
    critic_lr_warmup_steps: int = 0
    """linear learning-rate warm-up of the critic, in optimizer steps"""
    critic_warmup: int = 0
    """the policy trains from step k on, only the critic before (upstream's trainer.critic_warmup: k - 1
    critic-only steps)"""
    value_clip: float = 0.5
    """value-loss clip around the old values"""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on GPU, fp32 on CPU"""
    lora_rank: int = 0
    """train LoRA adapters of this rank (PEFT) instead of every weight; 0: full fine-tune. The reference is then
    the policy with its adapters off (no second copy of the model), and checkpoints hold the adapter"""
    lora_alpha: float = 32.0
    """LoRA's scale numerator: adapters add (alpha / rank) B A"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """modules that get adapters, e.g. q_proj k_proj v_proj o_proj; all-linear: every linear layer but the output layer"""
    offload_reference: bool = False
    """keep the frozen reference in CPU memory, on the GPU only while it scores a step (one GPU or data-parallel; a
    sharded run offloads every model with configs/fsdp2_offload.yaml)"""
    gradient_checkpointing: bool = True
    """recompute activations in the backward pass: less memory (upstream's setting; without it a micro-batch of 8k
    tokens on a 3B model keeps ~36 GiB of activations: --dry-run), about a third more compute"""
    max_nonfinite_updates: int = 3
    """an optimizer step whose loss or gradient is NaN or infinite is skipped; this many in a row stop the
    run, and the batch is saved under the run directory for debugging"""

    # -- planning
    dry_run: bool = False
    """print the estimated peak memory per GPU of this run (weights, optimizer states, activations, engine) and
    whether it fits, then stop: only the model's config is read"""
    launch_config: str | None = None
    """with --dry-run: the Accelerate config the run will be launched with (configs/*.yaml), to plan it from any
    machine; default: how this process was launched"""
    gpu_gib: float = 0.0
    """with --dry-run: GPU memory to plan for; 0: this machine's GPU, else 80 (an H100)"""

    # -- bookkeeping
    seed: int = 1
    """seeds the task order, the sampler and the update's shuffling"""
    run_name: str | None = None
    """default: <env>-<algo>-<time>"""
    out_dir: str = "runs"
    """runs are written to <out_dir>/<run_name>"""
    save_every: int = 50
    """checkpoint every k steps (and at the end); 0: only at the end"""
    keep_checkpoints: int = 0
    """keep only the k newest checkpoints; 0: keep all"""
    resume: str | None = None
    """continue a run with its own settings (its config.json; only the flags in RESUMABLE may change):
    a checkpoint directory (runs/<run>/checkpoints/step_<k>), a run directory (its newest complete
    checkpoint), or `auto`: the newest checkpoint of <out-dir>/<run-name> if there is one, else a new run
    under that name (the same command line then survives any number of crashes)"""
    log_rollouts_every: int = 1
    """write every k-th step's trajectories to rollouts.jsonl (metrics go to metrics.jsonl every step)"""
    track: bool = False
    """log to wandb (offline mode when no API key is configured), with a few trajectories a step as a table"""
    wandb_project: str = "agentgym-rl"
    """the wandb project of --track"""



PRESETS = {
    "paper": Args(),
    # the default run, `python train.py`: ScalingInter-RL on 5 BabyAI levels (TINY_TASKS), 3 turns
    # then 6, and the held-out comparison of the initial and final policies (step 0 and the last evaluation)
    "tiny": Args(
        env=EMBEDDED_ROLLOUT["env"], horizon=(3, EMBEDDED_ROLLOUT["horizon"]), horizon_every=8,
        max_new_tokens=EMBEDDED_ROLLOUT["max_new_tokens"], max_tokens=EMBEDDED_ROLLOUT["max_tokens"], steps=16,
        tasks_per_step=8, n=8, lr=2e-4, minibatches=1, micro_batch_size=4, gradient_checkpointing=False, save_every=0,
        critic_lr=1e-3,
        eval_every=16, eval_tasks=0, eval_k=2,
        # n: groups of 8, since at the agent's first 5-10% success a group of 4 has no success (no GRPO signal) about
        # two times in three; measured over 3 seeds each (README, What to expect), the held-out gain was 14-29 points
        # with n 8, 8-11 with n 4 (and 10-11 with 16 tasks x 4, the same 64 episodes a step). lr: at n 4, 2e-4 beat 1e-4
        # and 5e-4. loss_agg: on the one-turn bandit of tests/test_learning.py at lr 1e-3,
        # token-mean takes GRPO from 27% to 69% in 6 steps, seq-mean-token-mean drifts to long replies and collapses
        loss_agg="token-mean",
    ),
}


# What a resumed run may change: how long it goes on, how it is logged and checkpointed, the engine
# that samples and its sizing (for another GPU; the samples then differ from an uninterrupted run's),
# and the env infrastructure (where the env server is, how long a call may take, what stops the run).
# Everything else is the run's own setting, so that it continues as it started, in its own directory.
# Learning from trajectory files takes its own learning rate: AgentGym's example scripts' for a real model
# (behaviour cloning and AgentEvol 1e-5, DPO 5e-7), and for the embedded one what took its losses down in a few
# dozen steps (measured: see the README).
OFFLINE_LR = {("paper", "sft"): 1e-5, ("paper", "agentevol"): 1e-5, ("paper", "dpo"): 5e-7,
              ("tiny", "sft"): 1e-3, ("tiny", "agentevol"): 1e-3, ("tiny", "dpo"): 1e-4}
OFFLINE = ("sft", "dpo", "agentevol")
# The tiny preset's task sets, by env (envs/data, scripts/babyai_splits.py): on BabyAI the 5 fixed-goal levels
# whose expert finishes within 6 turns, where the embedded agent learns fastest (held-out success 8-11% at
# first, 22-40% after the default run); on the others a group rarely differs in reward.
TINY_TASKS = {"babyai": ("babyai_tiny_train.json", "babyai_tiny_test.json")}
# Elsewhere its evaluations (at step 0 and at the end) play this many test tasks, spread over the split: 32
# episodes at --eval-k 2, half a training step's 64, where the whole split would be 200 (TextCraft) to 2,342
# (SciWorld) episodes each time, for an agent that never learned those envs; --eval-tasks 0 plays it all.
TINY_EVAL_TASKS = 16


RESUMABLE = ("steps", "epochs", "save_every", "keep_checkpoints", "log_rollouts_every", "track", "wandb_project", "gen_batch_size", "resume",
             "out_dir", "engine", "vllm_gpu_memory_utilization", "vllm_max_model_len", "vllm_tensor_parallel_size",
             "vllm_sleep", "sync_tolerance", "env_timeout", "env_url", "max_error_rate", "max_nonfinite_updates")


def parse_args(argv: list[str] | None = None) -> Args:
    """tyro over the preset that applies: `tiny` for the embedded model, `paper` otherwise; when
    resuming, over the run's own settings."""
    argv = sys.argv[1:] if argv is None else argv
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model", default=Args.model)
    peek.add_argument("--preset", default="auto")
    peek.add_argument("--algo", default=Args.algo)
    peek.add_argument("--env", default=PRESETS["tiny"].env)
    peek.add_argument("--resume", default=None)
    peek.add_argument("--run-name", "--run_name", dest="run_name", default=None)  # (tyro takes both spellings)
    peek.add_argument("--out-dir", "--out_dir", dest="out_dir", default=Args.out_dir)
    peek.add_argument("--steps", default=None)
    peek.add_argument("--epochs", default=None)
    known, _ = peek.parse_known_args(argv)
    if known.steps is not None and known.epochs is not None:  # (a preset's or a resumed run's steps are not given)
        raise SystemExit("--steps and --epochs both set how long the run is (--epochs N: N passes over the train "
                         "split, or over --data): give one")
    checkpoint = find_checkpoint(known.resume, known.out_dir, known.run_name) if known.resume else None
    if checkpoint is not None:
        return resumed_args(argv, checkpoint)
    preset = known.preset if known.preset != "auto" else preset_of(known.model)
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose one of: auto, {', '.join(PRESETS)}")
    default = replace(PRESETS[preset], preset=preset)
    if (preset, known.algo) in OFFLINE_LR:  # (and one turn cap: ScalingInter-RL's stages are steps of RL)
        default = replace(default, lr=OFFLINE_LR[preset, known.algo], horizon=default.horizon[-1:])
    if preset == "tiny" and known.env in TINY_TASKS:
        train, test = TINY_TASKS[known.env]
        default = replace(default, train_tasks=str(envs.DATA_DIR / train), test_tasks=str(envs.DATA_DIR / test))
    elif preset == "tiny":
        default = replace(default, eval_tasks=TINY_EVAL_TASKS)
    args = tyro.cli(Args, args=argv, default=default, description=__doc__.split("\n\n")[0])
    return replace(args, preset=preset)


def preset_of(model: str) -> str:
    """`--preset auto`: tiny for the embedded model and for a checkpoint of a run that used it (so that SFT
    then GRPO on the tiny model chain without flags), the run's own for any other run's checkpoint, else
    paper."""
    config = Path(model).parent.parent / "config.json"
    if Path(model).parent.name == "checkpoints" and config.is_file():
        return json.loads(config.read_text()).get("preset", "paper")
    return "tiny" if model in EMBEDDED else "paper"


def find_checkpoint(resume: str, out_dir: str, run_name: str | None) -> Path | None:
    """The checkpoint --resume names: itself, a run directory's newest complete one, or with `auto` the
    newest of <out_dir>/<run_name> (None when it has none yet: a new run starts)."""
    if resume == "auto":
        if not run_name:
            raise SystemExit("--resume auto continues the run named by --run-name: give one")
        found = checkpoint_lib.checkpoints(Path(out_dir) / run_name)
        return found[-1] if found else None
    path = Path(resume)
    if (path / "config.json").is_file() and not (path / checkpoint_lib.STATE).is_file():  # a run directory
        found = checkpoint_lib.checkpoints(path)
        if not found:
            raise SystemExit(f"--resume {path}: the run has no complete checkpoint yet (start it again with "
                             f"--resume auto --run-name {path.name} --out-dir {path.parent})")
        return found[-1]
    return path


def resumed_args(argv: list[str], checkpoint: Path) -> Args:
    """The run's settings from its config.json, with the flags of this command line that RESUMABLE
    allows; any other flag that differs stops the run, naming it."""
    config_file = checkpoint.parent.parent / "config.json"
    if not (checkpoint / checkpoint_lib.STATE).is_file() or not config_file.is_file():
        raise SystemExit(f"--resume {checkpoint}: not a checkpoint of a run (runs/<run>/checkpoints/step_<k>, "
                         "with the run's config.json two levels up), nor a run directory, nor `auto`")
    if not (checkpoint / "state" / "schedulers.json").is_file():
        raise SystemExit(f"--resume {checkpoint}: a checkpoint from before training state was saved as safetensors "
                         "(its state/ held pickles); its weights load with --model or eval.py, but it cannot be resumed")
    config = json.loads(config_file.read_text())
    saved = replace(PRESETS[config.get("preset", "paper")], **{
        f.name: tuple(config[f.name]) if isinstance(config[f.name], list) else config[f.name]
        for f in fields(Args) if f.name in config})
    args = tyro.cli(Args, args=argv, default=saved, description=__doc__.split("\n\n")[0])
    args = replace(args, resume=str(checkpoint))
    if args.steps != saved.steps and args.epochs == saved.epochs:  # --steps replaces the run's --epochs
        args = replace(args, epochs=None)
    changed = [f.name for f in fields(Args) if f.name not in RESUMABLE and getattr(args, f.name) != getattr(saved, f.name)]
    if changed:
        given = ", ".join(f"--{name.replace('_', '-')} {getattr(args, name)} (the run's: {getattr(saved, name)})"
                          for name in changed)
        raise SystemExit(f"--resume continues the run with its own settings, and this command line changes {given}. "
                         f"Drop those flags, or start a new run; on resume only "
                         f"{', '.join('--' + n.replace('_', '-') for n in RESUMABLE)} may change.")
    return args


def check(args: Args, world: int, distributed: str = "NO") -> None:
    """Stop early, with what to do, on settings that cannot work. `distributed`: Accelerate's
    distributed type (NO, MULTI_GPU, FSDP, DEEPSPEED, ...)."""
    if distributed == "MEGATRON_LM":
        raise SystemExit("train.py does not run under Megatron-LM: shard with FSDP2 (configs/fsdp2.yaml) or DeepSpeed "
                         "ZeRO-3 (configs/zero3.yaml), or launch data-parallel (configs/ddp.yaml)")
    if distributed in ("FSDP", "DEEPSPEED") and args.algo == "agentevol":
        raise SystemExit("agentevol resets the policy in place between iterations, which a sharded model does not "
                         "support here: run it data-parallel (configs/ddp.yaml) or on one GPU")
    for flag in ("steps", "tasks_per_step", "n", "max_new_tokens", "ppo_epochs", "minibatches", "micro_batch_size",
                 "max_nonfinite_updates", "log_rollouts_every", "attempts"):
        if getattr(args, flag) < 1:  # 0 would silently skip every rollout or update
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.epochs is not None and args.epochs < 1:
        raise SystemExit("--epochs must be at least 1")
    if args.launch_config and not Path(args.launch_config).is_file():
        raise SystemExit(f"--launch-config {args.launch_config} does not exist: give one of configs/*.yaml")
    if args.keep_checkpoints < 0 or args.env_timeout < 0:
        raise SystemExit("--keep-checkpoints and --env-timeout take 0 (all, the env's default) or more")
    if not 0 <= args.max_error_rate <= 1:
        raise SystemExit("--max-error-rate is a share of a step's trajectories, in [0, 1]")
    if args.env not in envs.ENVS:
        raise SystemExit(f"unknown env {args.env!r}; choose one of: {', '.join(envs.ENVS)}")
    for flag in ("train_tasks", "test_tasks"):
        try:  # (read again where they are played; a bad file stops here, before anything loads)
            if getattr(args, flag):
                envs.load_task_ids(getattr(args, flag), args.env)
        except envs.TaskFileError as error:
            raise SystemExit(f"--{flag.replace('_', '-')}: {error}") from None
    if args.n < 2 and args.algo in ("grpo", "rloo"):
        raise SystemExit(f"{args.algo} compares the samples of a task with each other: use --n 2 or more")
    if not args.horizon or min(args.horizon) < 1 or args.horizon_every < 1:
        raise SystemExit("--horizon takes one or more turn caps of at least 1, --horizon-every at least 1 step")
    if list(args.horizon) != sorted(args.horizon):
        raise SystemExit(f"--horizon {' '.join(map(str, args.horizon))}: ScalingInter-RL's stages only grow")
    if args.critic_warmup > 1 and args.algo != "ppo":
        raise SystemExit(f"--critic-warmup trains only the critic for a while, and --algo {args.algo} has none: "
                         "use it with --algo ppo")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise SystemExit("--dual-clip must be larger than 1")
    if args.algo == "ppo" and args.mixed_precision == "fp16":
        raise SystemExit("--algo ppo steps two optimizers, which fp16's loss scaling does not support here: "
                         "use --mixed-precision bf16")
    if args.max_new_tokens >= args.max_tokens:
        raise SystemExit("--max-new-tokens must be smaller than --max-tokens")
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise SystemExit("--vllm-gpu-memory-utilization is a share of the GPU's memory, in (0, 1]")
    if 0 < args.vllm_max_model_len < args.max_tokens:
        raise SystemExit(f"--vllm-max-model-len {args.vllm_max_model_len} is shorter than --max-tokens {args.max_tokens}: "
                         "the engine could not hold a whole trajectory (0 sizes it to --max-tokens)")
    if args.vllm_tensor_parallel_size != 1 and args.engine != "hf":
        raise SystemExit("--vllm-tensor-parallel-size above 1 puts the engine's workers in other processes, which the "
                         "in-memory weight sync cannot reach yet: train with one engine per process (the default); "
                         "eval.py takes it")
    if args.offload_reference and args.algo == "dpo":
        raise SystemExit("--offload-reference: DPO scores the reference in every micro-batch, which would move it "
                         "each time; use --lora-rank (no copy at all) or configs/fsdp2_offload.yaml")
    if args.offload_reference and (args.lora_rank or distributed in ("FSDP", "DEEPSPEED")):
        raise SystemExit("--offload-reference moves the frozen reference to CPU memory: with --lora-rank there is none "
                         "(the policy with its adapters off is the reference), and a sharded run offloads with "
                         "configs/fsdp2_offload.yaml (or DeepSpeed's offload_param_device: cpu)")
    if args.lora_rank < 0 or args.lora_alpha <= 0:
        raise SystemExit("--lora-rank takes 0 (full fine-tune) or more, --lora-alpha a positive number")
    if args.eval_every < 0 or args.eval_tasks < 0 or args.eval_k < 1:
        raise SystemExit("--eval-every and --eval-tasks take 0 (never, all) or more, --eval-k 1 or more")
    if args.algo in OFFLINE and args.agent != "react":
        raise SystemExit(f"--agent {args.agent} lays out the rollouts of RL (grpo, rloo, reinforce_pp, ppo); {args.algo} "
                         "learns AgentGym's ReAct conversations (--data), so it plays them as react too")
    if args.algo in OFFLINE:
        return check_offline(args, world)
    if args.data or args.experience:
        raise SystemExit(f"--data and --experience are what sft, dpo and agentevol learn from; --algo {args.algo} "
                         "learns from its own rollouts")
    if args.tasks_per_step % world:
        raise SystemExit(f"--tasks-per-step {args.tasks_per_step} must be divisible by the {world} processes")
    trajectories = args.tasks_per_step // world * args.n
    micro_batches = (trajectories + args.micro_batch_size - 1) // args.micro_batch_size
    if args.max_tokens_per_micro_batch < 0 or args.pack and not args.max_tokens_per_micro_batch:
        raise SystemExit("--pack fills rows of --max-tokens-per-micro-batch tokens: give that too (e.g. 16384)")
    if args.max_tokens_per_micro_batch and trajectories < args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} is more than the {trajectories} trajectories each process has")
    if not args.max_tokens_per_micro_batch and micro_batches < args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} is more than the {micro_batches} micro-batches of "
                         f"--micro-batch-size {args.micro_batch_size} that each process has")


def check_offline(args: Args, world: int) -> None:
    """check()'s part for sft, dpo and agentevol."""
    if not args.data:
        raise SystemExit(f"--algo {args.algo} learns from trajectory files: give --data FILE ... (AgentGym's AgentTraj "
                         "format; `python scripts/make_expert_data.py --env ENV` writes the oracle's, and a run's "
                         "rollouts.jsonl or eval.py's episodes read too)")
    if args.experience and args.algo != "dpo":
        raise SystemExit("--experience holds the rejected side of DPO's pairs: use it with --algo dpo")
    if args.batch_size < 1 or args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be at least 1 and divisible by the {world} processes")
    if not 0 <= args.validation < 1:
        raise SystemExit("--validation is the share of --data's tasks held out, in [0, 1)")
    if args.beta <= 0 or args.margin < 0:
        raise SystemExit("--beta must be above 0 and --margin at least 0")
    if args.iterations < 1 or args.explore_tasks < 0:
        raise SystemExit("--iterations takes 1 or more, --explore-tasks 0 (all) or more")
    if args.algo == "agentevol" and len(args.horizon) > 1:
        raise SystemExit("--horizon takes one turn cap with agentevol (ScalingInter-RL's stages are steps of RL)")
    if args.algo == "agentevol" and args.resume is not None:
        raise SystemExit("--resume does not continue an agentevol run yet: each iteration's model is in "
                         "runs/<run>/checkpoints/step_<iteration>; start a new run from it with --model")


# ----------------------------------------------------------------------------------------------
# The phases of a training step, in the order main() runs them


def tasks_for(step: int, train_ids: list[int], per_step: int, seed: int) -> list[int]:
    """The tasks of a training step: shuffled epochs over the train split, as upstream's data loader
    (every task once per epoch, a new order each epoch, the last incomplete batch dropped). A pure
    function of the step, so a resumed run sees the tasks it would have seen."""
    epoch, k = divmod(step - 1, len(train_ids) // per_step)
    order = random.Random(f"{seed}-epoch-{epoch}").sample(train_ids, len(train_ids))
    return order[k * per_step:(k + 1) * per_step]


def batch_of(trajectories: list[Trajectory], args: Args, accelerator, pad_id: int) -> Batch:
    """The step's tensors (rl/batch.py): micro-batches by --micro-batch-size or --max-tokens-per-micro-batch,
    packed with --pack, as many on every process (the most any process needs; the others add empty ones)."""
    layout = plan([len(t.token_ids) for t in trajectories], args.micro_batch_size, args.max_tokens_per_micro_batch,
                  args.pack, minimum=args.minibatches)
    reduce = reducer(accelerator, "max")
    count = int(reduce(torch.tensor([len(layout)]))) if reduce is not None else len(layout)
    return make_batch(trajectories, pad_id, layout, accelerator.device, count=count, pack=args.pack)


@dataclass
class Models:
    """What the update trains and scores with; `policy` and `critic` are wrapped by Accelerate."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref: torch.nn.Module | None = None  # the frozen initial policy, for the KL
    adapter_reference: bool = False  # LoRA: the reference is the policy with its adapters off
    critic: torch.nn.Module | None = None  # PPO's value model
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    # per model ("policy", "critic"): its optimizer steps skipped in a row for a NaN or infinite loss or gradient
    nonfinite_streak: dict[str, int] = field(default_factory=dict)


def has_reference(models: Models) -> bool:
    return models.ref is not None or models.adapter_reference


@contextlib.contextmanager
def reference(models: Models, accelerator, offloaded: bool = False):
    """The model that scores the reference log-probs: the frozen initial policy (brought from CPU memory for the
    duration when `offloaded`), or under LoRA the policy itself with its adapters off for the duration."""
    if models.ref is None:
        with accelerator.unwrap_model(models.policy).disable_adapter():
            yield models.policy
        return
    if offloaded:
        models.ref.to(accelerator.device)
    try:
        yield models.ref
    finally:
        if offloaded:
            models.ref.to("cpu")


@torch.no_grad()
def score_batch(models: Models, batch: Batch, args: Args, accelerator) -> None:
    """Old and reference log-probs and old values of every micro-batch, also scattered into `full`
    (the advantages need them on the whole batch). Every model runs as the policy does in the update
    and in the sampler (fp32 weights under Accelerate's autocast, which `prepare` also wraps around the
    policy's forward), so that policy and reference agree exactly while their weights do. With a
    single update per rollout the policy has not moved, so the old log-probs are the current ones
    (detached) and need no extra forward pass, unless the KL goes into the reward, which needs them
    before the update."""
    need_old = args.ppo_epochs * args.minibatches > 1 or (args.kl_in_reward and has_reference(models))
    for module in (models.policy, models.critic):
        if module is not None:
            module.eval()
    for micro in batch.micro:
        inputs = (micro["input_ids"], micro.get("attention_mask"), micro["loss_mask"])
        positions = micro.get("position_ids")
        with accelerator.autocast():
            if need_old:
                micro["old_logprobs"], _ = token_logprobs(models.policy, *inputs, args.temperature, position_ids=positions)
            if models.critic is not None:
                micro["old_values"] = token_values(models.critic, *inputs, position_ids=positions)
    if has_reference(models):  # in a pass of its own: under LoRA the reference is the policy with its adapters off
        with reference(models, accelerator, args.offload_reference) as ref:
            for micro in batch.micro:
                inputs = (micro["input_ids"], micro.get("attention_mask"), micro["loss_mask"])
                with accelerator.autocast():
                    micro["ref_logprobs"], _ = token_logprobs(ref, *inputs, args.temperature,
                                                              position_ids=micro.get("position_ids"))
    scatter(batch, ("old_logprobs", "ref_logprobs", "old_values"))


def stop_on_env_failures(trajectories: list[Trajectory], args: Args, accelerator, run_dir: Path, step: int) -> None:
    """Stop every process, naming the errors, when more than --max-error-rate of the step's trajectories
    (over all processes) ended in an env failure: a broken env must not quietly train the model on what
    is left. The step's episodes are written to failed_step_<k>.jsonl for a look."""
    from accelerate.utils import gather_object

    failed = [t.error for t in trajectories if t.error is not None]
    counts = gather_object([(len(failed), len(trajectories))])
    errors, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if errors <= args.max_error_rate * total:
        return
    records = gather_object([{"step": step, **t.log_record()} for t in trajectories])
    if accelerator.is_main_process:
        checkpoint_lib.write_atomic(run_dir / f"failed_step_{step}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    common = collections.Counter(r["error"] for r in records if r["error"]).most_common(3)
    message = (f"step {step}: {errors} of {total} trajectories ended in an env failure, more than --max-error-rate "
               f"{args.max_error_rate}; most common: " + "; ".join(f"{n} x {e}" for e, n in common)
               + f". The episodes are in {run_dir / f'failed_step_{step}.jsonl'}; fix the env (or raise "
               "--max-error-rate) and continue with --resume auto")
    accelerator.wait_for_everyone()  # (the file is written before any process exits)
    raise SystemExit(message if accelerator.is_main_process else 1)


def advantages_for(args: Args, full: dict, scores: torch.Tensor, groups: torch.Tensor, ok: torch.Tensor,
                   reduce) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's per-token advantages [B, T] (and GAE's returns for the critic) on the padded batch.
    A trajectory that ended in an env error has no outcome: its mask is already 0, and it stays out
    of the group statistics."""
    mask = full["loss_mask"]
    penalty = torch.zeros_like(mask)
    if args.kl_in_reward and "ref_logprobs" in full:  # r_t = outcome - beta * KL_t, per action token
        penalty = args.kl_coef * kl(full["old_logprobs"], full["ref_logprobs"], args.kl_estimator) * mask
    if args.algo in ("grpo", "rloo"):
        totals = scores - penalty.sum(1)  # the trajectory's return: outcome minus its summed KL penalty
        per_trajectory = torch.zeros_like(scores)
        if ok.any():
            estimator = adv_lib.rloo if args.algo == "rloo" else (lambda s, g: adv_lib.grpo(s, g, scale=args.grpo_scale))
            per_trajectory[ok] = estimator(totals[ok], groups[ok])
        return adv_lib.per_token(per_trajectory, mask), None
    rewards = adv_lib.place_reward(scores, mask) - penalty
    if args.algo == "reinforce_pp":
        return adv_lib.reinforce_pp(rewards, mask, args.gamma, reduce=reduce), None
    return adv_lib.gae(rewards, full["old_values"], mask, args.gamma, args.lam, reduce=reduce)


def update(models: Models, batch: Batch, args: Args, accelerator, step: int, progress=None) -> tuple[dict, dict]:
    """PPO's update: `ppo_epochs` passes, each over `minibatches` shuffled mini-batches of the step's
    micro-batches, one optimizer step per mini-batch for the policy (after the critic's warm-up) and
    the critic. Each mini-batch's loss is aggregated over the whole mini-batch however it is split
    into micro-batches, and gradients are averaged across processes once, at its last micro-batch.
    Returns the summed per-token statistics and the gradient norms of every optimizer step, of the
    models that trained. An optimizer step whose loss or gradient is not finite is skipped (counted in
    sums["nonfinite_updates"] and models.nonfinite_streak, with a warning; fp16's loss scaler skips the
    steps whose scaled gradients overflow itself, and those are not counted)."""
    train_policy = step >= args.critic_warmup  # as upstream: `critic_warmup <= global_steps`, counted from 1
    trained = [m for m in (models.policy if train_policy else None, models.critic) if m is not None]
    for module in trained:
        module.train()
    sums: dict[str, float] = {}
    grad_norms: dict[str, list[float]] = {}
    rng = random.Random(f"{args.seed}-{step}-update")
    for _ in range(args.ppo_epochs):
        shuffled = list(range(len(batch.micro)))
        rng.shuffle(shuffled)
        for part in range(args.minibatches):
            minibatch = [batch.micro[i] for i in shuffled[part::args.minibatches]]
            counts = minibatch_counts(minibatch, accelerator)
            finite = {"policy": True, "critic": True}  # (the losses so far; update_policy and update_critic keep it)
            for k, micro in enumerate(minibatch):
                last = k == len(minibatch) - 1
                with gradient_sync(accelerator, trained, now=last):
                    terms = update_policy(models, micro, counts, args, accelerator, last, finite) if train_policy else {}
                    if models.critic is not None:
                        terms |= update_critic(models, micro, counts, args, accelerator, last, finite)
                if progress is not None:
                    progress()
                for key, value in terms.items():
                    sums[key] = max(sums.get(key, 0.0), value) if key.endswith("_max") else sums.get(key, 0.0) + value
            stepped = [("policy", models.policy, models.optimizer, models.scheduler)] if train_policy else []
            if models.critic is not None:
                stepped.append(("critic", models.critic, models.critic_optimizer, models.critic_scheduler))
            for name, model, optimizer, scheduler in stepped:
                grad_norm, nonfinite = optimizer_step(model, optimizer, scheduler, args, accelerator, finite[name])
                count_nonfinite(models, sums, name, step, nonfinite, accelerator)
                if grad_norm is not None:
                    grad_norms.setdefault(name, []).append(grad_norm)
    scatter(batch, ("trainer_logprobs",))
    return sums, grad_norms


def count_nonfinite(models: Models, sums: dict, name: str, step: int, nonfinite: bool, accelerator) -> None:
    """Count an optimizer step of `name` skipped for NaN or inf, or end its streak of them."""
    if not nonfinite:
        models.nonfinite_streak[name] = 0
        return
    models.nonfinite_streak[name] = models.nonfinite_streak.get(name, 0) + 1
    sums["nonfinite_updates"] = sums.get("nonfinite_updates", 0) + 1
    if accelerator.is_main_process:
        tqdm.write(f"warning: step {step}: NaN or infinite {name} loss or gradient, optimizer step skipped "
                   f"({models.nonfinite_streak[name]} in a row)")


def minibatch_counts(minibatch: list[dict], accelerator) -> dict[str, float]:
    """What the losses of a mini-batch are divided by: its action tokens and its sequences with any
    action token, over every process's share of it, divided by the number of processes (a fraction
    when there are fewer than processes), since data-parallel training
    averages the processes' gradients. So each token (or sequence) weighs the same wherever it was
    played; with per-process counts a token on a process with 10 action tokens would weigh 19x one on
    a process with 190."""
    local = torch.tensor([sum(float(m["loss_mask"].sum()) for m in minibatch),
                          sum(count_sequences(m) for m in minibatch)], dtype=torch.float64)
    reduce = reducer(accelerator)
    total = reduce(local) if reduce is not None else local
    tokens, sequences = (total / accelerator.num_processes).tolist()
    return {"tokens": tokens, "sequences": sequences}


def reducer(accelerator, op: str = "sum"):
    """A function that sums (or takes the max of) a CPU tensor over processes; None on a single process."""
    if accelerator.num_processes == 1:
        return None
    if op == "max":
        return lambda t: accelerator.gather(t.to(accelerator.device)).max(0, keepdim=True).values.cpu()
    return lambda t: accelerator.reduce(t.to(accelerator.device), "sum").cpu()


def gradient_sync(accelerator, modules: list, now: bool) -> contextlib.ExitStack:
    """No all-reduce of these modules' gradients unless `now`: micro-batches accumulate locally."""
    stack = contextlib.ExitStack()
    if not now:
        for module in modules:
            stack.enter_context(accelerator.no_sync(module))
    return stack


def update_policy(models: Models, batch: dict, counts: dict, args: Args, accelerator, last: bool,
                  finite: dict) -> dict[str, float]:
    """Forward and backward of one micro-batch for the policy: PPO's clipped loss, minus the entropy
    bonus, plus the KL to the reference (unless it is in the reward), each aggregated over the whole
    mini-batch (`counts`: its action tokens and sequences). Returns the micro-batch's sums for metrics;
    finite["policy"] turns False when they are not finite (the mini-batch's `last` micro-batch then
    makes a DeepSpeed engine skip its step: see backward)."""
    mask = batch["loss_mask"]
    counts = counts | {"segments": batch["segments"]}  # (a packed row holds several trajectories)
    with accelerator.autocast():
        logprobs, entropy = token_logprobs(models.policy, batch["input_ids"], batch.get("attention_mask"), mask,
                                           args.temperature, with_entropy=True, position_ids=batch.get("position_ids"))
    old = batch["old_logprobs"] if "old_logprobs" in batch else logprobs.detach()
    batch.setdefault("trainer_logprobs", old.detach())  # the first pass's, for the rollout log
    pg, clipped = policy_loss(logprobs, old, batch["advantages"], args.clip, args.clip_high, args.dual_clip)
    loss = aggregate(pg, mask, args.loss_agg, **counts) - args.entropy_coef * aggregate(entropy, mask, args.loss_agg, **counts)
    divergence = torch.zeros_like(logprobs)
    if has_reference(models):
        divergence = kl(logprobs, batch["ref_logprobs"], args.kl_estimator)
        if not args.kl_in_reward:
            loss = loss + args.kl_coef * aggregate(divergence, mask, args.loss_agg, **counts)
    with torch.no_grad():
        terms = {
            "tokens": float(mask.sum()),
            "policy": float((pg * mask).sum()),
            "kl": float((divergence * mask).sum()),
            "entropy": float((entropy * mask).sum()),
            "clipfrac": float((clipped * mask).sum()),
            "ppo_kl": float(((old - logprobs) * mask).sum()),
            "logprob_diff": float(((batch["sampler_logprobs"] - old).abs() * mask).sum()),
            "logprob_diff_max": float(((batch["sampler_logprobs"] - old).abs() * mask).max()),
        }
    finite["policy"] &= all(math.isfinite(terms[key]) for key in ("policy", "kl", "entropy"))
    backward(models.policy, loss, accelerator, last, finite["policy"])
    return terms


def update_critic(models: Models, batch: dict, counts: dict, args: Args, accelerator, last: bool,
                  finite: dict) -> dict[str, float]:
    """Forward and backward of one micro-batch for the critic: the clipped value loss against the GAE
    returns, on action tokens only, aggregated like the policy loss (`last`, `finite` as update_policy's)."""
    mask = batch["loss_mask"]
    with accelerator.autocast():
        values = token_values(models.critic, batch["input_ids"], batch.get("attention_mask"), mask,
                              batch.get("position_ids"))
    terms, clipped = value_loss(values, batch["old_values"], batch["returns"], args.value_clip)
    with torch.no_grad():
        summed = {"critic_tokens": float(mask.sum()), "value": float((terms * mask).sum()),
                  "value_clipfrac": float((clipped * mask).sum())}
    finite["critic"] &= math.isfinite(summed["value"])
    backward(models.critic, aggregate(terms, mask, args.loss_agg, **counts, segments=batch["segments"]), accelerator,
             last, finite["critic"])
    return summed


def backward(model, loss: torch.Tensor, accelerator, last: bool, finite: bool) -> None:
    """Accelerate's backward, or under DeepSpeed the model's engine's own (rl/zero3.py: Accelerate drives only
    the engine it prepared last, and PPO's critic is another), where a loss that was not finite at any
    micro-batch of the mini-batch (`finite` False at its `last`) has the engine skip the step."""
    if zero3.is_engine(model):
        zero3.backward(model, loss, last, finite)
    else:
        accelerator.backward(loss)


def optimizer_step(model, optimizer, scheduler, args: Args, accelerator, finite: bool) -> tuple[float | None, bool]:
    """Clip the accumulated gradients, step the optimizer and its scheduler, clear. Returns the gradient
    norm (None when no step was taken) and whether the step was skipped for NaN or inf: a loss (`finite`
    False) or gradient that is not finite on any process leaves the weights, the optimizer's moments and
    the schedule as they were. Under fp16 the loss scaler decides on the gradients (it skips a step
    whose scaled gradients overflowed and lowers its scale, as it should: not a fault). A DeepSpeed engine
    does all of it itself (rl/zero3.py; a loss that was not finite already poisoned its gradients)."""
    if zero3.is_engine(model):
        return zero3.step(model, scheduler)
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), args.grad_clip))
    flags = torch.tensor([float(not finite), float(not math.isfinite(grad_norm))])
    reduce = reducer(accelerator)
    bad_loss, bad_gradient = ((reduce(flags) if reduce is not None else flags) > 0).tolist()  # every process alike
    if accelerator.scaler is not None and not bad_loss:
        optimizer.step()
        stepped, nonfinite = not optimizer.step_was_skipped, False
    else:
        stepped = not (bad_loss or bad_gradient)
        nonfinite = not stepped
        if stepped:
            optimizer.step()
        elif accelerator.scaler is not None:  # a NaN loss under fp16: close the scaler's step (it lowers its scale)
            accelerator.scaler.update()
    if stepped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return (grad_norm if stepped else None), nonfinite


def stop_on_nonfinite(models: Models, batch: Batch | None, args: Args, accelerator, run_dir: Path, step: int) -> None:
    """After --max-nonfinite-updates optimizer steps in a row were skipped for NaN or infinite values,
    save this step's RL batch (each process's share) and stop: something upstream of the loss is broken."""
    streak = max(models.nonfinite_streak.values(), default=0)
    if streak < args.max_nonfinite_updates:
        return
    where = run_dir / f"nonfinite_step_{step}"
    if batch is not None:
        where.mkdir(parents=True, exist_ok=True)
        tensors = {key: value.contiguous() for key, value in batch.full.items()} | {"scores": batch.scores}
        save_file(tensors, str(where / f"batch_{accelerator.process_index}.safetensors"))
    message = (f"step {step}: {streak} optimizer steps in a row had a NaN or infinite loss or gradient and were "
               "skipped; " + (f"this step's batch is in {where} (input_ids, loss_mask, sampler_logprobs, advantages, "
                              "...). Check the rewards and " if batch is not None else "check the data and ")
               + "the model's dtype, or start a new run with a lower --lr.")
    accelerator.wait_for_everyone()  # (every process's share is written before any exits)
    raise SystemExit(message if accelerator.is_main_process else 1)


def sync_engine(engine, policy, accelerator, step: int) -> dict[str, float]:
    """Copy the policy's new weights into the engine and check them (a no-op for the HF engine, which
    samples with the policy itself). Every process checks its own engine; the worst difference over
    all of them decides, so that all stop together rather than leave the others waiting."""
    from accelerate.utils import gather_object

    model = accelerator.unwrap_model(policy)
    synced = engine.load_weights(model, weights=full_weights(model), verify=False)
    if "probe_diff" not in synced:  # the HF engine: its own model, or an exact copy of the weights
        return {"sync/seconds": synced["sync_s"]} if synced else {}
    worst = max(gather_object([synced["probe_diff"]]), key=lambda d: d if d == d else float("inf"))  # NaN is worst
    try:
        engine.verify(worst)
    except SyncError as error:
        raise SystemExit(f"after step {step}: {error}") from error
    return {"sync/seconds": synced["sync_s"], "sync/probe_diff": worst, "sync/probe_diff_max": synced["probe_diff_max"]}


def step_metrics(records: list[dict], sampled: list[int], stats: dict, sums: dict, grad_norms: dict, batch: Batch,
                 advantages: torch.Tensor, returns: torch.Tensor | None, models: Models, horizon: int,
                 engine_metrics: dict) -> dict:
    """The step's metrics: trajectory statistics over every process's episodes (`records`), losses per
    action token from this process's update (none for a model that did not train this step)."""
    rewards = [r["reward"] for r in records]
    success = [r["success"] for r in records]
    turns = [r["turns"] for r in records]
    finishes = [r["finish"] for r in records]
    tokens = [r["tokens"] for r in records]
    action_tokens = [r["action_tokens"] for r in records]
    trained_tokens = max(float(batch.full["loss_mask"].sum()), 1)

    def mean(values):
        return sum(values) / max(len(values), 1)

    def per_token(key, count="tokens"):
        return sums[key] / max(sums[count], 1.0)

    calls = sorted(stats["env_call_s"])
    metrics = {
        "rollout/reward": mean(rewards),
        "rollout/success": mean(success),
        "rollout/turns": mean(turns),
        "rollout/errors": finishes.count("error"),
        "rollout/trajectories": len(records),  # tasks x --n, and under --agent reflect every retried attempt
        # how episodes ended, as shares: the env said done, the horizon cap, out of tokens (budget or context), env failure
        **{f"finish/{name}": finishes.count(finish) / len(finishes) for finish, name in FINISHES.items()},
        "rollout/invalid_action_rate": sum(r["invalid_actions"] for r in records) / max(sum(turns), 1),
        "rollout/zero_variance_groups": zero_variance_share(records),  # groups with no GRPO signal
        **category_metrics(records),
        "losses/nonfinite_updates": sums.get("nonfinite_updates", 0),  # optimizer steps skipped for NaN or inf
        "rollout/tokens": mean(tokens),
        "rollout/action_tokens": mean(action_tokens),
        "rollout/horizon": horizon,
        "rollout/advantage_mean": float(advantages.sum()) / trained_tokens,
        "rollout/advantage_abs": float(advantages.abs().sum()) / trained_tokens,
        "perf/tokens_per_s": sum(sampled) / max(stats["generate_s"], 1e-9),
        "perf/rollout_s": stats["rollout_s"],
        "perf/generate_s": stats["generate_s"],
        # the share of the rollout's wall time in which the engine waited for envs with nothing to generate
        "perf/env_wait_share": stats["idle_s"] / max(stats["rollout_s"], 1e-9),
        "perf/env_call_s": stats["env_s"] / max(stats["env_calls"], 1),  # mean seconds of a reset or step
        "perf/env_call_p95_s": calls[min(len(calls) - 1, int(0.95 * len(calls)))] if calls else 0.0,
        # the update phase (the batch, old/reference log-probs, advantages, every optimizer step) of this process
        "perf/update_s": stats["update_s"],
        "perf/update_tokens_per_s": batch.tokens / max(stats["update_s"], 1e-9),
        "perf/update_padding_share": 1 - batch.tokens / max(batch.positions, 1),  # pad positions of its micro-batches
        "perf/rollout_peak_gib": stats["rollout_peak_gib"],  # GPU allocated, else resident set (rl/memory.py)
        "perf/update_peak_gib": stats["update_peak_gib"],
        **({"perf/prefix_hit_rate": engine_metrics["prefix_hit_rate"]} if "prefix_hit_rate" in engine_metrics else {}),
        **{key: value for key, value in engine_metrics.items() if key.startswith("sync/")},
        "charts/lr": models.scheduler.get_last_lr()[0],
    }
    if "policy" in grad_norms:
        metrics |= {
            "rollout/logprob_diff": per_token("logprob_diff"),
            "rollout/logprob_diff_max": sums["logprob_diff_max"],
            "losses/policy": per_token("policy"),
            "losses/kl": per_token("kl"),
            "losses/entropy": per_token("entropy"),
            "losses/clipfrac": per_token("clipfrac"),
            "losses/ppo_kl": per_token("ppo_kl"),
            "losses/grad_norm": mean(grad_norms["policy"]),
        }
    if "critic" in grad_norms:
        metrics |= {
            "losses/value": per_token("value", "critic_tokens"),
            "losses/value_clipfrac": per_token("value_clipfrac", "critic_tokens"),
            "losses/critic_grad_norm": mean(grad_norms["critic"]),
            "critic/value": float(batch.full["old_values"].sum()) / trained_tokens,
            "critic/return": float(returns.sum()) / trained_tokens,
            "charts/critic_lr": models.critic_scheduler.get_last_lr()[0],
        }
    return metrics


def zero_variance_share(records: list[dict]) -> float:
    """The share of task groups (n episodes of one task) whose rewards are all equal: GRPO gives them no advantage."""
    groups = collections.defaultdict(list)
    for r in records:
        if r["finish"] != "error":
            groups[(r["item_id"], r["group"])].append(r["reward"])
    return sum(len(set(rewards)) == 1 for rewards in groups.values()) / max(len(groups), 1)


def category_metrics(records: list[dict]) -> dict[str, float]:
    """Reward and success per task category (category/<name>/reward, .../success)."""
    by_category = collections.defaultdict(list)
    for r in records:
        by_category[r.get("category")].append(r)
    return {f"category/{name}/{key}": sum(float(r[key]) for r in rs) / len(rs)
            for name, rs in by_category.items() if name is not None for key in ("reward", "success")}


def rollout_records(trajectories: list[Trajectory], batch: Batch, step: int) -> list[dict]:
    """The step's trajectories as log records (rl/records.py), with what the update saw of each: the trainer's
    log-probs, the advantages, and PPO's values and returns, at its action tokens."""
    records = []
    for row, traj in enumerate(trajectories):
        record = {"step": step, **traj.log_record()}
        positions = action_positions(record["action_spans"])
        for key, name in (("trainer_logprobs", "trainer_logprobs"), ("advantages", "advantages"),
                          ("old_values", "values"), ("returns", "returns")):
            if traj.error is None and positions and key in batch.full:
                record[name] = per_action(batch.full[key][row], positions)
        records.append(record)
    return records


def rl_line(step: int, metrics: dict) -> str:
    """The printed line of an RL step."""
    return (
        f"step {step:>4} | reward {metrics['rollout/reward']:.3f} | success {metrics['rollout/success']:.2f} | "
        f"turns {metrics['rollout/turns']:.1f}/{metrics['rollout/horizon']} | "
        f"tokens/s {metrics['perf/tokens_per_s']:.0f} | "
        + (f"kl {metrics['losses/kl']:.4f} | entropy {metrics['losses/entropy']:.3f} | "
           f"grad {metrics['losses/grad_norm']:.3f} | " if "losses/kl" in metrics
           else "update skipped: NaN/inf | " if metrics["losses/nonfinite_updates"] else "critic warm-up | ")
        + (f"value loss {metrics['losses/value']:.4f} | " if "losses/value" in metrics else "")
        + (f"test success {metrics['eval/success']:.3f} | " if "eval/success" in metrics else "")
        + (f"prefix hits {metrics['perf/prefix_hit_rate']:.2f} | " if "perf/prefix_hit_rate" in metrics else "")
        + f"env wait {metrics['perf/env_wait_share']:.0%} | "
        + (f"logp diff {metrics['rollout/logprob_diff']:.0e} | " if "rollout/logprob_diff" in metrics else "")
        + (f"sync {metrics['sync/seconds']:.2f}s, probe {metrics['sync/probe_diff']:.0e} | "
           if "sync/probe_diff" in metrics else f"sync {metrics['sync/seconds']:.2f}s | " if "sync/seconds" in metrics else "")
        + f"{metrics['perf/step_s']:.1f}s"
    )


# ----------------------------------------------------------------------------------------------
# SFT, DPO and AgentEvol: learning from trajectory files (rl/data.py), on RL's models and checkpoints


def read_data(paths: tuple[str, ...], env: str) -> list[dict]:
    """Every record of the trajectory files, which must all be `env`'s episodes."""
    records = []
    for path in paths:
        try:
            records += read_trajectories(path)
        except DataError as error:
            raise SystemExit(f"--data: {error}") from None
    others = sorted({r["item_id"].rpartition("_")[0] for r in records} - {env})
    if others:
        raise SystemExit(f"{', '.join(paths)} hold episodes of {', '.join(others)}, and the run's env is {env}: "
                         f"pass --env {others[0]}, or give {env}'s episodes")
    return records


def held_out(records: list[dict], share: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): a seeded `share` of the tasks, with every episode of each, held out, so that
    the validation loss is on tasks the model never learned from."""
    tasks = sorted({r["item_id"] for r in records})
    chosen = set(random.Random(f"{seed}-validation").sample(tasks, round(share * len(tasks))))
    return [r for r in records if r["item_id"] not in chosen], [r for r in records if r["item_id"] in chosen]


def encoded(fmt: ChatFormat, record: dict, max_tokens: int) -> tuple[list[int], list[int]]:
    """A record as RL's token ids and loss mask (rl/data.py: encode), cut to --max-tokens as a rollout
    would be: what does not fit is not learned."""
    ids, mask = encode(fmt, record)
    return ids[:max_tokens], mask[:max_tokens]


def examples_of(args: Args, fmt: ChatFormat, records: list[dict], max_tokens: int,
                experience: list[dict] | None = None) -> list:
    """What an optimizer step draws from: (ids, mask) conversations with a trained token (sft,
    agentevol), or (chosen, rejected) pairs of them (dpo: rl/dpo.py, within --data's tasks, or --data's
    expert episodes against --experience)."""
    if args.algo != "dpo":
        sequences = [encoded(fmt, r, max_tokens) for r in records]
        return [s for s in sequences if any(s[1])]
    pairs = expert_pairs(records, experience, args.margin) if experience is not None else make_pairs(records, args.margin)
    return [(encoded(fmt, chosen, max_tokens), encoded(fmt, rejected, max_tokens)) for chosen, rejected in pairs]


def offline_steps(args: Args, examples: int) -> int:
    """Optimizer steps of an sft or dpo run (agentevol: of each iteration): --epochs passes over the
    examples (the last incomplete batch dropped, as the RL task order), else --steps."""
    if examples < args.batch_size:
        raise SystemExit(f"{examples} training {'pairs' if args.algo == 'dpo' else 'conversations'} are fewer than "
                         f"--batch-size {args.batch_size}: lower it, or give more --data"
                         + (" (or a lower --margin)" if args.algo == "dpo" else ""))
    return args.epochs * (examples // args.batch_size) if args.epochs is not None else args.steps


def micro_batches(args: Args, examples: list, pad_id: int) -> list[dict]:
    """This process's examples as micro-batches: sft's conversations packed into rows as long as the
    longest of them (rl/sft.py: no attention across conversations; longer rows would only add attention
    across the mask), --micro-batch-size rows each; dpo's pairs, --micro-batch-size pairs each, chosen
    rows first, then their rejected ones."""
    size = args.micro_batch_size
    if args.algo == "dpo":
        return [pad([c for c, _ in examples[i:i + size]] + [r for _, r in examples[i:i + size]], pad_id)
                for i in range(0, len(examples), size)]
    packed = pack(examples, max(len(ids) for ids, _ in examples), pad_id)
    rows = len(packed.pop("rows"))
    return [{key: value[i:i + size] for key, value in packed.items()} for i in range(0, rows, size)]


def offline_terms(models: Models, micro: dict, args: Args, accelerator) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's summed loss (sft: NLL of its action tokens; dpo: rl/dpo.py's loss of its pairs)
    and its summed statistics."""
    inputs = (micro["input_ids"], micro.get("attention_mask"), micro["loss_mask"])
    with accelerator.autocast():
        logprobs, _ = token_logprobs(models.policy, *inputs, position_ids=micro.get("position_ids"))
    if args.algo != "dpo":
        nll = -(logprobs * micro["loss_mask"]).sum()
        return nll, {"nll": float(nll.detach()), "tokens": float(micro["loss_mask"].sum())}
    with torch.no_grad(), accelerator.autocast(), reference(models, accelerator, args.offload_reference) as reference_model:
        ref, _ = token_logprobs(reference_model, *inputs)
    summed, ref_summed = (logprobs * micro["loss_mask"]).sum(1), (ref.float() * micro["loss_mask"]).sum(1)
    half = summed.shape[0] // 2
    loss, chosen, rejected = dpo_loss(summed[:half], summed[half:], ref_summed[:half], ref_summed[half:], args.beta)
    return loss.sum(), {"loss": float(loss.detach().sum()), "pairs": float(half), "correct": float((chosen > rejected).sum()),
                        "margin": float((chosen - rejected).sum()), "chosen": float(chosen.sum()),
                        "rejected": float(rejected.sum())}


def offline_pass(models: Models, examples: list, args: Args, accelerator, pad_id: int, train: bool) -> dict[str, float]:
    """Forward (and when `train`, backward) over this process's share of a batch of examples, the loss
    divided by the batch's size over all processes (its action tokens for sft, its pairs for dpo), so
    that the accumulated gradient is the batch's mean however it is split. Every process runs as many
    micro-batches, the most any needs (blank ones, which weigh nothing, after its own): the passes of a
    sharded model and the gradient all-reduce are collective. Returns the statistics summed over every
    process."""
    share = examples[accelerator.process_index::accelerator.num_processes]
    micros = micro_batches(args, share, pad_id) if share else []
    local = sum(float(m["loss_mask"].sum()) if args.algo != "dpo" else m["input_ids"].shape[0] / 2 for m in micros)
    reduce, most = reducer(accelerator), reducer(accelerator, "max")
    local = torch.tensor([local], dtype=torch.float64)  # (a process with no share has the int 0: same dtype everywhere)
    size = float((reduce(local) if reduce is not None else local)[0]) / accelerator.num_processes
    count = int(most(torch.tensor([len(micros)]))) if most is not None else len(micros)
    blank = pad([([pad_id], [0])] * (2 if args.algo == "dpo" else 1), pad_id)  # (dpo: a chosen and a rejected row)
    sums: dict[str, float] = {}
    finite = True
    for k in range(count):
        micro = {key: value.to(accelerator.device) for key, value in (micros[k] if k < len(micros) else blank).items()}
        with gradient_sync(accelerator, [models.policy], now=k == count - 1) if train else torch.no_grad():
            loss, terms = offline_terms(models, micro, args, accelerator)
            if k >= len(micros):
                loss, terms = loss * 0.0, {}
            finite &= math.isfinite(terms.get("nll", terms.get("loss", 0.0)))
            if train:
                backward(models.policy, loss / max(size, 1e-9), accelerator, k == count - 1, finite)
        for key, value in terms.items():
            sums[key] = sums.get(key, 0.0) + value
    keys = sorted(sums) or (["nll", "tokens"] if args.algo != "dpo" else ["loss", "pairs", "correct", "margin", "chosen", "rejected"])
    totals = torch.tensor([sums.get(key, 0.0) for key in keys], dtype=torch.float64)
    return dict(zip(keys, (reduce(totals) if reduce is not None else totals).tolist()))


def offline_metrics(sums: dict[str, float], algo: str, prefix: str = "") -> dict[str, float]:
    """sft: the mean NLL per action token; dpo: the mean loss, accuracy (the chosen episode's implicit
    reward above the rejected one's), margin and implicit rewards per pair."""
    kind = "sft" if algo != "dpo" else "dpo"
    if kind == "sft":
        return {f"sft/{prefix}loss": sums["nll"] / max(sums["tokens"], 1.0), f"sft/{prefix}tokens": sums["tokens"]}
    pairs = max(sums["pairs"], 1.0)
    return {f"dpo/{prefix}{name}": sums[key] / pairs for name, key in
            (("loss", "loss"), ("accuracy", "correct"), ("margin", "margin"), ("chosen_reward", "chosen"),
             ("rejected_reward", "rejected"))}


def offline_step(models: Models, examples: list, step: int, args: Args, accelerator, pad_id: int) -> dict[str, float]:
    """One optimizer step on the step's batch (shuffled epochs over the examples, as RL's task order:
    a pure function of the step), and its metrics."""
    batch = [examples[i] for i in tasks_for(step, list(range(len(examples))), args.batch_size, args.seed)]
    models.policy.train()
    sums = offline_pass(models, batch, args, accelerator, pad_id, train=True)
    finite = math.isfinite(sums.get("nll", sums.get("loss", 0.0)))
    grad_norm, nonfinite = optimizer_step(models.policy, models.optimizer, models.scheduler, args, accelerator, finite)
    count_nonfinite(models, sums, "policy", step, nonfinite, accelerator)
    metrics = offline_metrics(sums, args.algo) | {"charts/lr": models.scheduler.get_last_lr()[0],
                                                  "losses/nonfinite_updates": sums.get("nonfinite_updates", 0)}
    return metrics | ({"losses/grad_norm": grad_norm} if grad_norm is not None else {})


@torch.no_grad()
def validate(models: Models, examples: list, args: Args, accelerator, pad_id: int) -> dict:
    """The loss (dpo: and accuracy) on the held-out examples; {} when there are none."""
    if not examples:
        return {}
    models.policy.eval()
    return offline_metrics(offline_pass(models, examples, args, accelerator, pad_id, train=False),
                           args.algo, prefix="val_")


def play_share(engine, fmt: ChatFormat, environments: list, task_ids: list[int], n: int, models: Models, args: Args,
               accelerator, max_tokens: int, step: int, horizon: int, progress=None) -> list[Trajectory]:
    """`n` episodes of every task with the policy's current weights (those of `step`), at most `horizon`
    turns each, each process playing its share of the tasks; every process gets all of them, in the same
    order."""
    from accelerate.utils import gather_object

    sync_engine(engine, models.policy, accelerator, step)
    mine = [t for t in task_ids[accelerator.process_index::accelerator.num_processes] for _ in range(n)]
    played = play(engine, fmt, environments, mine, [i // n for i in range(len(mine))], horizon=horizon,
                  max_new_tokens=args.max_new_tokens, max_tokens=max_tokens, agent=make_agent(args.agent, args.attempts),
                  progress=progress) if mine else []
    engine.sleep()
    return gather_object(played)


def evaluate(engine, fmt: ChatFormat, environments: list, test_ids: list[int], models: Models, args: Args,
             accelerator, max_tokens: int, step: int, bar=None) -> tuple[dict, list[dict]]:
    """The policy on the test tasks, --eval-k episodes each at the run's temperature, scored as eval.py scores
    (rl/scores.py). Every evaluation of a run plays under one turn cap, its horizon schedule's last stage (the
    one it is headed for), so that evaluations compare across steps, the first (step 0, before any update)
    included. Returns eval/ metrics, per category too, and every episode's log record."""
    horizon = args.horizon[-1]
    mine = len(test_ids[accelerator.process_index::accelerator.num_processes]) * args.eval_k
    with own_stream(engine, stream_seed(args.seed + accelerator.process_index, step, "eval")):  # (not the rollouts')
        episodes = play_share(engine, fmt, environments, test_ids, args.eval_k, models, args, accelerator, max_tokens,
                              step, horizon, phase(bar, "eval", mine))
    results = score(episodes, args.env)
    metrics = {f"eval/{key}": results[key] for key in ("avg@k", "pass@k", "success", "turns", "errors")}
    metrics |= {f"eval/{name}/avg@k": c["avg@k"] for name, c in results["categories"].items()}
    metrics |= {f"eval/finish/{name}": share for name, share in results["finish"].items()}  # (how its episodes ended)
    metrics |= {"eval/horizon": horizon, "eval/max_tokens": max_tokens}
    return metrics, [{"step": step, **t.log_record()} for t in episodes]


def phase(bar, name: str, total: int):
    """A progress callback for a phase of a step, shown after the step bar (`bar`; None: nothing shown) as
    "<name> done/total", with the turns played so far in a rollout (rollout.py calls it with both counts)."""
    done = turns = 0

    def advance(count: int = 1, played: int = 0) -> None:
        nonlocal done, turns
        done, turns = done + count, turns + played
        if bar is not None:
            bar.set_postfix_str(f"{name} {done}/{total}" + (f", {turns} turns" if turns else ""))

    return advance


def eval_due(step: int, every: int, last: int) -> bool:
    """--eval-every's steps: every k-th, and the last."""
    return every > 0 and (step % every == 0 or step == last)


def evaluation_plan(args: Args, tasks: int, start: int, initial: bool) -> str:
    """What the run's evaluations will play, for its start line, e.g. "evaluating 16 test tasks x 2 at steps 0 and
    16": the `initial` policy (step 0, RL only) and --eval-every's steps from `start` on."""
    steps = [0] * initial + [s for s in range(start, args.steps + 1) if eval_due(s, args.eval_every, args.steps)]
    if not tasks or not steps:
        return "no evaluation (--eval-every 0)" if not args.eval_every else "no evaluation left"
    head = steps[:-1] if len(steps) <= 4 else steps[:3] + ["..."]
    at = f"s {', '.join(map(str, head))} and {steps[-1]}" if len(steps) > 1 else f" {steps[0]}"
    return f"evaluating {tasks} test tasks x {args.eval_k} at step{at}"


def test_task_ids(args: Args) -> list[int]:
    """The tasks an evaluation plays: --eval-tasks of --test-tasks (the test split), spread over it (0: all)."""
    test_ids = envs.load_task_ids(args.test_tasks, args.env) if args.test_tasks else envs.splits(args.env)["test"]
    return spread(test_ids, args.eval_tasks) if args.eval_tasks else test_ids


def restart(models: Models, args: Args, accelerator, initial: tuple[dict, dict]) -> None:
    """Back to --model's weights with the optimizer and schedule as they started (agentevol's retraining
    from the base), in place: the engine and Accelerate keep the same modules."""
    policy = accelerator.unwrap_model(models.policy)
    if args.lora_rank:  # fresh adapters: the base model again
        for layer in policy.modules():
            if hasattr(layer, "reset_lora_parameters"):
                for adapter in layer.active_adapters:
                    layer.reset_lora_parameters(adapter, init_lora_weights=True)
    else:
        policy.load_state_dict(load_model(args.model).state_dict())
    models.optimizer.load_state_dict(copy.deepcopy(initial[0]))
    models.scheduler.load_state_dict(copy.deepcopy(initial[1]))


def learn(args: Args, accelerator, mixed: str) -> Path:
    """--algo sft or dpo: optimizer steps over --data's examples, the validation loss at --eval-every
    steps and at the end, and with --eval-every the policy played on the test split then too."""
    resuming = args.resume not in (None, "auto")
    run_dir = run_directory(args, resuming, accelerator)
    train, validation = held_out(read_data(args.data, args.env), args.validation, args.seed)
    experience = read_data(args.experience, args.env) if args.experience else None
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    models = build_models(args, accelerator, policy_from=args.resume if resuming else args.model)
    max_tokens = context_limit(args, accelerator.unwrap_model(models.policy), say=accelerator.is_main_process)

    # -- the examples: conversations (sft) or pairs (dpo), a share of the tasks held out for validation
    examples = examples_of(args, fmt, train, max_tokens, experience)
    held = examples_of(args, fmt, validation, max_tokens, experience)
    args = replace(args, steps=offline_steps(args, len(examples)))

    # -- the test tasks, envs and an engine, when the policy is played during training
    test_ids = test_task_ids(args) if args.eval_every else []
    environments = make_envs(args.env, min(args.gen_batch_size, -(-len(test_ids) // accelerator.num_processes)),
                             envs.parse_options(args.env_options), args.env_timeout, args.env_url) if test_ids else []
    engine = build_engine(args, fmt, models, accelerator, max_tokens) if test_ids else None
    trainer_state = resume(accelerator, models, engine, Path(args.resume)) if resuming else {"step": 0, "logs": {}}
    config = run_config(args, run_dir, resuming, accelerator, mixed, engine, environments[0] if environments else None)
    if accelerator.is_main_process:
        print(f"run {run_dir.name}: {args.algo} on {args.model} ({args.preset} preset), {len(examples)} "
              f"{'pairs' if args.algo == 'dpo' else 'conversations'} of {len(train)} episodes ({len(held)} held out), "
              f"{args.steps} steps of {args.batch_size}, "
              f"{evaluation_plan(args, len(test_ids), trainer_state['step'] + 1, initial=False)} -> {run_dir}"
              + (f", resumed at step {trainer_state['step'] + 1}" if resuming else ""))
    logs = Logs(args, run_dir, config, active=accelerator.is_main_process, resume_sizes=trainer_state["logs"])

    progress = tqdm(range(trainer_state["step"] + 1, args.steps + 1), disable=not accelerator.is_main_process,
                    desc=args.algo, dynamic_ncols=True, initial=trainer_state["step"], total=args.steps)
    try:
        for step in progress:
            step_start = time.perf_counter()
            metrics = offline_step(models, examples, step, args, accelerator, fmt.pad_id)
            stop_on_nonfinite(models, None, args, accelerator, run_dir, step)
            evaluated = []
            if step == args.steps or eval_due(step, args.eval_every, args.steps):
                metrics |= validate(models, held, args, accelerator, fmt.pad_id)
            if test_ids and eval_due(step, args.eval_every, args.steps):
                evaluation, evaluated = evaluate(engine, fmt, environments, test_ids, models, args, accelerator,
                                                 max_tokens, step, progress)
                metrics |= evaluation
            metrics |= {"perf/step_s": time.perf_counter() - step_start, "charts/step": step}
            logs.write(step, metrics, offline_line(step, metrics), evaluations=evaluated)
            if step == args.steps or (args.save_every and step % args.save_every == 0):
                save_checkpoint(accelerator, models, engine, tokenizer, run_dir / "checkpoints" / f"step_{step}", step,
                                logs, args.keep_checkpoints)
    finally:
        if engine is not None:
            engine.close()
        close_envs(environments)
        logs.close()
    return finish(run_dir, accelerator)


def evolve(args: Args, accelerator, mixed: str) -> Path:
    """--algo agentevol, AgentGym's self-evolution. Iteration 0 learns --data alone (behaviour cloning);
    each later one explores --explore-tasks of the train split (--n episodes each) with the current
    policy, keeps the episodes that reached --threshold, retrains on --data plus those (from --model, or
    going on with --retrain-from continue), and plays the test split. One metrics line per iteration;
    its model is checkpoints/step_<iteration>, its explored episodes are in rollouts.jsonl."""
    run_dir = run_directory(args, False, accelerator)
    expert, validation = held_out(read_data(args.data, args.env), args.validation, args.seed)
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    models = build_models(args, accelerator, policy_from=args.model)
    initial = copy.deepcopy(models.optimizer.state_dict()), copy.deepcopy(models.scheduler.state_dict())
    max_tokens = context_limit(args, accelerator.unwrap_model(models.policy), say=accelerator.is_main_process)
    held = examples_of(args, fmt, validation, max_tokens)

    # -- the tasks explored and tested, envs to play them on, the engine
    train_ids = envs.load_task_ids(args.train_tasks, args.env) if args.train_tasks else envs.splits(args.env)["train"]
    explore_ids = spread(train_ids, args.explore_tasks) if args.explore_tasks else train_ids
    test_ids = test_task_ids(args)
    share = -(-max(len(explore_ids) * args.n, len(test_ids)) // accelerator.num_processes)
    count = min(args.gen_batch_size, share)
    environments = make_envs(args.env, count, envs.parse_options(args.env_options), args.env_timeout, args.env_url)
    engine = build_engine(args, fmt, models, accelerator, max_tokens)
    config = run_config(args, run_dir, False, accelerator, mixed, engine, environments[0])
    if accelerator.is_main_process:
        print(f"run {run_dir.name}: agentevol on {args.model} ({args.preset} preset), {args.iterations} iterations "
              f"exploring {len(explore_ids)} tasks x {args.n}, {len(expert)} expert episodes ({len(validation)} held "
              f"out), testing on {len(test_ids)} tasks x {args.eval_k} after every iteration -> {run_dir}")
    logs = Logs(args, run_dir, config, active=accelerator.is_main_process, resume_sizes={})
    try:
        for iteration in range(args.iterations + 1):
            start = time.perf_counter()
            explored, kept = [], []
            if iteration > 0:  # explore with the last iteration's policy, keep the successes
                explored = play_share(engine, fmt, environments, explore_ids, args.n, models, args, accelerator,
                                      max_tokens, iteration, horizon=args.horizon[-1])
                kept = [to_record(t) for t in explored if t.error is None
                        and (t.reward >= args.threshold if args.threshold is not None else t.success)]
                if args.retrain_from == "base":
                    restart(models, args, accelerator, initial)
            examples = examples_of(args, fmt, expert + kept, max_tokens)
            steps = offline_steps(args, len(examples))
            for step in tqdm(range(1, steps + 1), desc=f"iteration {iteration}", leave=False, dynamic_ncols=True,
                             disable=not accelerator.is_main_process):
                metrics = offline_step(models, examples, step, args, accelerator, fmt.pad_id)
                stop_on_nonfinite(models, None, args, accelerator, run_dir, step)
            metrics |= validate(models, held, args, accelerator, fmt.pad_id)
            evaluation, evaluated = evaluate(engine, fmt, environments, test_ids, models, args, accelerator,
                                             max_tokens, iteration)
            metrics |= evaluation | {
                "evol/iteration": iteration, "evol/buffer": len(kept), "evol/explored": len(explored),
                "evol/explore_success": sum(t.success for t in explored) / max(len(explored), 1),
                "evol/conversations": len(examples), "sft/steps": steps,
                "perf/step_s": time.perf_counter() - start, "charts/step": iteration}
            logs.write(iteration, metrics, evol_line(iteration, metrics), evaluations=evaluated,
                       rollouts=[{"step": iteration, **t.log_record()} for t in explored])
            save_checkpoint(accelerator, models, engine, tokenizer, run_dir / "checkpoints" / f"step_{iteration}",
                            iteration, logs, args.keep_checkpoints)
    finally:
        engine.close()
        close_envs(environments)
        logs.close()
    return finish(run_dir, accelerator)


def offline_line(step: int, metrics: dict) -> str:
    """The printed line of an sft or dpo step."""
    kind = "dpo" if "dpo/loss" in metrics else "sft"
    return (f"step {step:>4} | {kind} loss {metrics[f'{kind}/loss']:.4f} | "
            + (f"accuracy {metrics['dpo/accuracy']:.2f} | margin {metrics['dpo/margin']:.3f} | " if kind == "dpo" else "")
            + (f"val loss {metrics[f'{kind}/val_loss']:.4f} | " if f"{kind}/val_loss" in metrics else "")
            + (f"test success {metrics['eval/success']:.3f} | " if "eval/success" in metrics else "")
            + (f"grad {metrics['losses/grad_norm']:.3f} | " if "losses/grad_norm" in metrics else "update skipped: NaN/inf | ")
            + f"{metrics['perf/step_s']:.1f}s")


def evol_line(iteration: int, metrics: dict) -> str:
    """The printed line of an agentevol iteration."""
    return (f"iteration {iteration} | explored {metrics['evol/explored']}, kept {metrics['evol/buffer']} "
            f"(success {metrics['evol/explore_success']:.3f}) | {metrics['evol/conversations']} conversations, "
            f"{metrics['sft/steps']} steps, loss {metrics['sft/loss']:.4f}"
            + (f", val loss {metrics['sft/val_loss']:.4f}" if "sft/val_loss" in metrics else "")
            + f" | test success {metrics['eval/success']:.3f}, avg@1 {metrics['eval/avg@k']:.3f} | "
            f"{metrics['perf/step_s']:.0f}s")


def eval_line(step: int, metrics: dict) -> str:
    """The printed line of an evaluation outside a training step."""
    return (f"eval {step:>4} | test success {metrics['eval/success']:.3f} | avg@k {metrics['eval/avg@k']:.3f} | "
            f"pass@k {metrics['eval/pass@k']:.3f} | turns {metrics['eval/turns']:.1f}/{metrics['eval/horizon']} | "
            + endings({name: metrics[f"eval/finish/{name}"] for name in FINISHES.values()}, metrics["eval/max_tokens"]))


def held_out_line(run_dir: Path) -> str | None:
    """The run's first evaluation (step 0: the initial policy) against its last, on the same test tasks:
    success before and after, the gain and its 95% confidence interval (rl/scores.py's `gain`); None
    unless the run evaluated at step 0 and later."""
    path = run_dir / "evaluations.jsonl"
    steps: dict[int, list] = collections.defaultdict(list)
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record.get("final", True):  # (--agent reflect: an episode is its last attempt)
            steps[record["step"]].append(types.SimpleNamespace(task_id=record["item_id"], success=record["success"]))
    last = max(steps, default=0)
    if 0 not in steps or last == 0:
        return None
    result = gain(steps[0], steps[last])
    episodes = len(steps[last]) / result["tasks"]
    interval = (f"95% CI {result['low']:+.3f} to {result['high']:+.3f}" if result["low"] is not None
                else "no interval from one task")
    return (f"held-out success {result['before']:.3f} -> {result['after']:.3f} ({result['gain']:+.3f}, {interval}; "
            f"{result['tasks']} test tasks x {episodes:g} episodes, step 0 vs step {last})")


def finish(run_dir: Path, accelerator) -> Path:
    if accelerator.is_main_process:
        line = held_out_line(run_dir)
        if line is not None:
            print(line)
        curves = plots.draw(run_dir)
        print(f"done: {run_dir}" + (f" (curves: {curves})" if curves else ""))
    accelerator.end_training()
    return run_dir


# ----------------------------------------------------------------------------------------------
# Set-up: models, logs, checkpoints


def linear_warmup(optimizer, steps: int):
    """Learning rate rising linearly over the first `steps` optimizer steps, then constant (upstream's
    `constant` warm-up style)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(steps, 1)))


def sharded(accelerator) -> bool:
    """Whether the models are split over processes (FSDP2, DeepSpeed ZeRO-3): no process holds a whole one."""
    return accelerator.distributed_type in ("FSDP", "DEEPSPEED")


def build_models(args: Args, accelerator, policy_from: str) -> Models:
    """The policy (from `policy_from`: the model, or the checkpoint when resuming), the frozen reference,
    PPO's critic (same architecture, own weights, a value head; its weights from the checkpoint when resuming),
    their optimizers."""
    critic_from = Path(policy_from) / "state" / "critic.safetensors"
    critic_from = critic_from if critic_from.is_file() else None
    policy = load_model(policy_from, trainable=True)  # (a LoRA run's checkpoint: its base, the adapter on it)
    if args.lora_rank and not is_adapter(policy_from):
        policy = add_lora(policy, args.lora_rank, args.lora_alpha, args.lora_target_modules)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
        if args.lora_rank:
            policy.enable_input_require_grads()  # (the frozen embeddings would cut the recomputed graph)
    wanted = args.algo == "dpo" or (args.kl_coef > 0 and args.algo not in OFFLINE)
    ref = None
    if wanted and not args.lora_rank:
        # loaded and run exactly as the policy (fp32 under autocast): at step 0 the KL is 0 (DPO's margins too),
        # and sharded as the policy is
        ref = load_model(args.model)
        ref.requires_grad_(False).eval()
        ref = shard(accelerator, ref) if sharded(accelerator) else ref.to("cpu" if args.offload_reference else accelerator.device)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, linear_warmup(optimizer, args.warmup_steps))
    models = Models(policy, optimizer, scheduler, ref, adapter_reference=wanted and bool(args.lora_rank))
    if args.algo == "ppo":
        critic = load_value_model(args.model)
        if critic_from is not None:  # resuming: its weights before Accelerate shards it
            (zero3.load_weights if zero3.active(accelerator) else load_safetensors_model)(critic, str(critic_from))
        critic.config.use_cache = False
        if args.gradient_checkpointing:
            critic.gradient_checkpointing_enable()
        fsdp = accelerator.distributed_type == "FSDP"
        if fsdp:  # sharded first, so that its optimizer holds the shards
            critic = shard(accelerator, critic)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay)
        critic_scheduler = linear_warmup(critic_optimizer, args.critic_lr_warmup_steps)
        if fsdp:
            models.critic = critic
            models.critic_optimizer = accelerator.prepare_optimizer(critic_optimizer)
            models.critic_scheduler = accelerator.prepare_scheduler(critic_scheduler)
        else:
            prepare = functools.partial(zero3.prepare, accelerator) if zero3.active(accelerator) else accelerator.prepare
            models.critic, models.critic_optimizer, models.critic_scheduler = prepare(critic, critic_optimizer,
                                                                                      critic_scheduler)
    return models


def shard(accelerator, model):
    """A model beside the policy sharded as the policy is: Accelerate's FSDP2 prepares one model (with its optimizer)
    per prepare(), so the reference and the critic go through its fsdp2_prepare_model, with the same settings; under
    DeepSpeed the frozen reference is an engine of its own (ZeRO-3 partitions it, with no optimizer)."""
    if zero3.active(accelerator):
        return zero3.prepare(accelerator, model)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    return fsdp2_prepare_model(accelerator, model)


def context_limit(args: Args, policy, say: bool = True) -> int:
    """Tokens a trajectory may hold: --max-tokens, or the model's context window if that is shorter. A
    trajectory that would outgrow it ends as truncated (finish "max_tokens", see rollout.py)."""
    window = getattr(policy.config, "max_position_embeddings", None) or args.max_tokens
    if window < args.max_tokens and say:
        print(f"--max-tokens {args.max_tokens} is more than {args.model}'s context window: trajectories end at {window} tokens")
    return min(args.max_tokens, window)


def build_engine(args: Args, fmt: ChatFormat, models: Models, accelerator, max_tokens: int):
    """This process's rollout engine (`--engine`): vLLM loads the model itself (its weights are synced
    from the policy before the first rollout); HF samples with the policy, or with a copy when it is sharded."""
    own = sharded(accelerator)  # (the HF engine then samples from a whole copy of its own)
    with zero3.unpartitioned(accelerator):
        return make_engine(args.engine, args.model, fmt, None if own else accelerator.unwrap_model(models.policy),
                           device=accelerator.device,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed + accelerator.process_index,
                           batch_size=args.gen_batch_size, max_model_len=args.vllm_max_model_len or max_tokens,
                           gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                           tensor_parallel_size=args.vllm_tensor_parallel_size, sleep=args.vllm_sleep,
                           tolerance=args.sync_tolerance, deterministic=args.deterministic)


def run_directory(args: Args, resuming: bool, accelerator) -> Path:
    """Where the run writes, the same on every process. A resumed run goes on in its own directory (from a
    checkpoint older than its newest, the newer ones and a copy of the logs are moved aside first); a new
    one refuses a directory that holds another run (its logs would mix), unless --resume auto restarts it."""
    from accelerate.utils import broadcast_object_list

    if resuming:
        run_dir = Path(args.resume).parent.parent
        if accelerator.is_main_process and (aside := checkpoint_lib.supersede(run_dir, Path(args.resume), Logs.FILES)):
            print(f"{args.resume} is older than the run's newest checkpoint: the newer ones, and a copy of the logs "
                  f"before they are cut back to this checkpoint, are now in {aside}")
        accelerator.wait_for_everyone()
        return run_dir
    name = [args.run_name or f"{args.env}-{args.algo}-{time.strftime('%Y%m%d-%H%M%S')}"]
    run_dir = Path(args.out_dir) / broadcast_object_list(name)[0]  # one timestamp for every process
    if (run_dir / "config.json").exists():
        if args.resume != "auto":
            raise SystemExit(f"{run_dir} already holds a run: continue it with --resume auto --run-name {run_dir.name}, "
                             "or choose another --run-name")
        if accelerator.is_main_process:
            print(f"--resume auto: {run_dir} has no complete checkpoint yet; the run starts over")
    return run_dir


def run_config(args: Args, run_dir: Path, resuming: bool, accelerator, mixed: str, engine, env) -> dict:
    """The run's config.json: every setting, and what it ran on. Written once, when the run starts; a
    resumed run keeps it (it runs with those settings), and its wandb run."""
    config = {**asdict(args), "run_name": run_dir.name, "mixed_precision": mixed, "processes": accelerator.num_processes,
              "engine_used": engine.name if engine is not None else None,
              "env_settings": env.options if env is not None else {},  # every setting in effect, defaults too
              "wandb_id": os.urandom(6).hex()}  # (not the seeded random: a new run must not reuse an old id)
    if resuming:
        return config | {"wandb_id": json.loads((run_dir / "config.json").read_text()).get("wandb_id")}
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_lib.write_atomic(run_dir / "config.json", json.dumps(config, indent=2) + "\n")
    return config


class Logs:
    """The run's record on the main process: rollouts.jsonl (every trajectory trained on or explored),
    evaluations.jsonl (every test episode of --eval-every), metrics.jsonl, wandb with --track, and a line
    of the main metrics per step. Silent on the other processes.

    Each step's lines are appended and fsynced; a checkpoint records how long the logs were when it was
    taken (`sizes`), and a resumed run cuts them back to that (`resume_sizes`; {} for a new run), so
    that a step redone after a crash appears once, and a line torn by the crash not at all."""

    FILES = ("rollouts.jsonl", "evaluations.jsonl", "metrics.jsonl")

    def __init__(self, args: Args, run_dir: Path, config: dict, active: bool, resume_sizes: dict[str, int]):
        self.active, self.tracker = active, None
        if not active:
            return
        self.files = {}
        for name in self.FILES:
            path = run_dir / name
            size = resume_sizes.get(name, 0)
            if size > (path.stat().st_size if path.exists() else 0):
                raise SystemExit(f"{path} is shorter than its checkpoint says ({size} bytes): the run's logs were "
                                 "changed or lost since; resume from a copy of the run directory that has them")
            with open(path, "a") as f:
                f.truncate(size)
            self.files[name] = open(path, "a")
        if args.track:
            import wandb

            if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
                os.environ["WANDB_MODE"] = "offline"
                print(f"wandb: no API key configured, logging offline to {run_dir}/wandb (wandb sync to upload)")
            # one wandb run for the whole run, however often it resumes (wandb ignores re-logged steps)
            self.tracker = wandb.init(project=args.wandb_project, name=config["run_name"], config=config,
                                      dir=str(run_dir), id=config["wandb_id"], resume="allow")

    def sizes(self) -> dict[str, int]:
        return {name: file.tell() for name, file in self.files.items()} if self.active else {}

    def write(self, step: int, metrics: dict, line: str, rollouts: list[dict] = (), evaluations: list[dict] = ()) -> None:
        """A step's episodes and metrics, appended and fsynced, the metrics to wandb, and `line` printed."""
        if not self.active:
            return
        for name, records in (("rollouts.jsonl", rollouts), ("evaluations.jsonl", evaluations)):
            if records:
                self._append(self.files[name], "".join(json.dumps(record) + "\n" for record in records))
        self._append(self.files["metrics.jsonl"], json.dumps(metrics) + "\n")
        if self.tracker is not None:
            import wandb

            samples = {"samples/trajectories": wandb.Table(*sample_table(rollouts))} if rollouts else {}
            self.tracker.log(metrics | samples, step=step)
        tqdm.write(line)

    @staticmethod
    def _append(file, text: str) -> None:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())

    def close(self) -> None:
        if not self.active:
            return
        for file in self.files.values():
            file.close()
        if self.tracker is not None:
            self.tracker.finish()


def sample_table(records: list[dict], count: int = 4) -> tuple[list[str], list[list]]:
    """(columns, rows) of a few of a step's trajectories for a wandb table: the best and the worst by reward,
    each with its conversation as text."""
    ranked = sorted(records, key=lambda r: r["reward"])
    picked = ranked[-(count - count // 2):][::-1] + ranked[:count // 2] if len(ranked) > count else ranked[::-1]
    columns = ["step", "item_id", "category", "reward", "success", "turns", "finish", "conversation"]
    rows = [[r.get("step"), r["item_id"], r.get("category"), r["reward"], r["success"], r["turns"], r["finish"],
             "\n\n".join(f"[{m['role']}] {m['content']}" for m in r["messages"])] for r in picked]
    return columns, rows


def save_checkpoint(accelerator, models: Models, engine, tokenizer, path: Path, step: int, logs: Logs,
                    keep: int) -> None:
    """A Hugging Face model directory (safetensors; eval.py and vLLM load it) with the full training state
    for --resume (rl/checkpoint.py: critic, optimizers, schedulers, every process's random state and
    sampler; how far the logs got), written beside its final name and renamed into place, so that a crash
    never leaves half a checkpoint. Then all but the `keep` newest are deleted (0: none)."""
    tmp, main_process = path.with_name(path.name + ".tmp"), accelerator.is_main_process
    if main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "state").mkdir(parents=True)
    accelerator.wait_for_everyone()
    policy = accelerator.unwrap_model(models.policy)
    weights = accelerator.get_state_dict(models.policy) or {}  # (gathered whole on the main process when sharded)
    if getattr(policy.config, "tie_word_embeddings", False):
        for name in getattr(policy, "_tied_weights_keys", None) or ():  # a gathered copy of a tied weight: saved once
            weights.pop(name, None)
    policy.save_pretrained(tmp, is_main_process=main_process, save_function=accelerator.save, state_dict=weights,
                           safe_serialization=True)
    # data parallel: every process holds the same optimizer states, saved once; sharded: each its own shard (under
    # ZeRO-3 the torch optimizer inside DeepSpeed's, with the fp32 weights it updates: rl/zero3.py)
    shard = f"_{accelerator.process_index}" if sharded(accelerator) else ""
    save_optimizer = zero3.save_optimizer if zero3.active(accelerator) else checkpoint_lib.save_optimizer
    for name, optimizer in (("optimizer", models.optimizer), ("critic_optimizer", models.critic_optimizer)):
        if optimizer is not None and (main_process or shard):
            save_optimizer(optimizer, tmp / "state" / f"{name}{shard}.safetensors")
    if models.critic is not None:
        critic = accelerator.get_state_dict(models.critic) or {}  # (gathered to the main process when sharded)
        if main_process:
            save_file({key: value.contiguous() for key, value in critic.items()}, str(tmp / "state" / "critic.safetensors"))
    if main_process:
        schedulers = {"policy": models.scheduler.state_dict(),
                      "critic": models.critic_scheduler.state_dict() if models.critic_scheduler else None,
                      "scaler": accelerator.scaler.state_dict() if accelerator.scaler else None}
        (tmp / "state" / "schedulers.json").write_text(json.dumps(schedulers) + "\n")
    checkpoint_lib.save_rng(tmp / "state" / f"rng_{accelerator.process_index}.safetensors")
    if engine is not None:  # (sft and dpo without --eval-every sample nothing)
        save_file(engine.state_dict(), str(tmp / "state" / f"sampler_{accelerator.process_index}.safetensors"))
    accelerator.wait_for_everyone()
    if main_process:
        (tmp / "README.md").unlink(missing_ok=True)  # PEFT's model card for an adapter: not part of the state
        tokenizer.save_pretrained(tmp)
        state = {"step": step, "logs": logs.sizes(), "nonfinite_streak": models.nonfinite_streak,
                 "processes": accelerator.num_processes, "distributed": accelerator.distributed_type.value}
        (tmp / checkpoint_lib.STATE).write_text(json.dumps(state) + "\n")
        checkpoint_lib.publish(tmp, path)
        checkpoint_lib.prune(path.parent.parent, keep)
    accelerator.wait_for_everyone()


def resume(accelerator, models: Models, engine, checkpoint: Path) -> dict:
    """Restore the training state, this process's random state and its sampler from a checkpoint (the
    policy's and critic's weights were loaded from it by build_models); returns its trainer_state.json."""
    state = checkpoint / "state"
    shard = f"_{accelerator.process_index}" if sharded(accelerator) else ""
    trainer_state = json.loads((checkpoint / checkpoint_lib.STATE).read_text())
    saved_by = trainer_state.get("processes", accelerator.num_processes)
    saved_under = trainer_state.get("distributed", accelerator.distributed_type.value)
    if shard and (saved_by != accelerator.num_processes or saved_under != accelerator.distributed_type.value
                  or not (state / f"optimizer{shard}.safetensors").is_file()):
        raise SystemExit(f"--resume {checkpoint}: its optimizer states are the shards of {saved_by} processes under "
                         f"{saved_under}, and this launch has {accelerator.num_processes} under "
                         f"{accelerator.distributed_type.value}; a sharded run resumes with the same number of processes "
                         "and the same launch config (FSDP2 or ZeRO-3), as it was saved")
    load_optimizer = zero3.load_optimizer if zero3.active(accelerator) else checkpoint_lib.load_optimizer
    load_optimizer(models.optimizer, state / f"optimizer{shard}.safetensors")
    schedulers = json.loads((state / "schedulers.json").read_text())
    models.scheduler.load_state_dict(schedulers["policy"])
    if models.critic is not None:  # (its weights were loaded by build_models)
        load_optimizer(models.critic_optimizer, state / f"critic_optimizer{shard}.safetensors")
        models.critic_scheduler.load_state_dict(schedulers["critic"])
    if accelerator.scaler is not None and schedulers["scaler"] is not None:
        accelerator.scaler.load_state_dict(schedulers["scaler"])
    rng = state / f"rng_{accelerator.process_index}.safetensors"
    sampler = state / f"sampler_{accelerator.process_index}.safetensors"
    if rng.is_file():
        checkpoint_lib.load_rng(rng)
    # none from fewer processes, or from another engine; vLLM keeps none (sft and dpo may have no engine)
    restored = engine is None or engine.load_state_dict(load_file(str(sampler)) if sampler.is_file() else {})
    if not rng.is_file() or not restored:
        print(f"{checkpoint}: process {accelerator.process_index} continues without the "
              f"{'sampler' if rng.is_file() else 'random and sampler'} state of the run"
              + (f" ({engine.name} engine)" if engine is not None else "")
              + ": its samples will differ from an uninterrupted run's")
    models.nonfinite_streak = trainer_state.get("nonfinite_streak", {})
    return trainer_state


# ----------------------------------------------------------------------------------------------
# --dry-run: the memory plan (rl/memory.py)


def print_plan(args: Args, accelerator) -> None:
    """The run's estimated peak memory per GPU, by phase and by what holds it, and whether it fits."""
    import yaml

    from rl.logprobs import CHUNK_ELEMENTS
    from rl.memory import plan
    from rl.model import load_config

    if args.launch_config:
        launch = yaml.safe_load(Path(args.launch_config).read_text())
        processes = int(launch.get("num_processes", 1))
        is_sharded = launch.get("distributed_type") in ("FSDP", "DEEPSPEED")
        precision = args.mixed_precision if args.mixed_precision != "auto" else launch.get("mixed_precision")
        deepspeed = launch.get("distributed_type") == "DEEPSPEED"
        deepspeed_bf16 = deepspeed and precision == "bf16"
        offload = (launch.get("fsdp_config", {}).get("fsdp_offload_params") is True
                   or "cpu" in {(launch.get("deepspeed_config") or {}).get(key) for key in
                                ("offload_param_device", "offload_optimizer_device")})
        how, kind = args.launch_config, launch.get("distributed_type", "NO")
    else:
        processes, is_sharded = accelerator.num_processes, sharded(accelerator)
        deepspeed = zero3.active(accelerator)
        deepspeed_bf16 = deepspeed and accelerator.mixed_precision == "bf16"
        policy = accelerator.state.fsdp_plugin.cpu_offload if accelerator.distributed_type == "FSDP" else None
        offload = zero3.offloaded(accelerator) or type(policy).__name__ == "CPUOffloadPolicy" \
            or bool(getattr(policy, "offload_params", False))
        how, kind = "this launch", accelerator.distributed_type.value
    config = load_config(args.model)  # (a LoRA checkpoint's: its base's)
    gpu_gib = args.gpu_gib or (torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0)
    micro_tokens = args.max_tokens_per_micro_batch or args.micro_batch_size * args.max_tokens
    estimate = plan(config, algo=args.algo, lora_rank=args.lora_rank, lora_targets=args.lora_target_modules,
                    processes=processes, sharded=is_sharded, reference=args.algo == "dpo" or args.kl_coef > 0,
                    offload_reference=args.offload_reference, micro_tokens=micro_tokens,
                    checkpointing=args.gradient_checkpointing, engine=engine_kind(args.engine),
                    engine_share=args.vllm_gpu_memory_utilization, engine_sleeps=args.vllm_sleep, gpu_gib=gpu_gib,
                    batch=args.gen_batch_size, context=args.max_tokens,
                    logits_elements=min(CHUNK_ELEMENTS, micro_tokens * config.vocab_size), bf16_weights=deepspeed_bf16,
                    offload=offload, persistent_gradients=deepspeed)
    if not accelerator.is_main_process:
        return None
    print(f"memory plan per GPU: {args.model} ({estimate['parameters']:,} parameters, {estimate['trained']:,} trained), "
          f"{args.algo}, {how}: " + (f"{kind} over {processes} processes" if kind != "NO" else "one process, not distributed"))
    for phase, held in estimate["phases"].items():
        print(f"  {phase}: {sum(held.values()) / 2**30:.1f} GiB")
        for what, size in held.items():
            print(f"    {what:<58} {size / 2**30:8.2f} GiB")
    spare = gpu_gib - estimate["peak_gib"]
    print(f"peak {estimate['peak_gib']:.1f} GiB of {gpu_gib:.0f}: " + (f"fits, {spare:.1f} GiB to spare" if spare > 0.05 * gpu_gib else
          "does not fit" + (" (under 5% to spare)" if spare > 0 else "") + "; to need less: --gradient-checkpointing, a smaller "
          "--max-tokens-per-micro-batch, --lora-rank 16, FSDP2 or ZeRO-3 over more GPUs (configs/fsdp2.yaml, zero3.yaml), "
          "configs/fsdp2_offload.yaml, --offload-reference, or a smaller --vllm-gpu-memory-utilization"))
    return None


# ----------------------------------------------------------------------------------------------
# The training loop


def make_accelerator(args: Args):
    """Accelerate's set-up for this launch (configs/), and the mixed precision it trains in. Schedulers step
    once per optimizer step (by default Accelerate steps them once per process); without any accelerator the
    processes talk over gloo (DeepSpeed would otherwise ask for oneCCL); DeepSpeed's config is settled (rl/zero3.py)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    mixed = args.mixed_precision if args.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.accelerator.is_available() else []
    accelerator = Accelerator(mixed_precision=mixed, step_scheduler_with_optimizer=False, kwargs_handlers=handlers)
    check(args, accelerator.num_processes, accelerator.distributed_type.value)
    if zero3.active(accelerator):
        zero3.configure(accelerator, args.grad_clip)
    zero3.keep_out(accelerator)  # (no DeepSpeed import, and its warning, outside its launches)
    return accelerator, mixed


def main(args: Args) -> Path | None:
    from accelerate.utils import gather_object, set_seed

    accelerator, mixed = make_accelerator(args)
    set_seed(args.seed + accelerator.process_index)
    if args.deterministic and torch.cuda.is_available():  # the update's GPU kernels too (CPU ones are; untried here)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.dry_run:  # the memory plan, before anything heavy
        return print_plan(args, accelerator)
    if args.algo in OFFLINE:  # learning from trajectory files: the same models, checkpoints and logs
        return evolve(args, accelerator, mixed) if args.algo == "agentevol" else learn(args, accelerator, mixed)
    resuming = args.resume not in (None, "auto")  # "auto" without a checkpoint yet: a new run under --run-name
    run_dir = run_directory(args, resuming, accelerator)

    # -- tasks, and one env per trajectory of this process, created once and reset every step
    train_ids = envs.load_task_ids(args.train_tasks, args.env) if args.train_tasks else envs.splits(args.env)["train"]
    if len(train_ids) < args.tasks_per_step:
        raise SystemExit(f"the train split has {len(train_ids)} tasks, fewer than --tasks-per-step {args.tasks_per_step}")
    if args.epochs is not None:
        args = replace(args, steps=args.epochs * (len(train_ids) // args.tasks_per_step))
    # (each call bounded by --env-timeout; an env that failed is replaced: envs/guard.py)
    environments = make_envs(args.env, args.tasks_per_step // accelerator.num_processes * args.n,
                             envs.parse_options(args.env_options), args.env_timeout, args.env_url)
    pool = ThreadPoolExecutor(max_workers=min(32, len(environments)))
    test_ids = test_task_ids(args) if args.eval_every else []  # played on the same envs every --eval-every steps

    # -- models, the sampler, and the training state when resuming
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    models = build_models(args, accelerator, policy_from=args.resume if resuming else args.model)
    max_tokens = context_limit(args, accelerator.unwrap_model(models.policy), say=accelerator.is_main_process)
    engine = build_engine(args, fmt, models, accelerator, max_tokens)
    trainer_state = resume(accelerator, models, engine, Path(args.resume)) if resuming else {"step": 0, "logs": {}}
    start_step = trainer_state["step"] + 1
    sync_engine(engine, models.policy, accelerator, start_step - 1)  # from the first step on, the engine samples the trainer's weights

    # -- the run's record (logs cut back to the checkpoint's when resuming)
    config = run_config(args, run_dir, resuming, accelerator, mixed, engine, environments[0])
    if accelerator.is_main_process:
        print(f"run {run_dir.name}: {args.env}, {args.model} ({args.preset} preset), {args.algo}, {args.steps} steps of "
              f"{args.tasks_per_step} tasks x {args.n} samples, {describe(args.horizon, args.horizon_every, args.steps)}, "
              f"{evaluation_plan(args, len(test_ids), start_step, initial=start_step == 1)}"
              f" -> {run_dir}" + (f", resumed at step {start_step}" if resuming else ""))
    logs = Logs(args, run_dir, config, active=accelerator.is_main_process, resume_sizes=trainer_state["logs"])
    reduce = reducer(accelerator)  # whitening statistics over every process: a distributed batch is whitened as one

    # (the step bar shows the phase under way: rollout, update or eval, and how far it got)
    progress = tqdm(range(start_step, args.steps + 1), disable=not accelerator.is_main_process, desc="train",
                    dynamic_ncols=True, initial=start_step - 1, total=args.steps)
    if test_ids and start_step == 1:  # the initial policy, for the held-out comparison at the end (finish)
        evaluation, evaluated = evaluate(engine, fmt, environments, test_ids, models, args, accelerator, max_tokens, 0,
                                         progress)
        logs.write(0, evaluation | {"charts/step": 0}, eval_line(0, evaluation), evaluations=evaluated)
    try:
        for step in progress:
            step_start = time.perf_counter()

            # -- rollout: the same tasks on every process for a step, each process playing its share
            tasks = tasks_for(step, train_ids, args.tasks_per_step, args.seed)
            mine = tasks[accelerator.process_index::accelerator.num_processes]
            task_ids = [t for t in mine for _ in range(args.n)]
            groups = [g for g in range(len(mine)) for _ in range(args.n)]
            horizon = horizon_at(step, args.horizon, args.horizon_every)  # ScalingInter-RL: this step's turn cap
            stats: dict = {}
            reset_peak()
            if args.deterministic:  # this step's samples depend on (seed, step) and the weights alone
                engine.reseed(stream_seed(args.seed + accelerator.process_index, step))
            trajectories = rollout(engine, fmt, environments, task_ids, groups, horizon=horizon, pool=pool, stats=stats,
                                   max_new_tokens=args.max_new_tokens, max_tokens=max_tokens,
                                   agent=make_agent(args.agent, args.attempts),
                                   progress=phase(progress, "rollout", len(task_ids)))
            stop_on_env_failures(trajectories, args, accelerator, run_dir, step)
            stats["rollout_peak_gib"] = peak_gib()

            # -- the batch, its old/reference log-probs and values, advantages, the update, the engine's new weights
            engine.sleep()
            reset_peak()
            update_start = time.perf_counter()
            batch = batch_of(trajectories, args, accelerator, fmt.pad_id)
            score_batch(models, batch, args, accelerator)
            advantages, returns = advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, reduce)
            attach(batch, advantages, returns)
            sums, grad_norms = update(models, batch, args, accelerator, step,
                                      phase(progress, "update", args.ppo_epochs * len(batch.micro)))
            stop_on_nonfinite(models, batch, args, accelerator, run_dir, step)
            stats |= {"update_s": time.perf_counter() - update_start, "update_peak_gib": peak_gib()}
            synced = sync_engine(engine, models.policy, accelerator, step)

            # -- metrics and logs (trajectory statistics over all processes, losses from this one)
            records = gather_object(rollout_records(trajectories, batch, step))
            sampled = gather_object([stats["sampled_tokens"]])
            metrics = step_metrics(records, sampled, stats, sums, grad_norms, batch, advantages, returns, models, horizon,
                                   engine.metrics() | synced)
            evaluated = []
            if eval_due(step, args.eval_every, args.steps):
                evaluation, evaluated = evaluate(engine, fmt, environments, test_ids, models, args, accelerator,
                                                 max_tokens, step, progress)
                metrics |= evaluation
            metrics |= {"perf/step_s": time.perf_counter() - step_start, "charts/step": step}
            logs.write(step, metrics, rl_line(step, metrics), evaluations=evaluated,
                       rollouts=records if step % args.log_rollouts_every == 0 else [])

            if step == args.steps or (args.save_every and step % args.save_every == 0):
                save_checkpoint(accelerator, models, engine, tokenizer, run_dir / "checkpoints" / f"step_{step}", step, logs,
                                args.keep_checkpoints)
    finally:  # also when a stop (env failures, NaN) or an error ends the run: no JVM or browser left behind
        pool.shutdown()
        engine.close()
        close_envs(environments)
        logs.close()
    return finish(run_dir, accelerator)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main(parse_args())
