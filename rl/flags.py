"""train.py's flags: the preset that applies (parse_args, preset_of), what a resumed run may change (RESUMABLE,
resumed_args), the settings that cannot work (check); and an Args with flag groups in it, read and changed by the
flags' own names (flat, replace, build).

    args = parse_args(Args, PRESETS, preset_defaults, argv, description)   # train.py's parse_args
    args = replace(args, deterministic=True, steps=4)   # a flag of a group (EngineArgs) and one of Args, by name
    args = build(eval.Args, model="tiny-agent", env_url=("http://host:8000",))   # likewise, over the defaults
    config = flat(args)                                  # config.json: one level, every flag by its name

A flag group is a dataclass of flags next to the code that reads them, with its own `check`: EnvArgs
(envs/guard.py), LayoutArgs (rl/agent.py) and EngineArgs (rl/engines/setup.py), which train.py and eval.py share,
and train.py's ModelArgs (rl/model.py), OfflineArgs (rl/data.py), PlanArgs (rl/memory.py), RunArgs (rl/run.py),
TrainerEngineArgs; eval.py's APIArgs (rl/engines/api.py). A script's Args nests them with GROUP, tyro's empty
prefix, so every flag keeps its name (--env-url, not --env-args.env-url) and config.json stays flat: old runs
still resume and eval.py still reads config["max_new_tokens"]. `check` here holds the rules across groups and on
train.py's own flags. train.py's Args and PRESETS are passed in: this module must not import train.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Callable

import tyro

import envs
from rl import advantages as adv_lib
from rl.horizon import AUTO, LADDER, caps_of
from rl.limits import Limits, check as check_limits, env_limits, largest
from rl.model import EMBEDDED
from rl.run import find_checkpoint, resumable_config, run_of
from rl.tasks import Mix, env_names, tasks_by_env

# A nested flag group's fields are flags of their own names: `env_args: Annotated[EnvArgs, GROUP] = field(...)`.
GROUP = tyro.conf.arg(name="")

# The programs that learn from trajectory files (--data) rather than from their own rollouts.
OFFLINE = ("sft", "dpo", "agentevol")

# What a resumed run may change: how long it goes on, how it is logged and checkpointed, the engine
# that samples and its sizing (for another GPU; the samples then differ from an uninterrupted run's),
# and the env infrastructure (where the env server is, how long a call may take, what stops the run).
# Everything else is the run's own setting, so that it continues as it started, in its own directory.
RESUMABLE = ("steps", "epochs", "save_every", "keep_checkpoints", "log_rollouts_every", "track", "wandb_project", "gen_batch_size", "resume",
             "out_dir", "engine", "vllm_dtype", "vllm_gpu_memory_utilization", "vllm_max_model_len",
             "vllm_tensor_parallel_size", "vllm_sleep", "sync_tolerance", "rollout_server", "env_timeout", "env_url", "env_delay", "max_error_rate",
             "max_nonfinite_updates")


# ----------------------------------------------------------------------------------------------
# An Args with groups in it, by the flags' names


def flat(args) -> dict:
    """Every flag's value by its name, a group's flags where the group is: what config.json holds."""
    out = {}
    for f in fields(args):
        value = getattr(args, f.name)
        out |= flat(value) if is_dataclass(value) else {f.name: value}
    return out


def replace(args, **changes):
    """dataclasses.replace by the flags' names: a group's flags change inside their group (a group by its own name:
    the whole group)."""
    inner = {}
    for f in fields(args):
        group = getattr(args, f.name)
        if is_dataclass(group) and f.name not in changes:
            mine = {g.name: changes.pop(g.name) for g in fields(group) if g.name in changes}
            inner[f.name] = replace(group, **mine) if mine else group
    return dataclasses.replace(args, **inner, **changes)


def build(Args: type, **values):
    """An `Args` of its defaults and `values`, by the flags' names (as a command line gives them)."""
    return replace(Args(), **values)


# ----------------------------------------------------------------------------------------------
# The preset that applies, and a resumed run's own settings


def parse_args(Args: type, presets: dict, preset_defaults: Callable, argv: list[str] | None, description: str):
    """tyro over the preset that applies: `tiny` for the embedded model, `paper` otherwise (`preset_defaults(preset,
    known)`: the preset as it applies to the run the peeked flags `known` describe); when resuming, over the run's own
    settings."""
    argv = sys.argv[1:] if argv is None else argv
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model", default=Args.model)
    peek.add_argument("--preset", default="auto")
    peek.add_argument("--algo", default=Args.algo)
    peek.add_argument("--env", nargs="+", default=list(presets["tiny"].env))
    peek.add_argument("--agent", default=Args().layout_args.agent)
    peek.add_argument("--resume", default=None)
    peek.add_argument("--run-name", "--run_name", dest="run_name", default=None)  # (tyro takes both spellings)
    peek.add_argument("--out-dir", "--out_dir", dest="out_dir", default=Args().run_args.out_dir)
    peek.add_argument("--steps", default=None)
    peek.add_argument("--epochs", default=None)
    known, _ = peek.parse_known_args(argv)
    known.env = env_names(known.env)
    if known.steps is not None and known.epochs is not None:  # (a preset's or a resumed run's steps are not given)
        raise SystemExit("--steps and --epochs both set how long the run is (--epochs N: N passes over the train "
                         "split, or over --data): give one")
    checkpoint = find_checkpoint(known.resume, known.out_dir, known.run_name) if known.resume else None
    if checkpoint is not None:
        return resumed_args(Args, presets, argv, checkpoint, description)
    preset = known.preset if known.preset != "auto" else preset_of(known.model)
    if preset not in presets:
        raise SystemExit(f"unknown preset {preset!r}; choose one of: auto, {', '.join(presets)}")
    default = preset_defaults(preset, known)
    args = tyro.cli(Args, args=argv, default=default, description=description)
    args = replace(args, env=env_names(args.env))
    if args.horizon == (AUTO,):  # (the ladder it climbs, written out in the run's config)
        args = replace(args, horizon=(AUTO, *(default.horizon if len(default.horizon) > 1 else LADDER)))
    return replace(args, preset=preset, **preset_tasks(args, default))


def preset_tasks(args, default) -> dict[str, str]:
    """A task file given for some of the run's envs (--train-tasks, --test-tasks) leaves the preset's in force for the
    others: beside a TextCraft file the tiny preset's BabyAI levels stay BabyAI's, not its whole split. The preset's
    file is joined after the given one (envs.load_tasks), so that the run's config says what each env played."""
    kept = {}
    for flag in ("train_tasks", "test_tasks"):
        given, own = getattr(args, flag, None), getattr(default, flag, None)
        if not given or not own or given == own:
            continue
        try:
            named = envs.load_tasks(given, args.env)
            left = [name for name, ids in envs.load_tasks(own, args.env).items() if ids and not named.get(name)]
        except envs.TaskFileError:  # (a bad file: check_envs says so)
            continue
        if left and not (os.pathsep in given and Path(given).is_file()):  # (a `:` in a file's name: it stays alone)
            kept[flag] = os.pathsep.join((given, own))
    return kept


def embedded_of(model: str) -> str | None:
    """The embedded model `model` is, or that the run it is a checkpoint of trained (through runs of runs: SFT then
    GRPO), else None: whose own rollout settings (rl/model.py's EMBEDDED_OWN) the tiny preset takes."""
    for _ in range(16):  # (a chain of runs, each from the last's checkpoint; a loop of configs ends here)
        if model in EMBEDDED:
            return model
        config = run_of(model)
        if config is None:
            return None
        model = config.get("model", "")
    return None


def preset_of(model: str) -> str:
    """`--preset auto`: tiny for the embedded model and for a checkpoint of a run that used it (so that SFT
    then GRPO on the tiny model chain without flags), the run's own for any other run's checkpoint, else
    paper."""
    config = run_of(model)
    if config is not None:
        return config.get("preset", "paper")
    return "tiny" if model in EMBEDDED else "paper"


def resumed_args(Args: type, presets: dict, argv: list[str], checkpoint: Path, description: str):
    """The run's settings from its config.json, with the flags of this command line that RESUMABLE
    allows; any other flag that differs stops the run, naming it."""
    config = unread_dropped(resumable_config(checkpoint))
    preset = presets[config.get("preset", "paper")]
    saved = replace(preset, **{name: tuple(config[name]) if isinstance(config[name], list) else config[name]
                               for name in flat(preset) if name in config} | {"env": env_names(config.get("env", preset.env))})
    # (a dict flag's saved entries as tyro's default would turn it into one flag per entry: parsed over an empty one,
    # the run's own where the command line gives none)
    dicts = {name: value for name, value in flat(saved).items() if isinstance(value, dict) and value}
    args = tyro.cli(Args, args=argv, default=replace(saved, **{name: {} for name in dicts}), description=description)
    args = replace(args, resume=str(checkpoint), env=env_names(args.env),
                   **{name: value for name, value in dicts.items() if not flat(args)[name]})
    if args.horizon == (AUTO,) and saved.horizon[0] == AUTO:  # (`auto` alone: the ladder the run wrote out, as parse_args)
        args = replace(args, horizon=saved.horizon)
    if args.steps != saved.steps and args.epochs == saved.epochs:  # --steps replaces the run's --epochs
        args = replace(args, epochs=None)
    now, then = flat(args), flat(saved)
    # (a task file as given, which the run joined with its preset's: preset_tasks)
    joined = {name: then[name] for name in ("train_tasks", "test_tasks") if now.get(name) and then.get(name)
              and then[name].startswith(now[name] + os.pathsep)}
    if joined:
        args = replace(args, **joined)
        now = flat(args)
    changed = [name for name in now if name not in RESUMABLE and now[name] != then[name]]
    if changed:
        given = ", ".join(f"--{name.replace('_', '-')} {now[name]} (the run's: {then[name]})" for name in changed)
        raise SystemExit(f"--resume continues the run with its own settings, and this command line changes {given}. "
                         f"Drop those flags, or start a new run; on resume only "
                         f"{', '.join('--' + n.replace('_', '-') for n in RESUMABLE)} may change.")
    return args


# ----------------------------------------------------------------------------------------------
# The settings that cannot work


def check(args, world: int, distributed: str = "NO") -> None:
    """Stop early, with what to do, on train.py's settings that cannot work (`args`: its Args, whose class holds the
    defaults; `distributed`: Accelerate's distributed type, NO, MULTI_GPU, FSDP, DEEPSPEED, ...)."""
    if distributed == "MEGATRON_LM":
        raise SystemExit("train.py does not run under Megatron-LM: shard with FSDP2 (configs/fsdp2.yaml) or DeepSpeed "
                         "ZeRO-3 (configs/zero3.yaml), or launch data-parallel (configs/ddp.yaml)")
    if distributed in ("FSDP", "DEEPSPEED") and args.algo == "agentevol":
        raise SystemExit("agentevol resets the policy in place between iterations, which a sharded model does not "
                         "support here: run it data-parallel (configs/ddp.yaml) or on one GPU")
    for flag in ("steps", "tasks_per_step", "n", "max_new_tokens", "ppo_epochs", "minibatches", "micro_batch_size",
                 "max_nonfinite_updates"):
        if getattr(args, flag) < 1:  # 0 would silently skip every rollout or update
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.epochs is not None and args.epochs < 1:
        raise SystemExit("--epochs must be at least 1")
    args.plan_args.check()
    args.run_args.check()
    if not 0 <= args.max_error_rate <= 1:
        raise SystemExit("--max-error-rate is a share of a step's trajectories, in [0, 1]")
    args.env_args.check(args.env)
    check_tasks(args)
    check_estimator(args)
    if args.max_new_tokens >= args.max_tokens:
        raise SystemExit("--max-new-tokens must be smaller than --max-tokens")
    check_horizon(args)
    limits = env_limits(args)  # (each env's: rl/limits.py)
    check_env_limits(args, limits)
    args.engine_args.check(largest(limits).max_tokens)
    check_overlong(args.overlong_penalty, limits)
    args.model_args.check(args.algo, distributed)
    args.objective.check(args.algo not in OFFLINE, args.max_staleness is not None)
    if args.eval_every < 0 or args.eval_tasks < 0 or args.eval_k < 1:
        raise SystemExit("--eval-every and --eval-tasks take 0 (never, all) or more, --eval-k 1 or more")
    for name in args.env:
        args.layout_args.check(name, args.algo)
    if args.algo in OFFLINE:
        return check_offline(args, world)
    check_rollouts(args, world)


def check_tasks(args) -> None:
    """--env, its weights and its task files."""
    for name in args.env:
        envs.check_env(name)
    if args.env_weights and args.algo in OFFLINE:
        raise SystemExit(f"--env-weights shares RL steps' tasks between envs; --algo {args.algo} learns from --data")
    if args.env_weights and len(args.env) == 1:
        raise SystemExit("--env-weights shares a step's tasks between several envs: give them to --env too")
    Mix.of(args.env, args.env_weights, args.tasks_per_step)  # (each env at least one task a step)
    args.env_args.check_urls(args.env)
    for flag in ("train_tasks", "test_tasks"):
        try:  # (read again where they are played; a bad file stops here, before anything loads)
            if getattr(args, flag):
                tasks_by_env(getattr(args, flag), args.env, "train")
        except envs.TaskFileError as error:
            raise SystemExit(f"--{flag.replace('_', '-')}: {error}") from None


def unread_dropped(config: dict) -> dict:
    """A run's config.json without the estimator flags its --algo does not read: a run from before the estimators
    owned their flags (rl/advantages.ESTIMATORS) could be given one (--lam with grpo), which did nothing, and which
    check_estimator now refuses. Said in one line where one had a value of its own."""
    algo = adv_lib.ESTIMATORS.get(config.get("algo"))
    unread = {name for e in adv_lib.ESTIMATORS.values() for name in e.flags} - set(algo.flags if algo else ())
    defaults = {f.name: f.default for f in fields(adv_lib.EstimatorArgs)}
    given = sorted(name for name in unread if name in config and config[name] != defaults.get(name))
    if given:
        print(f"note: the run's {', '.join('--' + n.replace('_', '-') for n in given)} went unread by --algo "
              f"{config.get('algo')} and is dropped on resume")
    return {name: value for name, value in config.items() if name not in unread}


def check_estimator(args) -> None:
    """The flags of --algo's estimator and loss: each used only where it means something (rl/advantages.ESTIMATORS
    says what each estimator has and which flags it reads)."""
    estimator = adv_lib.ESTIMATORS.get(args.algo)  # (None: an offline program)
    if args.n < 2 and estimator and estimator.grouped:
        raise SystemExit(f"{args.algo} compares the samples of a task with each other: use --n 2 or more")
    own = args.estimator_args
    for f in fields(own):  # (a flag at its default is not given)
        value = getattr(own, f.name)
        if value != f.default and not (estimator and f.name in estimator.flags):
            flag = f"--{'no-' if value is False else ''}{f.name.replace('_', '-')}"
            raise SystemExit(f"{flag} is read only by --algo {adv_lib.names(lambda e: f.name in e.flags, 'or')}, not "
                             f"by --algo {args.algo}: drop it or change --algo")
    if own.step_weight < 0:
        raise SystemExit(f"--step-weight {own.step_weight:g}: gigpo's omega weighs the turn-level advantage, 0 (none) "
                         "or more")
    if own.gamma is not None and not 0 < own.gamma <= 1:
        raise SystemExit(f"--gamma {own.gamma:g} is a discount: give one in (0, 1]")
    if not own.whiten_per_env and len(args.env) == 1:
        raise SystemExit("--no-whiten-per-env whitens the advantages of every env of a run together: give it with "
                         "several --env")
    if args.dynamic_sampling < 0 or args.dynamic_sampling and not (estimator and estimator.grouped):
        raise SystemExit(f"--dynamic-sampling plays again the task groups whose advantages are all 0, which only the "
                         f"estimators that compare a task's samples ({adv_lib.names(lambda e: e.grouped, 'and')}) give "
                         "a group on its own: give 1 round or more with one of them")
    if args.dynamic_sampling and args.horizon[0] == AUTO:
        raise SystemExit("--horizon auto reads each step's success and the share its cap cut, which --dynamic-sampling "
                         "skews (it replays the groups without signal, most of them all successes or all failures): "
                         "give the caps instead")
    if args.dynamic_sampling and args.layout_args.agent == "reflect":
        raise SystemExit("--agent reflect's attempts are played in turn, each a set of its own: train it without "
                         "--dynamic-sampling")
    if (args.overlong_penalty or args.overlong_mask) and estimator is None:
        raise SystemExit(f"--overlong-penalty and --overlong-mask shape the rewards of RL's episodes; --algo {args.algo} "
                         "learns from trajectory files")
    if args.critic_warmup > 1 and not (estimator and estimator.critic):
        raise SystemExit(f"--critic-warmup trains only the critic for a while, and --algo {args.algo} has none: "
                         f"use it with --algo {adv_lib.names(lambda e: e.critic, 'or')}")
    if estimator and estimator.critic and args.model_args.mixed_precision == "fp16":
        raise SystemExit(f"--algo {args.algo} steps two optimizers, which fp16's loss scaling does not support here: "
                         "use --mixed-precision bf16")


def check_overlong(text: str | None, limits: dict[str, Limits]) -> None:
    """--overlong-penalty's L below every env's token budget (`limits`: the run's envs', at its start within the model's
    context window too), or a SystemExit that says which."""
    buffer, _ = overlong_of(text)
    budget = min(own.max_tokens for own in limits.values())
    if buffer >= budget:
        raise SystemExit(f"--overlong-penalty {text}: L must be below the token budget ({budget} tokens: --max-tokens, "
                         "or the model's context window where smaller)")


def overlong_of(text: str | None) -> tuple[int, float]:
    """--overlong-penalty L:P as (L, P); (1, 0.0) when not given (no penalty); a SystemExit for anything else."""
    if text is None:
        return 1, 0.0
    try:
        buffer, penalty = text.split(":")
        buffer, penalty = int(buffer), float(penalty)
    except ValueError:
        raise SystemExit(f"--overlong-penalty {text}: give L:P, the last L tokens of the budget and the most an "
                         "episode's score loses there, e.g. 1024:1") from None
    if buffer < 1 or not penalty > 0:
        raise SystemExit(f"--overlong-penalty {text}: L is 1 token or more, P above 0")
    return buffer, penalty


def check_horizon(args) -> None:
    """--horizon: caps of at least 1 that only grow, `auto` before them or not at all, and its rule's settings."""
    caps = caps_of(args.horizon)
    if not caps or min(caps) < 1 or args.horizon_every < 1:
        raise SystemExit("--horizon takes one or more turn caps of at least 1 (after `auto`, when given), "
                         "--horizon-every at least 1 step")
    if AUTO in args.horizon[1:]:
        raise SystemExit(f"--horizon {' '.join(map(str, args.horizon))}: `auto` goes first, then the caps it climbs "
                         "(e.g. --horizon auto 10 20 30)")
    if list(caps) != sorted(caps):
        raise SystemExit(f"--horizon {' '.join(map(str, args.horizon))}: ScalingInter-RL's stages only grow")
    if args.horizon_patience < 1 or not 0 <= args.horizon_cut <= 1:
        raise SystemExit("--horizon-patience takes 1 step or more, --horizon-cut a share in [0, 1]")
    if args.horizon[0] == AUTO and args.algo in OFFLINE:
        raise SystemExit(f"--horizon auto grows the turn cap over steps of RL; --algo {args.algo} takes one cap")


def check_env_limits(args, limits: dict[str, Limits]) -> None:
    """Each env's `limits` (--env-limits over the run's): ones that can work, and the same for every env where the
    episodes all take one cap (reflect's attempts, the offline programs)."""
    check_limits(limits)
    differ = [name for name, own in limits.items() if own != limits[args.env[0]]]
    if differ and (args.algo in OFFLINE or args.layout_args.agent == "reflect"):  # (one cap for all: caps_for)
        raise SystemExit(f"--env-limits gives {', '.join(differ)} limits of their own, which "
                         f"{'--agent reflect' if args.algo not in OFFLINE else '--algo ' + args.algo} does not play "
                         f"(its episodes all take {args.env[0]}'s): drop them")
    if args.algo in OFFLINE and any(len(own.horizon) > 1 for own in limits.values()):
        raise SystemExit(f"--env-limits: --algo {args.algo} takes one turn cap an env (ScalingInter-RL's stages and "
                         "--horizon auto are steps of RL)")


def check_rollouts(args, world: int) -> None:
    """check()'s part for RL: the tasks' split over processes, the asynchronous loop's and the mismatch's flags, the
    micro-batches."""
    if args.offline_args.data or args.offline_args.experience:
        raise SystemExit(f"--data and --experience are what sft, dpo and agentevol learn from; --algo {args.algo} "
                         "learns from its own rollouts")
    if args.tasks_per_step % world:
        raise SystemExit(f"--tasks-per-step {args.tasks_per_step} must be divisible by the {world} processes")
    if args.max_staleness is not None and args.max_staleness < 0:
        raise SystemExit("--max-staleness takes 0 (the asynchronous loop, no staleness) or more")
    if args.max_staleness is not None and args.layout_args.agent == "reflect":
        raise SystemExit("--agent reflect's attempts wait for each other's reflections: train it without --max-staleness")
    if args.group_start == "fork" and args.fork_turns < 1:
        raise SystemExit(f"--fork-turns {args.fork_turns}: a group branches after 1 turn or more (at its reset every "
                         "episode is in one state already: --group-start reset)")
    if args.group_start == "fork" and args.layout_args.agent == "reflect":
        raise SystemExit("--agent reflect plays each attempt as a rollout of its own, which does not fork: train it with "
                         "--group-start reset")
    if args.group_start == "fork":
        check_forks(args.env, args.env_args)
    trajectories = args.tasks_per_step // world * args.n
    micro_batches = (trajectories + args.micro_batch_size - 1) // args.micro_batch_size
    if args.max_tokens_per_micro_batch < 0 or args.pack and not args.max_tokens_per_micro_batch:
        raise SystemExit("--pack fills rows of --max-tokens-per-micro-batch tokens: give that too (e.g. 16384)")
    if args.max_tokens_per_micro_batch and trajectories < args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} is more than the {trajectories} trajectories each process has")
    if not args.max_tokens_per_micro_batch and micro_batches < args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} is more than the {micro_batches} micro-batches of "
                         f"--micro-batch-size {args.micro_batch_size} that each process has")


def check_offline(args, world: int) -> None:
    """check()'s part for sft, dpo and agentevol."""
    args.offline_args.check(args.algo, world)
    if args.max_staleness is not None:
        raise SystemExit(f"--max-staleness weighs the tokens of RL's rollouts; --algo {args.algo} learns from "
                         "trajectory files")
    if args.algo == "agentevol" and len(args.horizon) > 1:
        raise SystemExit("--horizon takes one turn cap with agentevol (ScalingInter-RL's stages are steps of RL)")
    if args.algo == "agentevol" and args.run_args.resume is not None:
        raise SystemExit("--resume does not continue an agentevol run yet: each iteration's model is in "
                         "runs/<run>/checkpoints/step_<iteration>; start a new run from it with --model")


def check_forks(names, env_args) -> None:
    """--group-start fork: stop, with what to do, when an env of the run cannot copy its state (envs.Env.fork: a JVM's
    simulator, a browser, an env server), asked of one fresh instance of each, made as the run makes them (its refusal
    starts nothing), before anything heavy."""
    for name in env_names(names):
        env = env_args.make_envs(name, 1)[0]
        try:
            env.fork().close()
        except NotImplementedError as error:
            raise SystemExit(f"--group-start fork plays a group's episodes on copies of one env, and {error}: train "
                             f"{name} with --group-start reset, or leave it out of --env") from None
        finally:
            env.close()
