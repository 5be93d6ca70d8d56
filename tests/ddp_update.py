"""One update of train.py on a fixed, hand-made batch, under however many processes launch it, data-parallel
or sharded:
    python -m torch.distributed.run --standalone --nproc_per_node N tests/ddp_update.py OUT_DIR
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/fsdp2.yaml --num_processes N tests/cpu_fsdp.py \
        tests/ddp_update.py OUT_DIR                                    # FSDP2 (see tests/cpu_fsdp.py)
    accelerate launch --config_file configs/zero3.yaml --num_processes N --mixed_precision no \
        tests/ddp_update.py OUT_DIR                                    # DeepSpeed ZeRO-3 (gloo without a GPU)
Six trajectories in two groups, split contiguously over the processes: three short ones (3 action
tokens, rewards 1, 0, and an env error, so no outcome) and three long ones (40 action tokens, rewards
0, 1, 1). Split over two processes, one holds 4 action tokens in 2 sequences and the other 120 in 3.
For each case (algorithm and loss aggregation, and packed micro-batches) the main process writes the
policy's gradient of the first optimizer step (gathered whole when sharded) to OUT_DIR/<case>.safetensors, and
every process the whole model after the update to OUT_DIR/<case>_weights_<process>.safetensors, so that a
two-process update can be compared with a one-process update on the same data."""

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rl  # noqa: F401,E402 - before torch (see rl/__init__.py)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import train  # noqa: E402
from rl import losses  # noqa: E402
from rl import optimizer as optimizer_lib  # noqa: E402
from rl import zero3  # noqa: E402
from rl.batch import attach  # noqa: E402
from rl.model import build_models, full_weights, make_accelerator  # noqa: E402
from rollout import Trajectory  # noqa: E402


def trajectories() -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for row, (actions, reward, group) in enumerate([(3, 1.0, 0), (3, 0.0, 0), (3, 0.0, 0), (40, 0.0, 1), (40, 1.0, 1),
                                                    (40, 1.0, 1)]):
        traj = Trajectory("babyai", row, group, row, messages=[], reward=reward, error="step failed" if row == 2 else None)
        traj.add([rng.randrange(10, 500) for _ in range(20)])  # the prompt
        traj.add([rng.randrange(10, 500) for _ in range(actions)], [-1.0] * actions, trained=True)
        out.append(traj)
    return out


# each case's flags; "packed": rows of at most 70 tokens hold the three short trajectories (23 tokens each)
# together and each long one (60) alone, so the two processes need 1 and 3 micro-batches, and the first adds 2
# empty ones
CASES = {f"{algo}_{aggregation}": ["--algo", algo, "--loss-agg", aggregation]
         for algo in ("grpo", "reinforce_pp") for aggregation in ("token-mean", "seq-mean-token-mean")}
CASES["packed"] = ["--algo", "grpo", "--loss-agg", "seq-mean-token-mean", "--max-tokens-per-micro-batch", "70", "--pack"]
# the optimizer step skipped, every process alike, when only the first process's first micro-batch (not the last of
# the mini-batch: gradients accumulate after it) has a NaN loss ("nan_gradient": its gradient is NaN too) or a NaN
# statistic ("nan_loss": its gradient stays finite); OUT_DIR/<case>_skipped_<process> holds the count of skipped steps
NAN_CASES = {"nan_gradient": ["--algo", "grpo"], "nan_loss": ["--algo", "grpo"]}


def gradient(parameter):
    """A parameter's whole gradient: gathered when sharded (every process calls this alike)."""
    if hasattr(parameter, "ds_id"):  # a ZeRO-3 partition
        return zero3.full_grad(parameter)
    return parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad


def poison(case: str, rank: int) -> None:
    """The first process's first micro-batch of the update: its policy loss NaN, or only counted as not finite."""
    real_update, real_loss, calls = train.update_policy, losses.policy_loss, []

    def nan_loss(*args, **kwargs):
        loss, clipped = real_loss(*args, **kwargs)
        return loss * float("nan"), clipped

    def update_policy(models, micro, counts, args, accelerator):
        calls.append(micro)
        first = rank == 0 and len(calls) == 1
        losses.policy_loss = nan_loss if first and case == "nan_gradient" else real_loss
        loss, sums, finite = real_update(models, micro, counts, args, accelerator)
        losses.policy_loss = real_loss
        return loss, sums, finite and not first  # (for nan_gradient it already is not)

    train.update_policy = update_policy


def main(out_dir: Path) -> None:
    accelerator, _ = make_accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = trajectories()[rank * 6 // world:(rank + 1) * 6 // world]
    for name, flags in (CASES | NAN_CASES).items():
        args = train.parse_args(["--tasks-per-step", "2", "--n", "3", "--micro-batch-size", "2", "--minibatches", "1",
                                 "--kl-coef", "0", *flags])
        models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
        gradients = {}
        original = optimizer_lib.optimizer_step

        def recording(model, *rest):  # (a sharded gradient is gathered whole: every process calls this alike)
            gradients.update({name: gradient(p).detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()})
            return original(model, *rest)

        optimizer_lib.optimizer_step = recording
        batch = train.batch_of(mine, args, accelerator, pad_id=0)
        train.old_logprobs(models, batch, args, accelerator)
        advantages, returns = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok,
                                                   optimizer_lib.reducer(accelerator))
        attach(batch, advantages, returns)
        plain = train.update_policy
        if name in NAN_CASES:
            poison(name, rank)
        sums, _ = train.update(models, batch, args, accelerator, step=1)
        optimizer_lib.optimizer_step, train.update_policy = original, plain
        if name in NAN_CASES:
            save_file({"skipped": torch.tensor(float(sums.nonfinite_updates))},
                      str(out_dir / f"{name}_skipped_{rank}.safetensors"))
        weights = {key: value.clone() for key, value in full_weights(accelerator.unwrap_model(models.policy))}
        if accelerator.is_main_process:
            save_file(gradients, str(out_dir / f"{name}.safetensors"))
        save_file(weights, str(out_dir / f"{name}_weights_{rank}.safetensors"))  # every process's whole model
        del models, batch, gradients, weights, sums, advantages, returns, recording
        accelerator.free_memory()  # (the next case prepares a model of its own)
        rl.freeze_heap()  # (what is left lives on: the next case's collection scans only what that case makes)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
