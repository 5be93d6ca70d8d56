"""Every algorithm trains on BabyAI from the command line: short runs of the embedded model that
complete, change the weights and log their algorithm's metrics; and the horizon schedule as the
training loop applies it, across a resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

import train
from rl.model import EMBEDDED


def run(tmp_path, *flags):
    args = train.parse_args(["--steps", "2", "--tasks-per-step", "2", "--n", "2", "--horizon", "2",
                             "--max-new-tokens", "16", "--lr", "0.01", "--out-dir", str(tmp_path), "--run-name", "r", *flags])
    run_dir = train.main(args)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics


def weights_changed(run_dir, step=2):
    before = load_file(EMBEDDED["tiny-agent"] / "model.safetensors")
    after = load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("flags", [
    ["--algo", "rloo", "--kl-in-reward", "--kl-estimator", "k2", "--loss-agg", "seq-mean-token-sum"],
    ["--algo", "reinforce_pp", "--gamma", "0.99", "--clip-high", "0.28", "--dual-clip", "3", "--kl-estimator", "k1"],
    ["--algo", "grpo", "--no-grpo-scale", "--loss-agg", "seq-mean-token-mean", "--ppo-epochs", "2"],
], ids=["rloo", "reinforce_pp", "dr_grpo"])
def test_algorithm_trains(tmp_path, flags):
    run_dir, metrics = run(tmp_path, *flags)
    assert weights_changed(run_dir)
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(list(m.values()))).all() for m in metrics)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == flags[1]


def test_ppo_trains_policy_and_critic(tmp_path):
    run_dir, metrics = run(tmp_path, "--algo", "ppo", "--n", "1", "--gamma", "0.99", "--lam", "0.95",
                           "--critic-lr", "0.01", "--critic-warmup", "1")
    assert weights_changed(run_dir)
    first, second = metrics
    assert first["losses/grad_norm"] == 0 and second["losses/grad_norm"] > 0  # step 1: only the critic learns
    assert all(m["losses/critic_grad_norm"] > 0 and m["losses/value"] > 0 for m in metrics)
    assert all("critic/value" in m and "critic/return" in m for m in metrics)
    # the critic's weights and optimizer travel with the checkpoint, for --resume
    state = run_dir / "checkpoints" / "step_2" / "state"
    critic = load_file(state / "model_1.safetensors")
    assert critic["score.weight"].shape[0] == 1


def test_horizon_schedule_in_the_loop_survives_a_resume(tmp_path):
    schedule = ["--horizon", "1", "2", "3", "--horizon-every", "1", "--save-every", "1"]
    run_dir, _ = run(tmp_path, *schedule, "--steps", "1")
    run(tmp_path, *schedule, "--steps", "3", "--resume", str(run_dir / "checkpoints" / "step_1"))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == [1, 2, 3]
    assert [m["rollout/horizon"] for m in metrics] == [1, 2, 3]
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    for record in records:  # a cap, never a floor: an episode may end sooner
        assert record["turns"] <= record["step"]


@pytest.mark.parametrize("argv, message", [
    (["--horizon", "20", "10"], "only grow"),
    (["--horizon", "0"], "at least 1"),
    (["--dual-clip", "0.5"], "larger than 1"),
    (["--algo", "rloo", "--n", "1"], "--n 2 or more"),
])
def test_bad_algorithm_settings_stop_early(argv, message):
    with pytest.raises(SystemExit) as stop:
        train.check(train.parse_args(argv), world=1)
    assert message in str(stop.value)


def test_unknown_algorithm_is_rejected():
    with pytest.raises(SystemExit):
        train.parse_args(["--algo", "dpo-but-online"])
