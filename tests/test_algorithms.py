"""Every algorithm trains on BabyAI from the command line: short runs of the embedded model that
complete, change the weights and log their algorithm's metrics; and the horizon schedule as the
training loop applies it, across a resume."""

import json
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import envs
from rl.agent import REACT
import train
from rl import advantages as adv_lib
from rl.logprobs import token_logprobs, token_values
from rl.batch import StepTensors, attach
from rl.limits import checkpoint_limits
from rl.model import EMBEDDED, build_models, load_tokenizer
from rollout import ChatFormat, Trajectory


def run(tmp_path, *flags):
    # the HF engine: these tests are about the algorithms, and it starts at once (vLLM runs in test_vllm.py,
    # test_train.py and every env's training test)
    steps = [] if "--epochs" in flags else ["--steps", "2"]  # (--epochs sets the steps; both at once are refused)
    args = train.parse_args(["--engine", "hf", *steps, "--tasks-per-step", "2", "--n", "2", "--horizon", "2",
                             "--max-new-tokens", "16", "--lr", "0.01", "--out-dir", str(tmp_path), "--run-name", "r", *flags])
    run_dir = train.main(args)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics


def weights_changed(run_dir, step=2):
    before = load_file(EMBEDDED["tiny-agent"] / "model.safetensors")
    after = load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in before)


FLAG_SETS = {
    "rloo": ["--algo", "rloo", "--kl-in-reward", "--kl-estimator", "k2", "--loss-agg", "seq-mean-token-sum"],
    "reinforce_pp": ["--algo", "reinforce_pp", "--gamma", "0.99", "--clip-high", "0.28", "--dual-clip", "3",
                     "--kl-estimator", "k1"],
    "dr_grpo": ["--algo", "grpo", "--no-grpo-scale", "--loss-agg", "token-mean", "--ppo-epochs", "2"],
    "ppo": ["--algo", "ppo", "--gamma", "0.99", "--lam", "0.95", "--critic-lr", "0.01"],
}


@pytest.mark.slow
@pytest.mark.parametrize("flags", list(FLAG_SETS.values())[:3], ids=list(FLAG_SETS)[:3])
def test_algorithm_runs_from_the_command_line(tmp_path, flags):
    run_dir, metrics = run(tmp_path, *flags)
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(list(m.values()))).all() for m in metrics)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == flags[1]


def response_logprobs(model, batch) -> torch.Tensor:
    """Each trajectory's summed log-prob of its action tokens [B]."""
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    return (logprobs * batch.loss_mask).sum(1)


@pytest.mark.parametrize("flags", list(FLAG_SETS.values()), ids=list(FLAG_SETS))
def test_an_update_moves_toward_the_rewarded_action(flags):
    """One step of train.py's update on two BabyAI tasks, each played twice: "turn left" rewarded,
    "go forward" not. With every algorithm and its options, the rewarded reply gains on the other;
    without a critic, it becomes more likely and the other less."""
    from accelerate import Accelerator

    torch.manual_seed(0)  # PPO's fresh value head
    args = train.parse_args([*flags, "--tasks-per-step", "2", "--n", "2", "--lr", "1e-3", "--micro-batch-size", "2",
                             "--minibatches", "1"])
    accelerator = Accelerator()
    models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
    tokenizer = load_tokenizer("tiny-agent")
    fmt = ChatFormat(tokenizer)
    env = envs.make("babyai")
    trajectories = []
    for group, task in enumerate((120, 161)):
        prompt = fmt.prompt(REACT.opening(env, env.reset(task)))
        for row, (action, reward) in enumerate([("turn left", 1.0), ("go forward", 0.0)]):
            traj = Trajectory("babyai", task, group, 2 * group + row, [], reward=reward)
            reply = fmt.encode(f"Thought: I will {action}.\nAction:\n{action}") + [fmt.end_of_turn]
            traj.add(prompt)
            traj.add(reply, [0.0] * len(reply), trained=True)
            trajectories.append(traj)
    batch = train.batch_of(trajectories, args, accelerator, fmt.pad_id)
    before = response_logprobs(models.policy, batch.full)
    train.old_logprobs(models, batch, args, accelerator)
    advantages, returns = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, None)
    attach(batch, advantages, returns)
    train.update(models, batch, args, accelerator, step=1)
    change = response_logprobs(models.policy, batch.full) - before
    rewarded = batch.scores == 1
    assert (change[rewarded] - change[~rewarded] > 0).all(), change  # in each group, rewarded vs not
    if args.algo != "ppo":  # PPO's fresh critic gives the shared "Thought: I will" tokens a net push down
        assert (change[rewarded] > 0).all() and (change[~rewarded] < 0).all(), change


@pytest.mark.slow
def test_ppo_trains_policy_and_critic(tmp_path):
    run_dir, metrics = run(tmp_path, "--algo", "ppo", "--n", "1", "--gamma", "0.99", "--lam", "0.95",
                           "--critic-lr", "0.01", "--critic-warmup", "2")
    assert weights_changed(run_dir)
    first, second = metrics
    # --critic-warmup 2, as upstream's critic_warmup 2: step 1 trains only the critic, and logs no policy losses
    assert not any(key.startswith("losses/") and "critic" not in key and "value" not in key
                   and key != "losses/nonfinite_updates" for key in first)
    assert "rollout/logprob_diff" not in first
    assert second["losses/grad_norm"] > 0
    assert all(m["losses/critic_grad_norm"] > 0 and m["losses/value"] > 0 for m in metrics)
    assert all("critic/value" in m and "critic/return" in m for m in metrics)
    # the critic's weights and optimizer travel with the checkpoint, for --resume
    state = run_dir / "checkpoints" / "step_2" / "state"
    critic = load_file(state / "critic.safetensors")
    assert critic["score.weight"].shape[0] == 1


@pytest.mark.slow
def test_a_resumed_ppo_run_gets_its_critic_back(tmp_path, monkeypatch):
    run_dir, _ = run(tmp_path, "--algo", "ppo", "--steps", "1", "--critic-lr", "0.01")
    saved = load_file(run_dir / "checkpoints" / "step_1" / "state" / "critic.safetensors")["score.weight"]
    seen = []
    original = train.update_critic

    def spy(models, *rest):
        seen.append(getattr(models.critic, "module", models.critic).score.weight.detach().clone())
        return original(models, *rest)

    monkeypatch.setattr(train, "update_critic", spy)
    run(tmp_path, "--algo", "ppo", "--steps", "2", "--critic-lr", "0.01", "--resume", str(run_dir / "checkpoints" / "step_1"))
    assert torch.equal(seen[0], saved)  # the critic the resumed run trains is the saved one, not a fresh head


@pytest.mark.slow
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
    config = json.loads((run_dir / "config.json").read_text())
    assert [checkpoint_limits(str(run_dir / "checkpoints" / f"step_{k}"), config, "babyai").horizon[0]
            for k in (1, 2, 3)] == [1, 2, 3]


def test_unknown_algorithm_is_rejected():
    with pytest.raises(SystemExit):
        train.parse_args(["--algo", "dpo-but-online"])


def test_steps_walk_shuffled_epochs_over_the_train_split():
    ids = list(range(100, 110))
    steps = [train.tasks_for(s, ids, 3, seed=1) for s in range(1, 7)]  # 3 steps per epoch, 1 task dropped
    assert all(len(t) == 3 for t in steps)
    first, second = sum(steps[:3], []), sum(steps[3:], [])
    assert len(set(first)) == 9 and len(set(second)) == 9  # no task twice within an epoch
    assert first != second  # a new order each epoch
    assert train.tasks_for(5, ids, 3, seed=1) == steps[4]  # a function of the step alone


@pytest.mark.slow
def test_epochs_set_the_number_of_steps(tmp_path):
    ids = tmp_path / "ids.json"
    envs.save_task_ids(ids, "babyai", list(range(120, 125)))  # 5 tasks, 2 per step: 2 steps per epoch
    run_dir, metrics = run(tmp_path, "--epochs", "1", "--train-tasks", str(ids), "--horizon", "1")
    assert [m["charts/step"] for m in metrics] == [1, 2]
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 2
    resumed = train.parse_args(["--resume", str(run_dir / "checkpoints" / "step_2"), "--steps", "3"])
    assert resumed.steps == 3 and resumed.epochs is None  # --steps on resume replaces the run's --epochs


@pytest.mark.parametrize("recipe", sorted((Path(train.__file__).parent / "scripts" / "recipes").glob("*_*.sh")),
                         ids=lambda p: p.stem)
def test_recipes_launch_valid_commands(recipe, tmp_path):
    """Each paper recipe, run with a stand-in `accelerate` that records its arguments, launches
    train.py on 8 processes with flags that parse and pass the start-up checks, data-parallel or with a
    launch config; flags given to the script come last and win."""
    (tmp_path / "accelerate").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    (tmp_path / "accelerate").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "ARGS_FILE": str(tmp_path / "args")}
    subprocess.run(["bash", str(recipe), "--save-every", "5"], env=env, check=True, timeout=60)
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[:4] == ["launch", "--num_processes", "8", "train.py"]
    args = train.parse_args(argv[4:])
    train.check(args, world=8)
    env_name, method = recipe.stem.split("_")
    assert args.env == (env_name,) and args.model == "Qwen/Qwen2.5-3B-Instruct" and args.preset == "paper"
    assert args.algo == "grpo" and args.model_args.lr == 1e-6 and args.objective.kl_coef == 0.001 and args.objective.entropy_coef == 0.001
    assert args.epochs and args.run_args.save_every == 5
    # what upstream's actor does whatever its scripts say: one pass, every trajectory weighing the same
    assert args.ppo_epochs == 1 and args.objective.loss_agg == "seq-mean-token-mean"
    assert (len(args.horizon) == 3) == (method == "scalinginter-rl")
    # sharded: LAUNCH names an Accelerate config, and the run passes the checks of an FSDP2 launch
    subprocess.run(["bash", str(recipe)], env=env | {"LAUNCH": "configs/fsdp2.yaml"}, check=True, timeout=60)
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[:6] == ["launch", "--config_file", "configs/fsdp2.yaml", "--num_processes", "8", "train.py"]
    train.check(train.parse_args(argv[6:]), world=8, distributed="FSDP")


class Ramp(torch.nn.Module):
    """A stand-in critic whose output at position i is i."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        positions = torch.arange(input_ids.shape[1], dtype=torch.float32)
        return types.SimpleNamespace(logits=positions.expand(input_ids.shape)[..., None])


def test_values_are_read_where_log_probs_are():
    """values[t] comes from position t - 1, the position whose logits give token t its log-prob."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.float32)
    values = token_values(Ramp(), torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6), mask)
    assert values.tolist() == [[0, 0, 1, 2, 0, 4]]


def step_batch():
    """A padded step batch of three trajectories: two healthy ones in one group, one that errored."""
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    full = StepTensors(input_ids=torch.zeros(3, 5, dtype=torch.long), loss_mask=mask,
                       old_logprobs=-torch.ones(3, 5) * mask, ref_logprobs=-2 * torch.ones(3, 5) * mask,
                       old_values=torch.zeros(3, 5))
    return full, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), torch.tensor([True, True, False])


def test_kl_in_reward_uses_old_and_reference_log_probs():
    full, scores, groups, ok = step_batch()
    args = train.parse_args(["--algo", "grpo", "--no-grpo-scale", "--kl-in-reward", "--kl-coef", "0.1",
                             "--kl-estimator", "k1"])
    advantages, _ = train.advantages_for(args, full, scores, groups, ok, None)
    # k1 = old - ref = 1 per action token: returns 1 - 0.1 * 3 = 0.7 and 0 - 0.1 * 3 = -0.3; the errored
    # trajectory stays out of the group (with it the mean would move)
    assert advantages[0, 1].item() == pytest.approx(0.5) and advantages[1, 1].item() == pytest.approx(-0.5)
    assert advantages[2].abs().sum() == 0
    args = train.parse_args(["--algo", "reinforce_pp", "--kl-in-reward", "--kl-coef", "0.1", "--kl-estimator", "k1"])
    raw = adv_lib.reinforce_pp(adv_lib.place_reward(scores, full.loss_mask) - 0.1 * full.loss_mask, full.loss_mask)
    torch.testing.assert_close(train.advantages_for(args, full, scores, groups, ok, None)[0], raw)


def test_errored_trajectories_stay_out_of_whitening():
    full, scores, groups, ok = step_batch()
    args = train.parse_args(["--algo", "ppo", "--n", "1"])
    with_error, returns = train.advantages_for(args, full, scores, groups, ok, None)
    healthy, _ = train.advantages_for(args, StepTensors(**{k: v[:2] for k, v in full.tensors().items()}), scores[:2],
                                      groups[:2], ok[:2], None)
    torch.testing.assert_close(with_error[:2], healthy)
    assert with_error[2].abs().sum() == 0 and returns[2].abs().sum() == 0
