"""One update of train.py on a fixed, hand-made batch, under however many processes launch it, data-parallel
or sharded:
    python -m torch.distributed.run --standalone --nproc_per_node N tests/ddp_update.py OUT_DIR
    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/fsdp2.yaml --num_processes N tests/cpu_fsdp.py \
        tests/ddp_update.py OUT_DIR                                    # FSDP2 (see tests/cpu_fsdp.py)
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
from accelerate import Accelerator  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import train  # noqa: E402
from rl.model import full_weights  # noqa: E402
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


def whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main(out_dir: Path) -> None:
    accelerator = Accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = trajectories()[rank * 6 // world:(rank + 1) * 6 // world]
    for name, flags in CASES.items():
        args = train.parse_args(["--tasks-per-step", "2", "--n", "3", "--micro-batch-size", "2", "--minibatches", "1",
                                 "--kl-coef", "0", *flags])
        models = train.build_models(args, accelerator, args.model)
        gradients = {}
        original = train.optimizer_step

        def recording(model, *rest):  # (a sharded gradient is gathered whole: every process calls this alike)
            gradients.update({name: whole(p.grad).detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()})
            return original(model, *rest)

        train.optimizer_step = recording
        batch = train.batch_of(mine, args, accelerator, pad_id=0)
        train.score_batch(models, batch, args, accelerator)
        advantages, returns = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok,
                                                   train.reducer(accelerator))
        train.attach(batch, advantages, returns)
        train.update(models, batch, args, accelerator, step=1)
        train.optimizer_step = original
        weights = {key: value.clone() for key, value in full_weights(accelerator.unwrap_model(models.policy))}
        if accelerator.is_main_process:
            save_file(gradients, str(out_dir / f"{name}.safetensors"))
        save_file(weights, str(out_dir / f"{name}_weights_{rank}.safetensors"))  # every process's whole model
        accelerator.free_memory()  # (the next case prepares a model of its own)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
