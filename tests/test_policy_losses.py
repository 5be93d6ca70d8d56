"""Issue 47's losses and credit rules where a real run meets them: DAPO's overlong shaping on a batch worked by hand
and in a run that the token budget cuts; --policy-loss gspo and cispo with LoRA, several mini-batches and the
asynchronous loop; PPO's turn-level GAE in a run. (Each loss's formula: tests/test_losses.py; the packed and padded
layouts: tests/test_batch.py; turn-level GAE's unbiasedness: tests/test_advantages.py.)"""

import importlib.util
import json
import math

import pytest
import torch

import train
from rl.batch import make_batch, rows_of, shape_overlong
from rl.tasks import Mix, Redraw, step_tasks, tasks_by_env
from rl.records import decode_array
from rollout import Trajectory
from test_async import register_ragged, run


@pytest.fixture
def ragged(monkeypatch, tmp_path):
    register_ragged(monkeypatch, tmp_path)


def played(lengths_and_finish) -> list[Trajectory]:
    """One trajectory a (tokens, finish): a prompt of 4 tokens, then one sampled turn of the rest, score 1."""
    out = []
    for k, (length, finish) in enumerate(lengths_and_finish):
        traj = Trajectory("babyai", k, k // 2, k, messages=[], reward=1.0)
        traj.add([7] * 4)
        traj.add([9] * (length - 4), [-1.0] * (length - 4), trained=True)
        traj.finish = finish
        out.append(traj)
    return out


def test_overlong_shaping_by_hand():
    """Budget 100, L 20, P 0.5: 70 tokens is before the last 20 (no penalty), 90 halfway in (0.25), 99 at 19/20 of
    it, and an episode the budget ended loses all of P whatever its length; --overlong-mask drops only that one from
    the loss, every token of it, in full and in the micro-batches."""
    trajectories = played([(70, "done"), (90, "done"), (99, "horizon"), (95, "max_tokens")])
    rows, episodes = rows_of(trajectories)
    batch = make_batch(rows, 0, [[[0, 1]], [[2, 3]]], "cpu", episodes=episodes)
    shape_overlong(batch, rows, {"babyai": 100}, 20, 0.5, drop=True)
    assert batch.scores.tolist() == pytest.approx([1.0, 0.75, 1 - 0.5 * 19 / 20, 0.5])
    assert batch.full.loss_mask.sum(1).tolist() == [66, 86, 95, 0]
    assert [float(m.loss_mask.sum()) for m in batch.micro] == [66 + 86, 95]
    kept = make_batch(rows, 0, [[[0, 1]], [[2, 3]]], "cpu", episodes=episodes)
    shape_overlong(kept, rows, {"babyai": 100}, 20, 0.0, drop=True)  # (the mask alone: the scores stay)
    assert kept.scores.tolist() == [1.0] * 4 and kept.full.loss_mask[3].sum() == 0


@pytest.mark.parametrize("flags,message", [
    (["--overlong-penalty", "20"], "give L:P"),
    (["--overlong-penalty", "0:1"], "L is 1 token or more, P above 0"),
    (["--overlong-penalty", "9000:1"], "L must be below the token budget"),
    (["--algo", "sft", "--data", "x.jsonl", "--overlong-mask"], "shape the rewards of RL's episodes"),
    (["--gae-unit", "turn"], "--gae-unit is read only by --algo ppo, not by --algo grpo"),
    (["--dynamic-sampling", "2", "--horizon", "auto"], "--horizon auto reads each step's success"),
    (["--dynamic-sampling", "2", "--algo", "ppo"], "--dynamic-sampling plays again the task groups"),
])
def test_bad_shaping_flags_stop_with_a_sentence(flags, message, tmp_path):
    args = train.parse_args(["--out-dir", str(tmp_path), *flags])
    with pytest.raises(SystemExit, match=message):
        train.check(args, 1)


@pytest.mark.slow
def test_overlong_shaping_in_a_run_the_budget_cuts(ragged, tmp_path):
    """A GRPO step of two tasks, one whose episodes end in 2 turns (about 536 tokens: inside the last 300 of the
    budget of 780, penalised a little) and one in 3 after a prompt of about 714 tokens, which the budget ends after
    2 turns: with --overlong-mask their logged
    advantages are 0 (out of the loss) while the others train; the logged reward is the env's, unshaped."""
    metrics, rollouts = run(tmp_path, "overlong", "--engine", "hf", "--steps", "1", "--eval-every", "0",
                            "--max-tokens", "780", "--overlong-penalty", "300:1", "--overlong-mask", "--n", "8")
    capped = [r for r in rollouts if r["finish"] == "max_tokens"]
    assert capped and len(capped) < len(rollouts), [r["finish"] for r in rollouts]
    assert all(r["turns"] >= 1 and not any(decode_array(r["advantages"])) for r in capped)
    assert any(any(decode_array(r["advantages"])) for r in rollouts if r["finish"] == "done")
    assert metrics[-1]["rollout/reward"] == pytest.approx(sum(r["reward"] for r in rollouts) / len(rollouts))
    assert math.isfinite(metrics[-1]["losses/policy"])


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_policy_losses_train_with_lora_minibatches_and_staleness(policy_loss, ragged, tmp_path):
    """gspo and cispo through LoRA, two mini-batches (the second's ratio is not 1) and --max-staleness 1 (their
    importance weights composed with the loss): finite losses, a clip share in [0, 1], and the policy moves."""
    metrics, _ = run(tmp_path, policy_loss, "--engine", "hf", "--steps", "3", "--eval-every", "0",
                     "--policy-loss", policy_loss, "--lora-rank", "4", "--minibatches", "2", "--max-staleness", "1",
                     "--clip", "0.1")
    steps = metrics[1:] if metrics[0]["charts/step"] == 0 else metrics
    for m in steps:
        assert all(math.isfinite(m[key]) for key in ("losses/policy", "losses/grad_norm", "losses/kl"))
        assert 0 <= m["losses/clipfrac"] <= 1
    assert any(m["losses/grad_norm"] > 0 for m in steps) and any(m["losses/kl"] > 0 for m in steps[1:])
    assert any(m["async/staleness_max"] >= 1 for m in steps)


@pytest.mark.slow
def test_ppo_with_turn_level_gae_gives_a_turn_one_advantage(ragged, tmp_path):
    """--algo ppo --gae-unit turn in a run: every action token of a turn has its turn's advantage (so an episode has
    at most as many distinct ones as turns), where token-level GAE gives its tokens their own."""
    for unit in ("turn", "token"):
        metrics, rollouts = run(tmp_path, f"ppo-{unit}", "--engine", "hf", "--algo", "ppo", "--steps", "1",
                                "--eval-every", "0", "--gae-unit", unit)
        assert math.isfinite(metrics[-1]["losses/value"])
        distinct = [len(set(decode_array(r["advantages"]))) for r in rollouts]
        if unit == "turn":
            assert all(d <= r["turns"] for d, r in zip(distinct, rollouts))
        else:
            assert any(d > r["turns"] for d, r in zip(distinct, rollouts))


def test_turn_level_gae_reads_the_value_before_each_turn():
    """train.advantages_for with --gae-unit turn, lambda 0: turn 1's return is r_1 + V_2 (the critic's value at
    turn 2's first action token, the state before it), turn 2's its outcome; each turn's tokens share one advantage."""
    args = train.parse_args(["--algo", "ppo", "--gae-unit", "turn", "--gamma", "1", "--lam", "0"])
    traj = Trajectory("babyai", 0, 0, 0, messages=[], reward=1.0)
    traj.add([7] * 4)
    traj.add([9] * 3, [-1.0] * 3, trained=True)
    traj.add([7] * 2)
    traj.add([9] * 3, [-1.0] * 3, trained=True)
    rows, episodes = rows_of([traj])
    batch = make_batch(rows, 0, [[[0]]], "cpu", episodes=episodes)
    batch.full.old_values = torch.arange(12.0)[None] / 10 * batch.full.loss_mask  # (V_1 0.4, V_2 0.9)
    advantages, returns = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, None)
    assert returns[0].tolist() == pytest.approx([0] * 4 + [0.9] * 3 + [0] * 2 + [1.0] * 3)
    assert len(set(advantages[0, 4:7].tolist())) == 1 and len(set(advantages[0, 9:].tolist())) == 1
    assert advantages[0, 4] > advantages[0, 9]  # (before whitening 0.9 - 0.4 = 0.5 against 1 - 0.9 = 0.1)


def test_redraw_plays_again_only_the_groups_without_signal():
    """rl/tasks.Redraw under grpo: of four groups of two one-turn episodes, the one whose rewards differ is kept, and
    the one with an env failure (--max-error-rate must see it); the two that scored alike (GRPO's advantages all 0)
    play again on a task of their own env's split; the draw depends on (seed, process, step, round, group) alone, and
    stops after R rounds."""
    def episode(env, group, reward, error=None):
        traj = Trajectory(env, 0, group, 0, messages=[], reward=reward, turns=1)
        traj.add([1, 2])
        traj.add([3, 4], [-0.1, -0.2], trained=True)
        traj.error = error
        return traj

    played = [episode("babyai", 0, 1.0), episode("babyai", 0, 0.0), episode("babyai", 1, 0.0), episode("babyai", 1, 0.0),
              episode("textcraft", 2, 1.0), episode("textcraft", 2, 0.0, error="env died"),
              episode("textcraft", 3, 1.0), episode("textcraft", 3, 1.0)]
    ids = {"babyai": list(range(100, 200)), "textcraft": list(range(500, 600))}
    again = Redraw(ids, rounds=2, seed=1)(4, played)
    assert sorted(again) == [2, 3, 6, 7]
    assert again[2] == again[3] in ids["babyai"] and again[6] == again[7] in ids["textcraft"]
    assert Redraw(ids, rounds=2, seed=1)(4, played) == again  # (a resumed run draws the same)
    assert Redraw(ids, rounds=2, seed=1, process=1)(4, played) != again  # (another process's groups, other tasks)
    redraw = Redraw(ids, rounds=2, seed=1)
    assert redraw(4, played) and redraw(4, played) and redraw(4, played) == {}  # (2 rounds, then the set is taken)


@pytest.mark.slow
def test_dynamic_sampling_replays_groups_and_resumes_exactly(ragged, tmp_path):
    """--dynamic-sampling 2 on ragged episodes (a group scores alike unless some reply says "turn left"): groups are
    played again on tasks that are not the step's own, the steps log them, and a run stopped after step 1 and resumed
    logs what the uninterrupted one does, trajectory for trajectory."""
    flags = ["--engine", "hf", "--eval-every", "0", "--dynamic-sampling", "2", "--save-every", "1", "--resume", "auto"]
    whole_metrics, whole = run(tmp_path, "whole", *flags, "--steps", "3")
    assert sum(m["rollout/dynamic_groups"] for m in whole_metrics) > 0
    assert all(m["rollout/dynamic_rounds"] <= 2 for m in whole_metrics)
    mix = Mix.of(("ragged",), (), 2)
    own = {(step, task) for step in (1, 2, 3) for _, task in step_tasks(step, mix, mix.task_ids(None), 1)}
    assert any((r["step"], r["task_id"]) not in own for r in whole)  # (a redrawn group's task)
    run(tmp_path, "parts", *flags, "--steps", "1")
    parts_metrics, parts = run(tmp_path, "parts", *flags, "--steps", "3")
    timeless = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in whole_metrics]
    assert [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in parts_metrics] == timeless
    assert parts == whole


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_dynamic_sampling_under_staleness_keeps_the_bound(engine, ragged, tmp_path):
    """--dynamic-sampling with --max-staleness 1, on the round HF engine and the continuous vLLM one (turns resubmitted
    as envs answer): the groups played again are part of their own step's set, every turn sampled by weights within
    the bound, every step its quota of groups."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    metrics, rollouts = run(tmp_path, "async", "--engine", engine, "--eval-every", "0", "--dynamic-sampling", "2",
                            "--max-staleness", "1", "--steps", "3")
    assert sum(m["rollout/dynamic_groups"] for m in metrics) > 0
    assert all(record["step"] - 2 <= v <= record["step"] - 1 for record in rollouts for v in record["versions"])
    assert len(rollouts) == 3 * 2 * 4  # (every step its quota of groups: 2 tasks x 4)


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_policy_losses_train_on_segments_packed(policy_loss, ragged, tmp_path):
    """gspo and cispo where an episode trains as several sequences (--context window:1: a row a segment, GSPO's ratio
    a segment's), packed several a row, over two mini-batches: finite losses, and episodes of more than one segment."""
    metrics, rollouts = run(tmp_path, policy_loss, "--engine", "hf", "--steps", "2", "--eval-every", "0",
                            "--policy-loss", policy_loss, "--context", "window:1", "--pack",
                            "--max-tokens-per-micro-batch", "2048", "--minibatches", "2")
    assert any(r["segments"] > 1 for r in rollouts)
    for m in metrics:
        if "losses/policy" in m:
            assert math.isfinite(m["losses/policy"]) and math.isfinite(m["losses/grad_norm"]), m


@pytest.mark.slow
def test_dynamic_sampling_over_several_envs_draws_from_each_groups_own(ragged, tmp_path):
    """--dynamic-sampling in a run of two envs: a replayed group's new task is of its own env (each record's item id
    names the env it played), and every env keeps its quota of groups."""
    metrics, rollouts = run(tmp_path, "mix", "--engine", "hf", "--steps", "2", "--eval-every", "0", "--env", "ragged",
                            "babyai", "--tasks-per-step", "4", "--dynamic-sampling", "2", "--horizon", "2")
    assert sum(m["rollout/dynamic_groups"] for m in metrics) > 0
    config = json.loads((tmp_path / "mix" / "config.json").read_text())  # (the tiny preset's BabyAI tasks)
    splits = tasks_by_env(config["train_tasks"], ("ragged", "babyai"), "train")
    assert all(r["task_id"] in splits[r["item_id"].split("_")[0]] for r in rollouts)  # (ragged's are 121-520)
    for step in (1, 2):
        played = [r["item_id"].split("_")[0] for r in rollouts if r["step"] == step]
        assert played.count("ragged") == played.count("babyai") == 2 * 4
