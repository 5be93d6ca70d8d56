"""One update of train.py on a fixed, hand-made batch, under however many processes launch it:
    python -m torch.distributed.run --standalone --nproc_per_node N tests/ddp_update.py OUT_DIR
Six trajectories in two groups, split contiguously over the processes: three short ones (3 action
tokens, rewards 1, 0, and an env error, so no outcome) and three long ones (40 action tokens, rewards
0, 1, 1). Split over two processes, one holds 4 action tokens in 2 sequences and the other 120 in 3.
For each algorithm and loss aggregation the main process writes the policy's gradient of the first
optimizer step to OUT_DIR/<algo>_<aggregation>.safetensors, so that a two-process update can be
compared with a one-process update on the same data."""

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


def main(out_dir: Path) -> None:
    accelerator = Accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = trajectories()[rank * 6 // world:(rank + 1) * 6 // world]
    for algo, aggregation in [(a, g) for a in ("grpo", "reinforce_pp") for g in ("token-mean", "seq-mean-token-mean")]:
        args = train.parse_args(["--algo", algo, "--tasks-per-step", "2", "--n", "3", "--micro-batch-size", "2",
                                 "--minibatches", "1", "--kl-coef", "0", "--loss-agg", aggregation])
        models = train.build_models(args, accelerator, args.model)
        gradients = {}
        original = train.optimizer_step

        def recording(model, *rest):
            gradients.update({name: p.grad.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()})
            return original(model, *rest)

        train.optimizer_step = recording
        batch = train.make_batch(mine, pad_id=0, micro_batch_size=args.micro_batch_size, device=accelerator.device)
        train.score_batch(models, batch, args, accelerator)
        advantages, returns = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok,
                                                   train.reducer(accelerator))
        train.attach(batch, advantages, returns)
        train.update(models, batch, args, accelerator, step=1)
        train.optimizer_step = original
        if accelerator.is_main_process:
            save_file(gradients, str(out_dir / f"{algo}_{aggregation}.safetensors"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
