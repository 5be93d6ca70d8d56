"""A run's directory and everything train.py writes there, and reads back to resume:

    runs/<run>/config.json         every setting, and what it ran on (written once; eval.py reads it too)
    runs/<run>/metrics.jsonl       a line of metrics per step; rollouts.jsonl, evaluations.jsonl: episodes (Logs)
    runs/<run>/checkpoints/step_<k> a model directory with the full training state (rl/checkpoint.py's layout)
    runs/<run>/failed_step_<k>.jsonl a step's episodes when too many of them ended in an env failure (the run stops)

Resuming restores the samplers' random state and takes the run's own settings; upstream re-seeds and takes
whatever the command line says. At the end (finish) the held-out comparison of the first and last evaluations
is printed, and the curves drawn (rl/plots.py). Every program of train.py sets up alike (set_up: tokenizer, chat
format, models, context limit) and says what it runs in one line (start_line).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from safetensors.torch import load_file, save_file
from tqdm import tqdm

from envs.guard import close_envs
from rl import checkpoint as checkpoint_lib
from rl import plots
from rl import zero3
from rl.model import sharded
from rl.progress import STOPPED, stopped
from rl.records import read_metrics
from rl.scores import gain
from rl.trajectory import Trajectory

CONFIG = "config.json"


@dataclass
class RunArgs:
    """Where train.py's run is written, what it keeps and where it is logged, and the run it resumes (its flags,
    nested in train.py's Args under their own names)."""

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

    def save_due(self, step: int, last: int) -> bool:
        """Whether step `step` of a run of `last` steps saves a checkpoint: the last, and every --save-every."""
        return step == last or bool(self.save_every and step % self.save_every == 0)

    @property
    def resuming(self) -> bool:
        """Whether the run goes on from a checkpoint (`auto` without one yet: a new run under --run-name)."""
        return self.resume not in (None, "auto")

    def check(self) -> None:
        """Stop early, with what to do, on settings that cannot work."""
        if self.keep_checkpoints < 0:
            raise SystemExit("--keep-checkpoints takes 0 (all) or more")
        if self.log_rollouts_every < 1:
            raise SystemExit("--log-rollouts-every must be at least 1")


# ----------------------------------------------------------------------------------------------
# The run directory and its config.json


def file_safe(name: str) -> str:
    """`name` as one file or directory name: what a path would read otherwise (an env spec's ':' and '/', as in
    openenv:http://host:8000 or gym:pkg.mod:Class) as '-'; babyai+textcraft-grpo stays as it is."""
    return re.sub(r"[^\w.+-]+", "-", name).strip("-")


def run_directory(accelerator, run: RunArgs, prefix: str) -> Path:
    """Where the run writes, the same on every process: <out_dir>/<run_name>, by default <prefix>-<time>. A resumed
    run (from checkpoint --resume) goes on in its own directory (from a checkpoint older than its newest,
    the newer ones and a copy of the logs are moved aside first); a new one refuses a directory that holds another run
    (its logs would mix), unless --resume auto restarts it."""
    from accelerate.utils import broadcast_object_list

    if run.resuming:
        run_dir = Path(run.resume).parent.parent
        if accelerator.is_main_process and (aside := checkpoint_lib.supersede(run_dir, Path(run.resume), Logs.FILES)):
            print(f"{run.resume} is older than the run's newest checkpoint: the newer ones, and a copy of the logs "
                  f"before they are cut back to this checkpoint, are now in {aside}")
        accelerator.wait_for_everyone()
        return run_dir
    name = [run.run_name or f"{file_safe(prefix)}-{time.strftime('%Y%m%d-%H%M%S')}"]
    run_dir = Path(run.out_dir) / broadcast_object_list(name)[0]  # one timestamp for every process
    if (run_dir / CONFIG).exists():
        if run.resume != "auto":
            raise SystemExit(f"{run_dir} already holds a run: continue it with --resume auto --run-name {run_dir.name}, "
                             "or choose another --run-name")
        if accelerator.is_main_process:
            print(f"--resume auto: {run_dir} has no complete checkpoint yet; the run starts over")
    return run_dir


def run_config(settings: dict, run_dir: Path, resuming: bool, accelerator, mixed: str, engine, env) -> dict:
    """The run's config.json: every setting (`settings`: each flag's value by its name, rl/flags.flat), and what it
    ran on. Written once, when the run starts; a resumed run keeps it (it runs with those settings), and its wandb run."""
    config = {**settings, "run_name": run_dir.name, "mixed_precision": mixed, "processes": accelerator.num_processes,
              "engine_used": engine.name if engine is not None else None,
              "env_settings": env.options if env is not None else {},  # every setting in effect, defaults too
              "wandb_id": os.urandom(6).hex()}  # (not the seeded random: a new run must not reuse an old id)
    if resuming:
        return config | {"wandb_id": json.loads((run_dir / CONFIG).read_text()).get("wandb_id")}
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_lib.write_atomic(run_dir / CONFIG, json.dumps(config, indent=2) + "\n")
    return config


def run_of(checkpoint: str | Path) -> dict | None:
    """The config of the run a checkpoint belongs to (runs/<run>/checkpoints/step_<k>), if it is one's: what
    eval.py plays it with, and what --preset auto takes from it."""
    path = Path(checkpoint)
    config = path.parent.parent / CONFIG
    if path.is_dir() and path.parent.name == "checkpoints" and config.is_file():
        return json.loads(config.read_text())
    return None


def resumable_config(checkpoint: Path) -> dict:
    """The config of the run that `checkpoint` (--resume) continues, once it is checked to be a checkpoint that can."""
    config_file = checkpoint.parent.parent / CONFIG
    if not (checkpoint / checkpoint_lib.STATE).is_file() or not config_file.is_file():
        raise SystemExit(f"--resume {checkpoint}: not a checkpoint of a run (runs/<run>/checkpoints/step_<k>, "
                         "with the run's config.json two levels up), nor a run directory, nor `auto`")
    if not (checkpoint / "state" / "schedulers.json").is_file():
        raise SystemExit(f"--resume {checkpoint}: a checkpoint from before training state was saved as safetensors "
                         "(its state/ held pickles); its weights load with --model or eval.py, but it cannot be resumed")
    config = json.loads(config_file.read_text())
    if isinstance(config.get("env_url"), str):  # a run from before --env-url took several servers
        config["env_url"] = [config["env_url"]]
    if isinstance(config.get("env_timeout"), (int, float)):  # a run from before --env-timeout took ENV=SECONDS
        config["env_timeout"] = [f"{config['env_timeout']:g}"] if config["env_timeout"] else []
    return config


def code_revision() -> str:
    """The git commit the code ran at (eval.py's results say it), "+dirty" when tracked files had changed; "unknown"
    outside a checkout."""
    here = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=here, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if commit.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")


def find_checkpoint(resume: str, out_dir: str, run_name: str | None) -> Path | None:
    """The checkpoint --resume names: itself, a run directory's newest complete one, or with `auto` the
    newest of <out_dir>/<run_name> (None when it has none yet: a new run starts)."""
    if resume == "auto":
        if not run_name:
            raise SystemExit("--resume auto continues the run named by --run-name: give one")
        found = checkpoint_lib.checkpoints(Path(out_dir) / run_name)
        return found[-1] if found else None
    path = Path(resume)
    if (path / CONFIG).is_file() and not (path / checkpoint_lib.STATE).is_file():  # a run directory
        found = checkpoint_lib.checkpoints(path)
        if not found:
            raise SystemExit(f"--resume {path}: the run has no complete checkpoint yet (start it again with "
                             f"--resume auto --run-name {path.name} --out-dir {path.parent})")
        return found[-1]
    return path


# ----------------------------------------------------------------------------------------------
# Logs and the start line's evaluations


def eval_due(step: int, every: int, last: int) -> bool:
    """--eval-every's steps: every k-th, and the last."""
    return every > 0 and (step % every == 0 or step == last)


def logged_steps(run_dir: Path, start_step: int) -> list[dict]:
    """The metrics rows of a resumed run's steps before `start_step` (read before this run appends to the log)."""
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    return [row for row in rows if "rollout/horizon" in row and row.get("charts/step", start_step) < start_step]


def evaluation_plan(tasks: int, k: int, every: int, start: int, last: int, initial: bool) -> str:
    """What the run's evaluations will play, for its start line, e.g. "evaluating 16 test tasks x 2 at steps 0 and
    16": `tasks` x `k` (--eval-k) at the `initial` policy (step 0, RL only) and at --eval-every's steps (`every`) from
    `start` to the `last`."""
    steps = [0] * initial + [s for s in range(start, last + 1) if eval_due(s, every, last)]
    if not tasks or not steps:
        return "no evaluation (--eval-every 0)" if not every else "no evaluation left"
    head = steps[:-1] if len(steps) <= 4 else steps[:3] + ["..."]
    at = f"s {', '.join(map(str, head))} and {steps[-1]}" if len(steps) > 1 else f" {steps[0]}"
    return f"evaluating {tasks} test tasks x {k} at step{at}"


class Logs:
    """The run's record on the main process: rollouts.jsonl (every trajectory trained on or explored),
    evaluations.jsonl (every test episode of --eval-every), metrics.jsonl, wandb with --track, and a line
    of the main metrics per step. Silent on the other processes.

    Each step's lines are appended and fsynced; a checkpoint records how long the logs were when it was
    taken (`sizes`), and a resumed run cuts them back to that (`resume_sizes`; {} for a new run), so
    that a step redone after a crash appears once, and a line torn by the crash not at all."""

    FILES = ("rollouts.jsonl", "evaluations.jsonl", "metrics.jsonl")

    def __init__(self, run_dir: Path, config: dict, active: bool, resume_sizes: dict[str, int],
                 wandb_project: str | None = None):
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
        if wandb_project is not None:  # (--track)
            import wandb

            if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
                os.environ["WANDB_MODE"] = "offline"
                print(f"wandb: no API key configured, logging offline to {run_dir}/wandb (wandb sync to upload)")
            # one wandb run for the whole run, however often it resumes (wandb ignores re-logged steps)
            self.tracker = wandb.init(project=wandb_project, name=config["run_name"], config=config,
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


# ----------------------------------------------------------------------------------------------
# Checkpoints: save and resume (rl/checkpoint.py: the layout, atomic writes, the optimizers and random state)


def save_checkpoint(accelerator, models, engine, tokenizer, path: Path, step: int, logs: Logs, keep: int) -> None:
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


def resume(accelerator, models, engine, run: RunArgs) -> dict:
    """Restore the training state, this process's random state and its sampler from the checkpoint --resume names (the
    policy's and critic's weights were loaded from it by build_models); returns its trainer_state.json, and a new
    run's state ({"step": 0, "logs": {}}) when the run does not resume."""
    if not run.resuming:
        return {"step": 0, "logs": {}}
    checkpoint = Path(run.resume)
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
    # none from fewer processes, or from another engine; vLLM keeps one only under --deterministic (sft and dpo may
    # have no engine)
    restored = engine is None or engine.load_state_dict(load_file(str(sampler)) if sampler.is_file() else {})
    if not rng.is_file() or not restored:
        print(f"{checkpoint}: process {accelerator.process_index} continues without the "
              f"{'sampler' if rng.is_file() else 'random and sampler'} state of the run"
              + (f" ({engine.name} engine)" if engine is not None else "")
              + ": its samples will differ from an uninterrupted run's")
    models.nonfinite_streak = trainer_state.get("nonfinite_streak", {})
    return trainer_state


# ----------------------------------------------------------------------------------------------
# What stops a run early (rl/optimizer.py: NaN and infinite losses)


def stop_on_env_failures(trajectories: list[Trajectory], max_error_rate: float, accelerator, run_dir: Path,
                         step: int) -> None:
    """Stop every process, naming the errors, when more than `max_error_rate` (--max-error-rate) of the step's
    trajectories (over all processes) ended in an env failure: a broken env must not quietly train the model on
    what is left. The step's episodes are written to failed_step_<k>.jsonl for a look."""
    from accelerate.utils import gather_object

    failed = [t.error for t in trajectories if t.error is not None]
    counts = gather_object([(len(failed), len(trajectories))])
    errors, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if errors <= max_error_rate * total:
        return
    records = gather_object([{"step": step, **t.log_record()} for t in trajectories])
    if accelerator.is_main_process:
        checkpoint_lib.write_atomic(run_dir / f"failed_step_{step}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    common = collections.Counter(r["error"] for r in records if r["error"]).most_common(3)
    message = (f"step {step}: {errors} of {total} trajectories ended in an env failure, more than --max-error-rate "
               f"{max_error_rate}; most common: " + "; ".join(f"{n} x {e}" for e, n in common)
               + f". The episodes are in {run_dir / f'failed_step_{step}.jsonl'}; fix the env (or raise "
               "--max-error-rate) and continue with --resume auto")
    accelerator.wait_for_everyone()  # (the file is written before any process exits)
    raise SystemExit(message if accelerator.is_main_process else 1)


def stopped_run(run_dir: Path, main_process: bool) -> NoReturn:
    """Ctrl-C stopped the run: one line, naming the newest complete checkpoint (one is written whole or not at all,
    rl/checkpoint.py) and the flags that go on from it."""
    if not main_process:  # (the others stop without a word)
        raise SystemExit(STOPPED)
    found = checkpoint_lib.checkpoints(run_dir)
    again = f"--resume auto --run-name {run_dir.name} --out-dir {run_dir.parent}"
    stopped("stopped by Ctrl-C: " + (f"continue from {found[-1]} with {again}" if found else
                                     f"no checkpoint yet (--save-every); {again} starts the run over"))


# ----------------------------------------------------------------------------------------------
# The end of a run


def held_out_line(run_dir: Path) -> str | None:
    """The run's first evaluation (step 0: the initial policy) against its last, on the same test tasks:
    success before and after, the gain and its 95% confidence interval (rl/scores.py's `gain`), and with several
    envs each env's on a line of its own; None unless the run evaluated at step 0 and later."""
    path = run_dir / "evaluations.jsonl"
    steps: dict[int, list] = collections.defaultdict(list)
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record.get("final", True):  # (--agent reflect: an episode is its last attempt)
            steps[record["step"]].append(types.SimpleNamespace(task_id=record["item_id"], success=record["success"]))
    last = max(steps, default=0)
    if 0 not in steps or last == 0:
        return None

    def compared(before: list, after: list, what: str) -> str:
        result = gain(before, after)
        interval = (f"95% CI {result['low']:+.3f} to {result['high']:+.3f}" if result["low"] is not None
                    else "no interval from one task")
        return (f"{what} {result['before']:.3f} -> {result['after']:.3f} ({result['gain']:+.3f}, {interval}; "
                f"{result['tasks']} test tasks x {len(after) / result['tasks']:g} episodes, step 0 vs step {last})")

    def env(episode) -> str:
        return episode.task_id.rpartition("_")[0]

    names = sorted({env(t) for t in steps[last]})
    lines = [compared(steps[0], steps[last], "held-out success" + (" (every env's tasks)" if len(names) > 1 else ""))]
    if len(names) > 1:
        lines += [compared([t for t in steps[0] if env(t) == name], [t for t in steps[last] if env(t) == name],
                           f"  {name}:") for name in names]
    return "\n".join(lines)


def close(engine, environments: list, logs: Logs | None, pool=None, rollouts=None) -> None:
    """What a program opened, closed, also when a stop or an error ends it: no JVM or browser left behind (the
    rollouts under way first: rollout.py's Rollouts.close)."""
    if rollouts is not None:
        rollouts.close()
    if pool is not None:
        pool.shutdown()
    if engine is not None:  # (sft and dpo without --eval-every sample nothing)
        engine.close()
    close_envs(environments)
    if logs is not None:  # (a stop before the logs were opened)
        logs.close()


def finish(run_dir: Path, accelerator) -> Path:
    """The end of a run: its held-out comparison and its curves, then Accelerate's teardown."""
    if accelerator.is_main_process:
        line = held_out_line(run_dir)
        if line is not None:
            print(line)
        curves = plots.draw(run_dir)
        print(f"done: {run_dir}" + (f" (curves: {curves})" if curves else ""))
    accelerator.end_training()
    return run_dir
