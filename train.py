"""Multi-turn RL for LLM agents on AgentGym environments: AgentGym-RL and ScalingInter-RL.

    python train.py                                              # tiny embedded model, BabyAI, CPU, minutes
    python train.py --model Qwen/Qwen2.5-3B-Instruct --env babyai  # the paper's recipe, one GPU
    accelerate launch --num_processes 8 train.py --model Qwen/Qwen2.5-3B-Instruct --env textcraft \
        --algo grpo --horizon 10 20 30 --horizon-every 100          # ScalingInter-RL, data-parallel
    accelerate launch --config_file configs/fsdp2.yaml train.py ...  # sharded: FSDP2, or configs/zero3.yaml

Each step (main): sample `tasks_per_step` tasks of the train split, roll out `n` episodes of each (rollout.py) with
at most the turns the horizon schedule allows at this step (rl/horizon.py), score each by its last reward, turn the
scores into advantages (rl/advantages.py's ESTIMATORS: `--algo` grpo, rloo, gigpo, reinforce_pp, or ppo with a critic
and GAE), update the policy with PPO's clipped loss, a KL penalty to the frozen initial model and an entropy bonus
(update_policy: rl/losses.policy_objective), and copy the new weights into the rollout engine (rl/engines/setup.py:
sync). Each process rolls out its own share of the tasks. The run directory (rl/run.py) gets every trajectory, the
metrics (wandb with --track) and checkpoints. The same models, accumulation, logs and checkpoints learn from trajectory
files (--data: learn, evolve):

    python train.py --algo sft --data data/babyai_train_expert.jsonl --epochs 2   # (scripts/make_expert_data.py)
    python train.py --algo dpo --data expert.jsonl --experience runs/<run>/rollouts.jsonl
    python train.py --algo agentevol --data data/babyai_train_expert.jsonl --iterations 3 --n 4

`--max-staleness k` trains asynchronously: the next k steps' episodes are played while the trainer updates, and
decoupled PPO weighs the tokens sampled by older weights (rollout.py's Rollouts; docs/async.md).
`--mismatch tis|mis` weighs the tokens of the weights being updated for the engine's gap from the trainer (a bf16
engine; rl/losses.py: one importance weight a token, the staleness's and the mismatch's).
`--agent tools` plays through native tool calls and a reasoning model's block is never read by the env (rl/chat.py);
`--reasoning drop` trains each turn on the template's rendering of the conversation, earlier reasoning gone.
Flags default to the paper's recipe for a real model and to the `tiny` preset (two CPU cores, minutes) for the
embedded one. --eval-every plays the test split during any run; --dry-run prints the memory plan (rl/memory.py).
Where the loop differs from upstream's (AgentGym-RL's verl fork): `--ppo-epochs` is honoured (upstream makes one
pass whatever it says: the recipes pass 1); a mini-batch's loss is normalised by its tokens over all processes
(rl/batch.py); the reference runs exactly as the policy (rl/model.py); resuming restores the samplers' random state
(rl/run.py); reward placement, GAE over action tokens, groups of one: rl/advantages.py.
"""

from __future__ import annotations

import rl  # noqa: F401 - first: sets OpenMP's wait policy before torch loads (see rl/__init__.py)

import copy
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from tqdm import tqdm

import envs
from envs.guard import EnvArgs
from rl import advantages as adv_lib
from rl import flags, staleness
from rl.agent import LayoutArgs, chat_format
from rl.batch import (Batch, MicroBatch, StepTensors, arrange, attach, make_batch, minibatch_counts, rows_of, scatter,
                      shape_overlong)
from rl.data import OfflineArgs, examples_of, held_out, offline_steps, read_data, to_record
from rl.engines.setup import TrainerEngineArgs, build_engine, own_stream, stream_seed, sync
from rl.flags import GROUP, OFFLINE, build, check, embedded_of, replace
from rl.limits import Limits, caps_for, describe_limits, env_limits, horizon_for, largest, last_caps, within
from rl.logprobs import token_logprobs, token_values
from rl.losses import Counts, Objective, aggregate, kl, policy_objective, value_loss
from rl.memory import PlanArgs, print_plan
from rl.model import (EMBEDDED_OWN, EMBEDDED_ROLLOUT, EMBEDDED_TOOLS, ModelArgs, Models, build_models, context_limit,
                      has_reference, load_tokenizer, make_accelerator, reference, restart, stop_on_nondeterministic)
from rl.metrics import (Costs, UpdateSums, eval_line, eval_metrics, evol_line, offline_line,
                        policy_sums, rl_line, step_metrics, timing)
from rl.optimizer import accumulate, optimizer_steps, reducer, stop_on_nonfinite
from rl.progress import Progress, phase, step_bar, stopped
from rl.records import rollout_records
from rl.run import (Logs, RunArgs, close, eval_due, evaluation_plan, finish, logged_steps, resume, run_config,
                    run_directory, save_checkpoint, stop_on_env_failures, stopped_run)
from rl.scores import score, spread
from rl.offline import offline_pass
from rl.tasks import Mix, Redraw, instances, my_tasks, step_tasks, tasks_by_env, tasks_for, test_tasks
from rollout import ChatFormat, EngineStalled, Rollouts, RolloutStats, Tasks, Trajectory, play

@dataclass
class Args:
    # -- what to train
    env: tuple[str, ...] = ("babyai",)
    """environments: babyai, textcraft, sciworld, searchqa, webarena, or all; several train one agent on all of
    them, a step's tasks shared by --env-weights (rl/tasks.py's Mix)"""
    env_weights: tuple[float, ...] = ()
    """several envs: each one's share of a step's tasks, the same every step; default: equal"""
    model: str = "tiny-agent"
    """Hugging Face id or local directory; `tiny-agent` is the embedded CPU model"""
    preset: Literal["auto", "paper", "tiny"] = "auto"
    """default values: `paper` (the paper's recipe), `tiny` (CPU demo); auto: tiny for the embedded model"""
    train_tasks: str | None = None
    """task id file in AgentGym-RL-Data-ID format ([{"item_id": "babyai_12"}, ...]), or several joined by `:` (the first
    that names an env gives its tasks); default: the shipped train split (the tiny preset's on BabyAI, also beside a
    file of other envs: 5 levels where the embedded agent learns fastest, envs/data/babyai_tiny_train.json)"""
    test_tasks: str | None = None
    """task id file that evaluations play (--eval-every), or several joined by `:`; default: the shipped test split (the
    tiny preset's on BabyAI, also beside a file of other envs: envs/data/babyai_tiny_test.json)"""

    # -- algorithm
    algo: Literal[(*adv_lib.ESTIMATORS, *OFFLINE)] = "grpo"
    """RL by its advantage estimator: grpo (group-normalised), rloo (leave-one-out), gigpo (grpo plus turn-level
    credit: turns from the same env state compared), reinforce_pp (discounted returns whitened over the batch), ppo
    (a critic and GAE); or learning from trajectory files (--data):
    sft (behaviour cloning), dpo (preference pairs), agentevol (AgentGym's self-evolution)"""
    # --grpo-scale, --gamma, --step-weight, --lam, --gae-unit, --whiten-per-env: the estimators' entries declare them
    estimator_args: Annotated[adv_lib.EstimatorArgs, GROUP] = field(default_factory=adv_lib.EstimatorArgs)
    overlong_penalty: str | None = None
    """DAPO's soft overlong punishment, L:P (e.g. 1024:1): an episode's score loses P x how far it went into the last
    L tokens of its --max-tokens, linearly, and P where the budget ended it (rl/batch.shape_overlong)"""
    overlong_mask: bool = False
    """leave the episodes that the token budget ended out of the loss (DAPO's overlong filtering; they stay in their
    group's baseline)"""

    # -- SFT, DPO, AgentEvol: learning from trajectory files
    offline_args: Annotated[OfflineArgs, GROUP] = field(default_factory=OfflineArgs)  # rl/data.py

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
    group_start: Literal["reset", "fork"] = "reset"
    """a group's n episodes: each from a reset, or (fork) from copies of one after --fork-turns turns (rollout.py)"""
    fork_turns: int = 1
    """--group-start fork: the turns a group shares, token for token (docs/algorithms.md: why 1)"""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling: a task group that --algo's estimator gives no advantage (its episodes all scored the
    same; gigpo: its turns too) plays again on a new task, up to this many rounds a step (rl/tasks.Redraw; logged as
    rollout/dynamic_groups); 0: off"""
    horizon: tuple[int | Literal["auto"], ...] = (15,)
    """turn cap per episode; several values are ScalingInter-RL's stages, e.g. --horizon 10 20 30; `auto 10 20 30`
    climbs them when the run shows it is time (rl/horizon.py; `auto` alone: the preset's stages, else 10 20 30)"""
    horizon_every: int = 100
    """training steps per horizon stage"""
    horizon_patience: int = 3
    """--horizon auto: the fewest steps at a cap, and the window of steps its rule looks at"""
    horizon_cut: float = 0.1
    """--horizon auto: raise the cap when it cut at most this share of the window's episodes"""
    horizon_gain: float = 0.02
    """--horizon auto: raise the cap when the window's success is not this much above the window's before"""
    max_new_tokens: int = 512
    """tokens per assistant turn"""
    max_tokens: int = 8192
    """tokens per trajectory (prompt + every turn); an episode ends when it is spent"""
    env_limits: dict[str, str] = field(default_factory=dict)
    """an env's own limits in a run of several: ENV.KEY VALUE, KEY horizon (stages: 8,12,15), horizon_every,
    max_new_tokens or max_tokens (e.g. webarena.max_tokens 16384); the flags above: every other env's (rl/limits.py)"""
    layout_args: Annotated[LayoutArgs, GROUP] = field(default_factory=LayoutArgs)  # rl/agent.py
    gen_batch_size: int = 64
    """trajectories per generation call (hf engine)"""
    env_args: Annotated[EnvArgs, GROUP] = field(default_factory=EnvArgs)  # envs/guard.py
    max_error_rate: float = 0.25
    """stop the run when more than this share of a step's trajectories end in an env failure, not train on the rest"""

    # -- rollout engine
    engine_args: Annotated[TrainerEngineArgs, GROUP] = field(default_factory=TrainerEngineArgs)  # rl/engines/setup.py

    # -- asynchronous training
    max_staleness: int | None = None
    """asynchronous: rollouts go on while the trainer updates, each step training on its tasks' episodes sampled by
    weights at most this many updates older than those it updates (decoupled PPO weighs them, --is-cap); 0 runs that
    loop with no staleness, which is the synchronous loop exactly; default: the synchronous loop (docs/async.md). With
    --deterministic and k >= 1 the same command line repeats the run; a resumed one plays the sets that were under
    way anew (they are not checkpointed), and --steps bounds the sets played, so either changes later steps"""

    # -- optimisation
    model_args: Annotated[ModelArgs, GROUP] = field(default_factory=ModelArgs)  # rl/model.py
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
    objective: Annotated[Objective, GROUP] = field(default_factory=Objective)  # rl/losses.py: the policy loss

    # -- critic (ppo)
    critic_warmup: int = 0
    """the policy trains from step k on, only the critic before (upstream's trainer.critic_warmup: k - 1
    critic-only steps)"""
    value_clip: float = 0.5
    """value-loss clip around the old values"""
    max_nonfinite_updates: int = 3
    """an optimizer step whose loss or gradient is NaN or infinite is skipped; this many in a row stop the
    run, and the batch is saved under the run directory for debugging"""

    # -- planning
    plan_args: Annotated[PlanArgs, GROUP] = field(default_factory=PlanArgs)  # rl/memory.py

    # -- bookkeeping
    seed: int = 1
    """seeds the task order, the sampler and the update's shuffling"""
    run_args: Annotated[RunArgs, GROUP] = field(default_factory=RunArgs)  # rl/run.py


PRESETS = {
    "paper": Args(),
    # the default run, `python train.py`: ScalingInter-RL on 5 BabyAI levels (TINY_TASKS), 3 turns
    # then 6, and the held-out comparison of the initial and final policies (step 0 and the last evaluation)
    "tiny": build(Args,
        env=(EMBEDDED_ROLLOUT["env"],), horizon=(3, EMBEDDED_ROLLOUT["horizon"]), horizon_every=8,
        max_new_tokens=EMBEDDED_ROLLOUT["max_new_tokens"], max_tokens=EMBEDDED_ROLLOUT["max_tokens"], steps=16,
        tasks_per_step=8, n=8, lr=2e-4, minibatches=1, micro_batch_size=4, gradient_checkpointing=False, save_every=0,
        critic_lr=1e-3,
        eval_every=16, eval_tasks=0, eval_k=2,
        # n: groups of 8, since at the agent's first 5-10% success a group of 4 has no success (no GRPO signal) about
        # two times in three; measured over 3 seeds each (README, "What to expect"), the held-out gain was 14-29 points
        # with n 8, 8-11 with n 4 (and 10-11 with 16 tasks x 4, the same 64 episodes a step). lr: at n 4, 2e-4 beat 1e-4
        # and 5e-4. loss_agg: on the one-turn bandit of tests/test_learning.py at lr 1e-3,
        # token-mean takes GRPO from 27% to 69% in 6 steps, seq-mean-token-mean drifts to long replies and collapses
        loss_agg="token-mean",
    ),
}

# Learning from trajectory files takes its own learning rate: AgentGym's example scripts' for a real model
# (behaviour cloning and AgentEvol 1e-5, DPO 5e-7), and for the embedded one what took its losses down in a few
# dozen steps (measured: README, "What to expect").
OFFLINE_LR = {("paper", "sft"): 1e-5, ("paper", "agentevol"): 1e-5, ("paper", "dpo"): 5e-7,
              ("tiny", "sft"): 1e-3, ("tiny", "agentevol"): 1e-3, ("tiny", "dpo"): 1e-4}

# The tiny preset's task sets, by env (envs/data, scripts/babyai_splits.py): on BabyAI the 5 fixed-goal levels
# whose expert finishes within 6 turns, where the embedded agent learns fastest (held-out success 8-11% at
# first, 22-40% after the default run); on the others a group rarely differs in reward.
TINY_TASKS = {"babyai": ("babyai_tiny_train.json", "babyai_tiny_test.json")}
# Elsewhere its evaluations (at step 0 and at the end) play this many test tasks, spread over the split: 32
# episodes at --eval-k 2, half a training step's 64, where the whole split would be 200 (TextCraft) to 2,342
# (SciWorld) episodes each time, for an agent that never learned those envs; --eval-tasks 0 plays it all.
TINY_EVAL_TASKS = 16


# ----------------------------------------------------------------------------------------------
# RL: the training loop


def main(args: Args) -> Path | None:
    from accelerate.utils import gather_object, set_seed

    accelerator, mixed = make_accelerator(args.model_args.mixed_precision, args.grad_clip,
                                          args.engine_args.deterministic)
    check(args, accelerator.num_processes, accelerator.distributed_type.value)
    set_seed(args.seed + accelerator.process_index)
    limits = env_limits(args)  # each env's turn caps and token budgets (rl/limits.py), from here on passed down
    top = largest(limits).max_tokens  # (what is sized for the whole run takes the largest of the envs' budgets)
    if args.plan_args.dry_run:  # the memory plan, before anything heavy
        micro_tokens = args.max_tokens_per_micro_batch or args.micro_batch_size * top
        return print_plan(accelerator, args.plan_args, args.model, args.algo, args.objective.kl_coef, args.model_args,
                          args.engine_args, args.gen_batch_size, micro_tokens, top)
    if args.algo in OFFLINE:  # learning from trajectory files: the same models, checkpoints and logs
        return (evolve if args.algo == "agentevol" else learn)(args, accelerator, mixed, limits)
    resuming = args.run_args.resuming
    run_dir = run_directory(accelerator, args.run_args, f"{'+'.join(args.env)}-{args.algo}")

    # -- tasks (each env's quota a step: rl/tasks.py's Mix), one env per trajectory of this process (a block for each
    # of the k + 1 steps under way at --max-staleness k), made once, reset every step, replaced when one fails
    mix, rank = Mix.of(args.env, args.env_weights, args.tasks_per_step), accelerator.process_index
    train_ids = mix.task_ids(args.train_tasks)
    args = replace(args, steps=args.epochs * mix.epoch_steps(train_ids)) if args.epochs is not None else args
    rows = mix.rows(args.n, rank, accelerator.num_processes)  # (the env of each of this process's episodes)
    environments = args.env_args.make_pool(rows, staleness.blocks(args.max_staleness or 0), rank, args.seed)
    test_ids = test_tasks(args.test_tasks, args.env, args.eval_tasks) if args.eval_every else {}  # (--eval-every)
    players = args.env_args.evaluation_pool(rows, environments, test_ids, args.max_staleness is not None, rank,
                                            args.seed)
    engine = logs = rollouts = None
    try:  # (everything from here on closes what it opened, also on a stop or an error)
        # -- models, the sampler, and the training state when resuming
        tokenizer, fmt, models, limits = set_up(args, accelerator, limits)  # (limits: within the context window now)
        engine = engine_of(args, fmt, models, accelerator, limits)
        trainer_state = resume(accelerator, models, engine, args.run_args)
        start_step = trainer_state["step"] + 1
        sync(engine, models.policy, accelerator, start_step - 1)  # from the first step on: the trainer's weights
        history = logged_steps(run_dir, start_step) if resuming else []  # (the steps' metrics: --horizon auto's input)
        rollouts = rollouts_of(engine, fmt, environments, mix, train_ids, start_step, limits, args, accelerator,
                               history)

        # -- the run's record (logs cut back to the checkpoint's when resuming)
        config = run_config(flags.flat(args), run_dir, resuming, accelerator, mixed, engine, environments[0])
        accelerator.print(start_line(args, mix, run_dir, limits, sum(map(len, test_ids.values())), start_step))
        logs = logs_of(args, run_dir, config, accelerator, trainer_state["logs"])
        args = replace(args, objective=args.objective.norm_tokens(top))  # (Dr. GRPO's constant, after config.json)

        # (the step bar shows the phase under way: rollout, update or eval, and how far it got)
        progress = step_bar(start_step, args.steps, accelerator.is_main_process)
        if test_ids and start_step == 1:  # the initial policy, for the held-out comparison at the end (finish)
            evaluation, evaluated = evaluate(engine, fmt, players, test_ids, args, accelerator, limits, 0, progress)
            logs.write(0, evaluation | {"charts/step": 0}, eval_line(0, evaluation), evaluations=evaluated)
        for step in progress:
            # -- rollout: the same tasks on every process for a step, each process playing its share (rollouts_of)
            step_start = time.perf_counter()
            horizon, why = horizon_for(step, args, limits, history)  # ScalingInter-RL's stage, or --horizon auto's cap
            costs = Costs(RolloutStats())
            with costs.measure("rollout"):
                trajectories = rollouts.take(step, Progress(progress, "rollout", len(rows), horizon))
                stop_on_env_failures(trajectories, args.max_error_rate, accelerator, run_dir, step)

            # -- the batch, its old/reference log-probs and values, advantages, the update, the engine's new weights
            rollouts.before_update()  # (the engine then holds nothing, and sleeps through the update)
            between = rollouts.advance if rollouts.meanwhile else None  # (rollouts going on meanwhile)
            with costs.measure("update"):
                batch = batch_of(trajectories, args, accelerator, fmt.pad_id, step, limits)
                old_logprobs(models, batch, args, accelerator, between)
                advantages, returns = advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok,
                                                     reducer(accelerator), batch.episodes, batch.anchors, batch.envs)
                attach(batch, advantages, returns)
                sums, grad_norms = update(models, batch, args, accelerator, step,
                                          phase(progress, "update", args.ppo_epochs * len(batch.micro)),
                                          between=between)
                stop_on_nonfinite(models, batch, args.max_nonfinite_updates, accelerator, run_dir, step)
            rollouts.before_sync()
            accelerator.wait_for_everyone()  # (no process's sync changes a shared server's weights under another's)
            synced = sync(engine, models.policy, accelerator, step)

            # -- metrics and logs (trajectory statistics over all processes, losses from this one)
            rollouts.spent(costs.rollout)  # (what its loop did this step: the take, and the advances meanwhile)
            records = gather_object(rollout_records(trajectories, batch, step))
            sampled = gather_object([(costs.rollout.sampled_tokens, costs.rollout.generate_s)])
            metrics = step_metrics(records, sampled, costs, sums, grad_norms, batch, advantages, returns, models,
                                   horizon, engine.metrics() | synced, why, args.max_staleness, args.estimator_args)
            evaluation, evaluated = evaluate(engine, fmt, players, test_ids, args, accelerator, limits, step,
                                             progress) if eval_due(step, args.eval_every, args.steps) else ({}, [])
            metrics |= evaluation | timing(step, step_start, costs.rollout.generate_s)
            logs.write(step, metrics, rl_line(step, metrics), evaluations=evaluated,
                       rollouts=records if step % args.run_args.log_rollouts_every == 0 else [])
            history.append(metrics)
            rollouts.resume(step)  # (at staleness 0 the next step's set opens here, its cap by this step's metrics)

            if args.run_args.save_due(step, args.steps):
                save_checkpoint(accelerator, models, engine, tokenizer, run_dir / "checkpoints" / f"step_{step}", step,
                                logs, args.run_args.keep_checkpoints)
    except KeyboardInterrupt:  # one line: the newest complete checkpoint, and how to go on from it
        stopped_run(run_dir, accelerator.is_main_process)
    finally:  # also when a stop (env failures, NaN, a stalled engine) or an error ends the run: no JVM or browser left
        close(engine, environments + (players if players is not environments else []), logs, rollouts=rollouts)
    return finish(run_dir, accelerator)


# ----------------------------------------------------------------------------------------------
# The phases of an RL step, in the order main() runs them


def set_up(args: Args, accelerator, limits: dict[str, Limits]) -> tuple[object, ChatFormat, Models, dict[str, Limits]]:
    """The tokenizer, its chat format for the agent's layout, the models (the policy's weights those of the checkpoint
    resumed, else --model's) and each env's `limits` within the policy's context window (rl/limits.py's within: a
    trajectory holds at most the smaller of its budget and the window)."""
    tokenizer = load_tokenizer(args.model)
    fmt = chat_format(tokenizer, args.layout_args)
    policy_from = args.run_args.resume if args.run_args.resuming else args.model
    models = build_models(accelerator, policy_from, args.model, args.algo, args.objective.kl_coef, args.model_args)
    context = context_limit(largest(limits).max_tokens, args.model, accelerator.unwrap_model(models.policy).config,
                            say=accelerator.is_main_process)
    return tokenizer, fmt, models, within(limits, context)


def engine_of(args: Args, fmt: ChatFormat, models: Models, accelerator, limits: dict[str, Limits]):
    """This process's rollout engine (rl/engines/setup.py), its sampler seeded by the process, its context the largest
    of the envs' token budgets."""
    return build_engine(args.engine_args, fmt, args.model, largest(limits).max_tokens,
                        args.seed + accelerator.process_index, args.gen_batch_size, accelerator=accelerator,
                        policy=models.policy)


def logs_of(args: Args, run_dir: Path, config: dict, accelerator, sizes: dict) -> Logs:
    """The run's logs (`sizes`: the files' sizes at the checkpoint resumed, cut back to them), wandb with --track."""
    return Logs(run_dir, config, accelerator.is_main_process, sizes,
                args.run_args.wandb_project if args.run_args.track else None)


def start_line(args: Args, mix: Mix, run_dir: Path, limits: dict[str, Limits], tests: int, start: int) -> str:
    """An RL run's first line: what it trains, how long, at which turn caps (each env's `limits`), its evaluations,
    where it writes."""
    return (f"run {run_dir.name}: {mix}, {args.model} ({args.preset} preset), {args.algo}, {args.steps} steps of "
            f"{args.tasks_per_step} tasks x {args.n} samples, {describe_limits(limits, args.steps)}, "
            f"{f'forked after {args.fork_turns} turns, ' * (args.group_start == 'fork')}"
            f"{evaluation_plan(tests, args.eval_k, args.eval_every, start, args.steps, initial=start == 1)}"
            f" -> {run_dir}" + (f", resumed at step {start}" if args.run_args.resuming else ""))


def rollouts_of(engine, fmt: ChatFormat, environments: list, mix: Mix, train_ids: dict[str, list[int]], first: int,
                limits: dict[str, Limits], args: Args, accelerator, history: list[dict]) -> Rollouts:
    """The run's rollouts (rollout.py's Rollouts), set j holding step j's tasks (step_tasks, each env's on its rows of
    `environments`: make_pool; my_tasks, each env's horizon schedule and `limits`,
    under --deterministic a stream of seeds restarted from (seed, step)), from step `first` on, at --max-staleness k
    (none: 0, the synchronous loop): in-flight episodes are not checkpointed, a resumed run plays its next steps'
    sets anew (docs/async.md: a browser page or a JVM's state cannot be saved)."""
    def tasks_of(j: int) -> Tasks:
        mine, groups = my_tasks(step_tasks(j, mix, train_ids, args.seed), args.n, accelerator)
        return Tasks([task for _, task in mine], groups, caps_for(j, args, limits, history)[0])

    seed = args.seed + accelerator.process_index
    flags.check_overlong(args.overlong_penalty, limits)  # (within the model's context window too)
    return Rollouts(engine, fmt, environments, tasks_of, staleness=args.max_staleness or 0, first=first,
                    last=args.steps, limits=limits, agent=args.layout_args.make_agent(),
                    reseed=(lambda j: engine.reseed(stream_seed(seed, j))) if args.engine_args.deterministic else None,
                    versions=args.max_staleness is not None,  # (the flag decides what is recorded and logged)
                    redraw=Redraw(train_ids, args.dynamic_sampling, args.seed, accelerator.process_index, args.algo,
                                  vars(args.estimator_args)) if args.dynamic_sampling else None,
                    fork=args.fork_turns if args.group_start == "fork" else None)


def batch_of(trajectories: list[Trajectory], args: Args, accelerator, pad_id: int, step: int | None = None,
             limits: dict[str, Limits] | None = None) -> Batch:
    """The step's tensors (rl/batch.py), laid out by the micro-batch flags, as many micro-batches on every process
    (the most any process needs; the others add empty ones), each token's lag behind `step` where it has one; the
    scores shaped by --overlong-penalty against the budgets episodes played under (each env's `limits`)."""
    rows, episodes = rows_of(trajectories)  # (--reasoning drop: a row per turn)
    layout = arrange([len(t.token_ids) for t in rows], args.micro_batch_size, args.max_tokens_per_micro_batch,
                     args.pack, minimum=args.minibatches)
    count = int(reducer(accelerator, "max")(torch.tensor([len(layout)])))
    batch = make_batch(rows, pad_id, layout, accelerator.device, count, args.pack, episodes, step)
    if args.overlong_penalty or args.overlong_mask:  # (DAPO's shaping of the episodes the token budget ends)
        buffer, penalty = flags.overlong_of(args.overlong_penalty)
        shape_overlong(batch, rows, {env: own.max_tokens for env, own in limits.items()}, buffer, penalty,
                       args.overlong_mask)
    return batch


@torch.no_grad()
def old_logprobs(models: Models, batch: Batch, args: Args, accelerator, between=None) -> None:
    """Old and reference log-probs and old values of every micro-batch, also scattered into `full` (the advantages
    need them on the whole batch). Every model runs as the policy does in the update and in the sampler (fp32
    weights under Accelerate's autocast, which `prepare` also wraps around the policy's forward), so that policy and
    reference agree exactly while their weights do. With a single update per rollout the policy has not moved, so
    the old log-probs are the current ones (detached) and need no extra forward pass, unless the KL goes into the
    reward, which needs them before the update. `between`, when given, is called after every micro-batch (update)."""
    need_old = args.ppo_epochs * args.minibatches > 1 or (args.objective.kl_in_reward and has_reference(models))
    for module in (models.policy, models.critic):
        if module is not None:
            module.eval()
    for micro in batch.micro:
        inputs = (micro.input_ids, micro.attention_mask, micro.loss_mask)
        with accelerator.autocast():
            if need_old:
                micro.old_logprobs, _ = token_logprobs(models.policy, *inputs, args.engine_args.temperature,
                                                       position_ids=micro.position_ids)
            if models.critic is not None:
                micro.old_values = token_values(models.critic, *inputs, position_ids=micro.position_ids)
        if between is not None and (need_old or models.critic is not None):  # (only where a pass ran)
            between()
    if has_reference(models):  # in a pass of its own: under LoRA the reference is the policy with its adapters off
        with reference(models, accelerator, args.model_args.offload_reference) as ref:
            for micro in batch.micro:
                with accelerator.autocast():
                    micro.ref_logprobs, _ = token_logprobs(ref, micro.input_ids, micro.attention_mask,
                                                           micro.loss_mask, args.engine_args.temperature,
                                                           position_ids=micro.position_ids)
                if between is not None:
                    between()
    scatter(batch, ("old_logprobs", "ref_logprobs", "old_values"))


def advantages_for(args: Args, full: StepTensors, scores: torch.Tensor, groups: torch.Tensor, ok: torch.Tensor,
                   reduce, episodes: torch.Tensor | None = None, anchors: list[list] | None = None,
                   row_envs: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's per-token advantages [B, T] (and GAE's returns for the critic) by --algo (rl/advantages.py); with
    --kl-in-reward the reward loses beta * KL_t at every action token. `reduce` whitens over all processes, as one;
    `episodes`: the episode of each row (--reasoning drop: a row per turn); `anchors`: gigpo's, each episode's state
    keys before its turns (rl/batch.py); `row_envs`: each row's env, with several envs whitened apart
    (--whiten-per-env)."""
    penalty, objective = None, args.objective
    if objective.kl_in_reward and full.ref_logprobs is not None:
        penalty = objective.kl_coef * kl(full.old_logprobs, full.ref_logprobs, objective.kl_estimator) * full.loss_mask
    strata = adv_lib.strata(row_envs, args.env) if row_envs is not None else None
    inputs = adv_lib.AdvantageInputs(scores=scores, groups=groups, ok=ok, mask=full.loss_mask, penalty=penalty,
                                     episodes=episodes, values=full.old_values, anchors=anchors, turn=full.turn,
                                     reduce=reduce, strata=strata)
    return adv_lib.advantages(args.algo, inputs, **vars(args.estimator_args))


def update(models: Models, batch: Batch, args: Args, accelerator, step: int, progress=None,
           between=None) -> tuple[UpdateSums, dict[str, list[float]]]:
    """PPO's update: `ppo_epochs` passes (upstream's actor makes one, whatever its ppo_epochs says), each over
    `minibatches` shuffled mini-batches of the step's micro-batches, one optimizer step per mini-batch for the policy
    (after the critic's warm-up) and the critic (rl/optimizer.py), each mini-batch's loss aggregated over all of it
    however it is split into micro-batches and processes. Returns the summed statistics and the gradient norms of
    every optimizer step of the models that trained. A step whose loss or gradient is not finite is skipped (counted
    in sums.nonfinite_updates and models.nonfinite_streak, with a warning; fp16's loss scaler skips the steps whose
    scaled gradients overflow itself, uncounted). `between`, when given, is called after every micro-batch (the
    rollouts that go on meanwhile: rollout.Rollouts.advance). Dr. GRPO's constant is args.objective's (main sets it)."""
    train_policy = step >= args.critic_warmup  # as upstream: `critic_warmup <= global_steps`, counted from 1
    trained = [("policy", update_policy)] if train_policy else []
    if models.critic is not None:
        trained.append(("critic", update_critic))
    for name, _ in trained:
        models.part(name)[0].train()
    sums, grad_norms = UpdateSums(), {}
    rng = random.Random(f"{args.seed}-{step}-update")

    def tick() -> None:  # after every micro-batch
        for call in (progress, between):
            if call is not None:
                call()

    for _ in range(args.ppo_epochs):
        shuffled = list(range(len(batch.micro)))
        rng.shuffle(shuffled)
        for part in range(args.minibatches):
            minibatch = [batch.micro[i] for i in shuffled[part::args.minibatches]]
            counts = minibatch_counts(minibatch, reducer(accelerator), accelerator.num_processes)
            passes = [(name, models.part(name)[0], lambda micro, f=loss: f(models, micro, counts, args, accelerator))
                      for name, loss in trained]
            finite = accumulate(accelerator, minibatch, passes, sums, progress=tick)
            for name, grad_norm in optimizer_steps(models, finite, args.grad_clip, accelerator, step, sums).items():
                grad_norms.setdefault(name, []).append(grad_norm)
    scatter(batch, ("trainer_logprobs",))
    return sums, grad_norms


def update_policy(models: Models, micro: MicroBatch, counts: Counts, args: Args,
                  accelerator) -> tuple[torch.Tensor, UpdateSums, bool]:
    """The policy's loss on one micro-batch (rl/losses.policy_objective, by the flags of its Objective),
    aggregated over the whole mini-batch (`counts`: its action tokens and sequences); the micro-batch's sums for the
    metrics, and whether they are finite."""
    with accelerator.autocast():
        logprobs, entropy = token_logprobs(models.policy, micro.input_ids, micro.attention_mask, micro.loss_mask,
                                           args.engine_args.temperature, with_entropy=True,
                                           position_ids=micro.position_ids)
    loss, terms = policy_objective(logprobs, entropy, micro, counts, args.objective)
    if micro.trainer_logprobs is None:  # the first pass's, for the rollout log
        micro.trainer_logprobs = terms.old.detach()
    sums = policy_sums(terms, micro)
    return loss, sums, all(math.isfinite(x) for x in (sums.policy, sums.kl, sums.entropy))


def update_critic(models: Models, micro: MicroBatch, counts: Counts, args: Args,
                  accelerator) -> tuple[torch.Tensor, UpdateSums, bool]:
    """The critic's loss on one micro-batch: the clipped value loss against the GAE returns, on action tokens only,
    aggregated like the policy loss; its sums, and whether they are finite."""
    mask = micro.loss_mask
    with accelerator.autocast():
        values = token_values(models.critic, micro.input_ids, micro.attention_mask, mask, micro.position_ids)
    terms, clipped = value_loss(values, micro.old_values, micro.returns, args.value_clip)
    with torch.no_grad():
        sums = UpdateSums(critic_tokens=float(mask.sum()), value=float((terms * mask).sum()),
                          value_clipfrac=float((clipped * mask).sum()))
    loss = aggregate(terms, mask, args.objective.loss_agg, counts.tokens, counts.sequences, micro.segments,
                     micro.weights, args.objective.loss_norm_tokens)
    return loss, sums, math.isfinite(sums.value)


# ----------------------------------------------------------------------------------------------
# Evaluation during training (--eval-every), scored as eval.py scores


def evaluate(engine, fmt: ChatFormat, environments: list, test_ids: dict[str, list[int]], args: Args, accelerator,
             limits: dict[str, Limits], step: int, bar=None) -> tuple[dict, list[dict]]:
    """The policy on each env's test tasks, --eval-k episodes each at the run's temperature, scored as eval.py scores
    (rl/scores.py), with the weights of `step` that the engine has (the loops sync each new weights once). Every
    evaluation of a run plays under one turn cap per env (`limits`), its horizon schedule's last stage (the one it is
    headed for), so that evaluations compare across steps, step 0's included. Returns eval/ metrics (rl/metrics.py: per
    category, per env with several) and every episode's log record."""
    horizon = max(last_caps(limits).values())
    rank, processes = accelerator.process_index, accelerator.num_processes
    mine = sum(len(ids[rank::processes]) for ids in test_ids.values()) * args.eval_k
    with own_stream(engine, stream_seed(args.seed + accelerator.process_index, step, "eval")):  # (not the rollouts')
        episodes = play_share(engine, fmt, environments, test_ids, args.eval_k, args, accelerator, limits,
                              Progress(bar, "eval", mine, horizon))
    scores = {name: score([t for t in episodes if t.env == name], name,
                          envs.score_max(name, args.env_args.options(name))) for name in test_ids}
    return (eval_metrics(scores, horizon, largest(limits).max_tokens),
            [{"step": step, **t.log_record()} for t in episodes])


def play_share(engine, fmt: ChatFormat, environments: list, tasks: dict[str, list[int]], n: int, args: Args,
               accelerator, limits: dict[str, Limits], progress=None) -> list[Trajectory]:
    """`n` episodes of every task of each env (`tasks`, on its instances among `environments`) with the weights the
    engine has, each under its env's `limits` (the last stage of its horizon: rl/limits.py's last_caps), each process
    its share; every process gets all, in order."""
    from accelerate.utils import gather_object

    played = []
    for name, task_ids in tasks.items():
        mine, groups = my_tasks(task_ids, n, accelerator)
        played += play(engine, fmt, [env for env in environments if env.name == name], mine, groups,
                       horizon=last_caps(limits)[name], max_new_tokens=limits[name].max_new_tokens,
                       max_tokens=limits[name].max_tokens, agent=args.layout_args.make_agent(),
                       progress=progress) if mine else []
    engine.sleep()
    return gather_object(played)


# ----------------------------------------------------------------------------------------------
# SFT and DPO: learning from trajectory files (rl/data.py), on RL's models, accumulation and checkpoints


def learn(args: Args, accelerator, mixed: str, limits: dict[str, Limits]) -> Path:
    """--algo sft or dpo: optimizer steps over --data's examples, the validation loss at --eval-every
    steps and at the end, and with --eval-every the policy played on the test split then too (under `limits`)."""
    resuming = args.run_args.resuming
    run_dir = run_directory(accelerator, args.run_args, f"{'+'.join(args.env)}-{args.algo}")
    offline, agent = args.offline_args, args.layout_args.agent
    train, validation = held_out(read_data(offline.data, args.env, agent), offline.validation, args.seed)
    experience = read_data(offline.experience, args.env, agent, every=False) if offline.experience else None
    tokenizer, fmt, models, limits = set_up(args, accelerator, limits)
    max_tokens = largest(limits).max_tokens  # (every env's: one set of limits takes no --env-limits of its own)

    # -- the examples: conversations (sft) or pairs (dpo), a share of the tasks held out for validation
    examples = examples_of(fmt, train, max_tokens, args.algo == "dpo", offline.margin, experience)
    held = examples_of(fmt, validation, max_tokens, args.algo == "dpo", offline.margin, experience)
    args = replace(args, steps=offline_steps(len(examples), offline.batch_size, args.epochs, args.steps,
                                             pairs=args.algo == "dpo"))

    # -- the test tasks, envs and an engine, when the policy is played during training
    test_ids = test_tasks(args.test_tasks, args.env, args.eval_tasks) if args.eval_every else {}
    playing = instances({e: len(ids) for e, ids in test_ids.items()}, args.gen_batch_size, accelerator.num_processes)
    environments = args.env_args.make_pool(playing, 1, accelerator.process_index, args.seed)
    engine = engine_of(args, fmt, models, accelerator, limits) if test_ids else None
    trainer_state = resume(accelerator, models, engine, args.run_args)
    config = run_config(flags.flat(args), run_dir, resuming, accelerator, mixed, engine,
                        environments[0] if environments else None)
    tests = sum(map(len, test_ids.values()))
    if accelerator.is_main_process:
        print(f"run {run_dir.name}: {args.algo} on {args.model} ({args.preset} preset), {len(examples)} "
              f"{'pairs' if args.algo == 'dpo' else 'conversations'} of {len(train)} episodes ({len(held)} held out), "
              f"{args.steps} steps of {offline.batch_size}, "
              f"{evaluation_plan(tests, args.eval_k, args.eval_every, trainer_state['step'] + 1, args.steps, False)}"
              f" -> {run_dir}"
              + (f", resumed at step {trainer_state['step'] + 1}" if resuming else ""))
    logs = logs_of(args, run_dir, config, accelerator, trainer_state["logs"])

    progress = step_bar(trainer_state["step"] + 1, args.steps, accelerator.is_main_process, args.algo)
    try:
        for step in progress:
            step_start = time.perf_counter()
            metrics = offline_step(models, examples, step, args, accelerator, fmt.pad_id)
            stop_on_nonfinite(models, None, args.max_nonfinite_updates, accelerator, run_dir, step)
            if step == args.steps or eval_due(step, args.eval_every, args.steps):
                metrics |= validate(models, held, args, accelerator, fmt.pad_id)
            evaluation, evaluated = {}, []
            if test_ids and eval_due(step, args.eval_every, args.steps):  # the step's new weights, into the engine
                sync(engine, models.policy, accelerator, step)
                evaluation, evaluated = evaluate(engine, fmt, environments, test_ids, args, accelerator, limits, step,
                                                 progress)
            metrics |= evaluation | {"perf/step_s": time.perf_counter() - step_start, "charts/step": step}
            logs.write(step, metrics, offline_line(step, metrics), evaluations=evaluated)
            if step == args.steps or (args.run_args.save_every and step % args.run_args.save_every == 0):
                save_checkpoint(accelerator, models, engine, tokenizer, run_dir / "checkpoints" / f"step_{step}", step,
                                logs, args.run_args.keep_checkpoints)
    finally:
        close(engine, environments, logs)
    return finish(run_dir, accelerator)


def offline_step(models: Models, examples: list, step: int, args: Args, accelerator, pad_id: int) -> dict[str, float]:
    """One optimizer step on the step's batch (shuffled epochs over the examples, as RL's task order:
    a pure function of the step), and its metrics."""
    batch = [examples[i] for i in tasks_for(step, list(range(len(examples))), args.offline_args.batch_size, args.seed)]
    models.policy.train()
    sums, finite = offline_pass(models, batch, accelerator, pad_id, train=True, **offline_settings(args))
    grad_norms = optimizer_steps(models, finite, args.grad_clip, accelerator, step, sums)
    metrics = sums.metrics() | {"charts/lr": models.scheduler.get_last_lr()[0],
                                "losses/nonfinite_updates": sums.nonfinite_updates}
    return metrics | ({"losses/grad_norm": grad_norms["policy"]} if "policy" in grad_norms else {})


@torch.no_grad()
def validate(models: Models, examples: list, args: Args, accelerator, pad_id: int) -> dict:
    """The loss (dpo: and accuracy) on the held-out examples; {} when there are none."""
    if not examples:
        return {}
    models.policy.eval()
    return offline_pass(models, examples, accelerator, pad_id, train=False, **offline_settings(args))[0].metrics(
        prefix="val_")


def offline_settings(args: Args) -> dict:
    """The flags of an SFT or DPO pass (rl/offline.py)."""
    return dict(dpo=args.algo == "dpo", micro_batch_size=args.micro_batch_size, beta=args.offline_args.beta,
                offload_reference=args.model_args.offload_reference)


# ----------------------------------------------------------------------------------------------
# AgentEvol: AgentGym's self-evolution


def evolve(args: Args, accelerator, mixed: str, limits: dict[str, Limits]) -> Path:
    """--algo agentevol, AgentGym's self-evolution. Iteration 0 learns --data alone (behaviour cloning);
    each later one explores --explore-tasks of the train split (--n episodes each) with the current
    policy, keeps the episodes that reached --threshold, retrains on --data plus those (from --model, or
    going on with --retrain-from continue), and plays the test split. One metrics line per iteration;
    its model is checkpoints/step_<iteration>, its explored episodes are in rollouts.jsonl. Unlike AgentGym's, it
    explores --n times a task at the run's temperature (AgentGym's script explores greedily, do_sample False, which
    would make a task's samples identical), and can go on from the last iteration's weights (AgentGym: the base).
    Episodes play under `limits`; each iteration's weights reach the engine once, before its test split."""
    run_dir = run_directory(accelerator, args.run_args, f"{'+'.join(args.env)}-{args.algo}")
    offline = args.offline_args
    expert, validation = held_out(read_data(offline.data, args.env, args.layout_args.agent), offline.validation,
                                  args.seed)
    tokenizer, fmt, models, limits = set_up(args, accelerator, limits)
    max_tokens = largest(limits).max_tokens  # (every env's: one set of limits takes no --env-limits of its own)
    initial = copy.deepcopy(models.optimizer.state_dict()), copy.deepcopy(models.scheduler.state_dict())
    held = examples_of(fmt, validation, max_tokens)

    # -- the tasks explored and tested, envs to play them on, the engine
    explore_ids = {name: spread(ids, offline.explore_tasks) if offline.explore_tasks else ids
                   for name, ids in tasks_by_env(args.train_tasks, args.env, "train").items()}
    test_ids = test_tasks(args.test_tasks, args.env, args.eval_tasks)
    played = {name: max(len(explore_ids[name]) * args.n, len(test_ids[name])) for name in args.env}
    environments = args.env_args.make_pool(instances(played, args.gen_batch_size, accelerator.num_processes), 1,
                                           accelerator.process_index, args.seed)
    engine = engine_of(args, fmt, models, accelerator, limits)
    config = run_config(flags.flat(args), run_dir, False, accelerator, mixed, engine, environments[0])
    if accelerator.is_main_process:
        print(f"run {run_dir.name}: agentevol on {args.model} ({args.preset} preset), {offline.iterations} iterations "
              f"exploring {sum(map(len, explore_ids.values()))} tasks x {args.n}, {len(expert)} expert episodes "
              f"({len(validation)} held out), testing on {sum(map(len, test_ids.values()))} tasks x {args.eval_k} "
              f"after every iteration -> {run_dir}")
    logs = logs_of(args, run_dir, config, accelerator, {})
    try:
        for iteration in range(offline.iterations + 1):
            start = time.perf_counter()
            explored, kept = [], []
            if iteration > 0:  # explore with the last iteration's policy (the engine has it), keep the successes
                explored = play_share(engine, fmt, environments, explore_ids, args.n, args, accelerator, limits)
                kept = [to_record(t) for t in explored if t.error is None
                        and (t.reward >= offline.threshold if offline.threshold is not None else t.success)]
                if offline.retrain_from == "base":
                    restart(models, args.model, bool(args.model_args.lora_rank), accelerator, initial)
            examples = examples_of(fmt, expert + kept, max_tokens)
            steps = offline_steps(len(examples), offline.batch_size, args.epochs, args.steps)
            for step in tqdm(range(1, steps + 1), desc=f"iteration {iteration}", leave=False, dynamic_ncols=True,
                             disable=not accelerator.is_main_process):
                metrics = offline_step(models, examples, step, args, accelerator, fmt.pad_id)
                stop_on_nonfinite(models, None, args.max_nonfinite_updates, accelerator, run_dir, step)
            metrics |= validate(models, held, args, accelerator, fmt.pad_id)
            sync(engine, models.policy, accelerator, iteration)  # (its weights, for its tests and the next exploring)
            evaluation, evaluated = evaluate(engine, fmt, environments, test_ids, args, accelerator, limits, iteration)
            metrics |= evaluation | {
                "evol/iteration": iteration, "evol/buffer": len(kept), "evol/explored": len(explored),
                "evol/explore_success": sum(t.success for t in explored) / max(len(explored), 1),
                "evol/conversations": len(examples), "sft/steps": steps,
                "perf/step_s": time.perf_counter() - start, "charts/step": iteration}
            logs.write(iteration, metrics, evol_line(iteration, metrics), evaluations=evaluated,
                       rollouts=[{"step": iteration, **t.log_record()} for t in explored])
            save_checkpoint(accelerator, models, engine, tokenizer, run_dir / "checkpoints" / f"step_{iteration}",
                            iteration, logs, args.run_args.keep_checkpoints)
    finally:
        close(engine, environments, logs)
    return finish(run_dir, accelerator)


# ----------------------------------------------------------------------------------------------
# Flags: the preset that applies, what a resumed run may change, and the settings that cannot work


def preset_defaults(preset: str, known) -> Args:
    """The defaults of `preset` as they apply to the run that the peeked flags `known` (--algo, --env, --agent)
    describe: the offline programs' learning rates and one turn cap, the tiny preset's task sets and tool turns."""
    default = replace(PRESETS[preset], preset=preset)
    own = EMBEDDED_OWN.get(embedded_of(known.model), {}) if preset == "tiny" else {}
    if own:  # (an embedded model's own turns: ScalingInter-RL from half of them, as tiny-agent's 3 then 6)
        default = replace(default, horizon=(own["horizon"] // 2, own["horizon"]), max_new_tokens=own["max_new_tokens"])
    if (preset, known.algo) in OFFLINE_LR:  # (and one turn cap: ScalingInter-RL's stages are steps of RL)
        default = replace(default, lr=OFFLINE_LR[preset, known.algo], horizon=default.horizon[-1:])
    tiny_tasks = [TINY_TASKS[name] for name in known.env if name in TINY_TASKS] if preset == "tiny" else []
    if tiny_tasks:  # (with several envs, the others play their splits: rl/tasks.py's tasks_by_env)
        (train, test), = tiny_tasks
        default = replace(default, train_tasks=str(envs.DATA_DIR / train), test_tasks=str(envs.DATA_DIR / test))
    if preset == "tiny" and set(known.env) - set(TINY_TASKS):
        default = replace(default, eval_tasks=TINY_EVAL_TASKS)
    return replace(default, **EMBEDDED_TOOLS) if preset == "tiny" and known.agent == "tools" else default


def parse_args(argv: list[str] | None = None) -> Args:
    """train.py's flags over the preset that applies, or a resumed run's own settings (rl/flags.py)."""
    return flags.parse_args(Args, PRESETS, preset_defaults, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rl.freeze_heap()  # (what the imports made: no garbage)
    try:
        main(parse_args())
    except EngineStalled as error:  # one sentence, not a traceback
        raise SystemExit(str(error)) from None
    except KeyboardInterrupt:  # (during an RL run main says where to resume from)
        stopped("train.py: stopped by Ctrl-C")
    except RuntimeError as error:  # --deterministic on a GPU: an op without a deterministic kernel, in one sentence
        stop_on_nondeterministic(error)
        raise
