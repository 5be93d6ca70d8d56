"""Training launched over several processes on the CPU (gloo): data-parallel train.py, and the update under DDP,
FSDP2 and DeepSpeed ZeRO-3 equal to one process's; sharded runs checkpoint and resume exactly. (Apart from
tests/test_train.py so that the two files, each minutes long, run on different workers of the suite.)"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from rl.data import held_out, read_data
from rl.model import EMBEDDED
from tests import ddp_update

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_expert_data  # noqa: E402

@pytest.mark.slow
def test_two_processes_split_the_tasks_and_log_every_episode(tmp_path):
    """Data-parallel training (DDP over gloo on the CPU) with PPO, so a critic and whitening statistics
    summed over processes: each process plays its share of a step's tasks, gradients are averaged,
    and the main process logs every process's episodes. On two envs, 3 BabyAI tasks and 1 TextCraft a step, so that
    process 0's share holds no TextCraft task (it evaluates TextCraft on instances of its own), and PPO whitens each
    env's advantages with both processes' statistics."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py", "--",
               "--steps", "2", "--tasks-per-step", "4", "--n=2", "--horizon", "2", "--max-new-tokens", "16", "--algo", "ppo",
               "--warmup-steps", "4", "--critic-lr-warmup-steps", "4", "--critic-lr", "1e-3",
               "--env", "babyai", "textcraft", "--env-weights", "3", "1", "--eval-every", "2", "--eval-tasks", "2",
               "--out-dir", str(tmp_path), "--run-name", "ddp"]
    done = subprocess.run(command, cwd=Path(train.__file__).parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "ddp"
    assert json.loads((run_dir / "config.json").read_text())["processes"] == 2
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 * 2
    for step in (1, 2):
        items = [r["item_id"] for r in records if r["step"] == step]
        assert len(set(items)) == 4 and all(items.count(i) == 2 for i in items)  # 4 tasks, 2 samples each
        assert sorted(i.rpartition("_")[0] for i in set(items)) == ["babyai"] * 3 + ["textcraft"]
    assert (run_dir / "checkpoints" / "step_2" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [json.loads(line)["item_id"] for line in (run_dir / "evaluations.jsonl").read_text().splitlines()]
    assert len(evaluated) == 2 * 4 * 2 and len(set(evaluated)) == 4  # (2 test tasks of each env x --eval-k 2, twice)
    assert {i.rpartition("_")[0] for i in evaluated} == {"babyai", "textcraft"}
    assert {"eval/babyai/success", "eval/textcraft/success"} <= set(metrics[-1])
    metrics = [m for m in metrics if m["charts/step"] > 0]
    assert all(math.isfinite(m["losses/value"]) and m["losses/critic_grad_norm"] > 0 for m in metrics)  # PPO's critic, DDP too
    # warm-ups count optimizer steps, whatever the number of processes: (k + 1) / 4 after k steps
    lr = train.PRESETS["tiny"].model_args.lr
    assert [m["charts/lr"] for m in metrics] == pytest.approx([lr * 2 / 4, lr * 3 / 4])
    assert [m["charts/critic_lr"] for m in metrics] == pytest.approx([1e-3 * 2 / 4, 1e-3 * 3 / 4])


def launch(processes: int, *argv: str, config: str | None = None, mixed: str = "no") -> subprocess.CompletedProcess:
    """Run a script in `processes` CPU processes (gloo): data-parallel, or with an Accelerate launch config
    (configs/fsdp2.yaml: FSDP2, through tests/cpu_fsdp.py; configs/zero3.yaml: DeepSpeed ZeRO-3, which runs on CPU
    as it is, unless told to use the CPU: that would drop DeepSpeed)."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *argv]
    if config is not None:
        wrapper = ["tests/cpu_fsdp.py"] if "fsdp" in config else []
        if not wrapper:
            env.pop("ACCELERATE_USE_CPU")
        command = ["accelerate", "launch", "--config_file", config, "--num_processes", str(processes),
                   "--mixed_precision", mixed, "--main_process_port", "0", *wrapper, *argv]
    done = subprocess.run(command, cwd=Path(train.__file__).parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def one_process_update(tmp_path_factory) -> Path:
    """tests/ddp_update.py on one process: the update that each two-process launch below must equal."""
    out = tmp_path_factory.mktemp("one_process")
    launch(1, "tests/ddp_update.py", str(out))
    return out


@pytest.mark.slow
def test_two_process_update_equals_the_one_process_update(tmp_path, one_process_update):
    """The same mini-batch, played by one process or split over two (short trajectories on one, long
    ones on the other, and different numbers of sequences), gives the same gradient: the token and
    sequence means and the whitening run over the whole mini-batch, not per process; packed rows too, where one
    process pads with empty micro-batches to run as many as the other."""
    launch(2, "tests/ddp_update.py", str(tmp_path))
    for case in ddp_update.CASES:
        one, two = (load_file(out / f"{case}.safetensors") for out in (one_process_update, tmp_path))
        assert one.keys() == two.keys()
        for name in one:
            torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-7, msg=f"{case}: {name}")
    assert_nan_steps_skipped({one_process_update: 1, tmp_path: 2})


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["configs/fsdp2.yaml", "configs/zero3.yaml"])
def test_sharded_update_equals_the_one_process_update(tmp_path, one_process_update, sharding):
    """Two processes under FSDP2 or DeepSpeed ZeRO-3 (gloo), each holding half of every weight, gradient and Adam
    moment: the gathered gradient is the one-process gradient, and both processes end with identical whole weights,
    equal to the one-process run's."""
    launch(2, "tests/ddp_update.py", str(tmp_path), config=sharding)
    for case in ddp_update.CASES:
        one, two = (load_file(out / f"{case}.safetensors") for out in (one_process_update, tmp_path))
        assert one.keys() == two.keys()
        for name in one:
            torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-7, msg=f"{case}: {name}")
        single, first, second = (load_file(out / f"{case}_weights_{r}.safetensors")
                                 for out, r in ((one_process_update, 0), (tmp_path, 0), (tmp_path, 1)))
        assert all(torch.equal(first[name], second[name]) for name in first), case  # one model, sharded
        # Adam's first step moves a weight by lr g / (|g| + eps), about lr whatever |g|: where |g| is within a few eps
        # (1e-8) of 0, the gradients' float noise (within atol above) changes that step visibly (measured: 1-3 of
        # 920,704 weights by up to 1.4e-5), so there the weights only agree to the step's size
        lr = train.parse_args([]).model_args.lr
        for name, gradient in one.items():
            settled = gradient.abs() > 1e-6
            torch.testing.assert_close(first[name][settled], single[name][settled], rtol=0, atol=1e-6, msg=f"{case}: {name}")
            assert float((first[name] - single[name]).abs().max()) < lr, f"{case}: {name}"
    assert_nan_steps_skipped({one_process_update: 1, tmp_path: 2})


def assert_nan_steps_skipped(processes: dict[Path, int]) -> None:
    """tests/ddp_update.py's NaN cases, in each output directory of a launch on that many processes: every process
    skipped the step, and holds the initial weights."""
    initial = load_file(EMBEDDED["tiny-agent"] / "model.safetensors")
    for case, run, rank in ((c, r, k) for c in ddp_update.NAN_CASES for r, n in processes.items() for k in range(n)):
        assert float(load_file(run / f"{case}_skipped_{rank}.safetensors")["skipped"]) == 1, (case, run, rank)
        weights = load_file(run / f"{case}_weights_{rank}.safetensors")
        assert all(torch.equal(weights[name], initial[name]) for name in initial), (case, run, rank)


@pytest.mark.slow
@pytest.mark.parametrize("sharding, mixed", [("configs/fsdp2.yaml", "bf16"), ("configs/zero3.yaml", "bf16")])
def test_a_sharded_run_checkpoints_and_resumes_exactly(tmp_path, sharding, mixed):
    """train.py under FSDP2 or ZeRO-3 on two processes (PPO: the policy, the reference and the critic sharded; the HF
    engine samples from a whole copy synced after every update): the checkpoint holds the whole policy and each
    process's optimizer shards, and a run resumed from step 1 logs what the uninterrupted one did. Both under bf16, as
    on GPUs: FSDP2 under its precision policy (rl/model.fsdp2_precision: bf16 layers, fp32 log-probs and gradient
    reduction); DeepSpeed keeps bf16 weights and their fp32 originals in its optimizer, which the shards restore.
    Two envs, one task of each a step: each process plays one env, so PPO's whitening per env sums an env that a
    process has none of (every process must take part in every reduction, or the run hangs)."""
    argv = ["train.py", "--algo", "ppo", "--env", "babyai", "textcraft", "--n", "1", "--steps", "2",
            "--tasks-per-step", "2", "--horizon", "2",
            "--max-new-tokens", "16", "--eval-every", "0", "--engine", "hf", "--save-every", "1", "--out-dir",
            str(tmp_path), "--run-name", "sharded", "--mixed-precision", mixed, "--warmup-steps", "4",
            "--critic-lr-warmup-steps", "4"]
    launch(2, *argv, config=sharding, mixed=mixed)
    run_dir = tmp_path / "sharded"
    state = run_dir / "checkpoints" / "step_2" / "state"
    assert {p.name for p in state.glob("*optimizer*")} == {"optimizer_0.safetensors", "optimizer_1.safetensors",
                                                          "critic_optimizer_0.safetensors", "critic_optimizer_1.safetensors"}
    whole = load_file(run_dir / "checkpoints" / "step_2" / "model.safetensors")
    assert whole.keys() == load_file(EMBEDDED["tiny-agent"] / "model.safetensors").keys()
    uninterrupted = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    launch(2, "train.py", "--resume", str(run_dir / "checkpoints" / "step_1"), config=sharding, mixed=mixed)
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in resumed] == [1, 2]
    for key in ("rollout/reward", "rollout/babyai/reward", "rollout/textcraft/reward", "losses/kl", "losses/value",
                "losses/grad_norm", "critic/value", "charts/lr"):
        assert resumed[1][key] == uninterrupted[1][key], key
    lr = train.PRESETS["tiny"].model_args.lr  # the warm-ups step with the optimizers: (k + 1) / 4 after k steps
    assert [m["charts/lr"] for m in uninterrupted] == pytest.approx([lr * 2 / 4, lr * 3 / 4])
    assert [m["charts/critic_lr"] for m in uninterrupted] == pytest.approx([1e-3 * 2 / 4, 1e-3 * 3 / 4])


@pytest.mark.slow
def test_sharded_sft_runs_when_the_processes_have_unequal_shares(tmp_path):
    """SFT under ZeRO-3 on two processes whose shares of the held-out examples differ (an odd number of them): the
    process with fewer runs a blank micro-batch (every pass of a sharded model is collective: it would otherwise wait
    forever), which weighs nothing: the validation loss is the mean over all held-out action tokens, as on one
    process."""
    data = tmp_path / "expert.jsonl"
    make_expert_data.main(["--env", "babyai", "--limit", "16", "--horizon", "6", "--max-tokens", "1536", "--out", str(data)])
    records = read_data((str(data),), "babyai")
    share = next(v for v in (0.2, 0.3, 0.4, 0.5, 0.6) if len(held_out(records, v, 0)[1]) % 2 == 1)
    argv = ["--algo", "sft", "--data", str(data), "--steps", "1", "--batch-size", "2", "--micro-batch-size", "1",
            "--validation", str(share), "--eval-every", "0", "--out-dir", str(tmp_path)]
    train.main(train.parse_args([*argv, "--run-name", "one"]))  # one process: this one
    launch(2, "train.py", *argv, "--run-name", "two", config="configs/zero3.yaml")
    one, two = (json.loads((tmp_path / run / "metrics.jsonl").read_text()) for run in ("one", "two"))
    assert two["sft/val_tokens"] == one["sft/val_tokens"] > 0
    assert two["sft/val_loss"] == pytest.approx(one["sft/val_loss"], rel=1e-5)
