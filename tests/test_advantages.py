"""Advantage estimators against numbers worked out by hand, on multi-turn masks: action tokens
(mask 1) in several turns, separated by observation tokens (mask 0) that must stay transparent; and
the recipe for adding one (docs/algorithms.md), followed."""

import dataclasses
import json
import math

import pytest
import torch

from rl.advantages import (ESTIMATORS, AdvantageInputs, Estimator, _within_groups, gae, grpo, masked_whiten,
                           place_reward, per_token, reinforce_pp, rloo)

# Two turns of one trajectory: [prompt, act, act, obs, obs, act(last), obs]
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 0]], dtype=torch.float32)


def test_grpo_hand_example():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # group 1: rewards 0.9, 0.3  -> mean 0.6, unbiased std sqrt(0.18) = 0.42426
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    a = grpo(scores, groups)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(0.18)
    expected = [0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6), 0.5 / (s0 + 1e-6), 0.3 / (s1 + 1e-6), -0.3 / (s1 + 1e-6)]
    assert a.tolist() == pytest.approx(expected, rel=1e-6)
    assert a.tolist()[:2] == pytest.approx([0.866024, -0.866024], rel=1e-5)


def test_grpo_groups_are_independent_of_order_and_unscaled_variant():
    scores = torch.tensor([0.3, 1.0, 0.9, 0.0])
    groups = torch.tensor([1, 0, 1, 0])
    a = grpo(scores, groups, scale=False)  # Dr. GRPO: centred only
    assert a.tolist() == pytest.approx([-0.3, 0.5, 0.3, -0.5])


@pytest.mark.parametrize("estimator", [grpo, rloo])
def test_equal_rewards_and_lone_samples_give_zero(estimator):
    a = estimator(torch.tensor([1.0, 1.0, 1.0, 0.7]), torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(a).all()
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rloo_hand_example():
    # group 0: 1 - (0 + 0 + 1)/3 = 2/3, 0 - 2/3 = -2/3; group 1: 0.9 - 0.3 = 0.6, 0.3 - 0.9 = -0.6
    a = rloo(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.3]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert a.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.6, -0.6])
    # the same as (s - mean) * n / (n - 1)
    assert a[:4].tolist() == pytest.approx([(s - 0.5) * 4 / 3 for s in (1, 0, 0, 1)])


def test_advantage_lands_on_action_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    out = per_token(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 2, 2, 0, 0, 2], [0, -1, -1, 0, 0, 0, 0]]


def test_reward_goes_on_the_last_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 0],   # two turns, then the final observation
                         [0, 1, 0, 0, 0, 0, 0, 0, 0],   # one turn
                         [0, 0, 0, 0, 0, 0, 0, 0, 0]],  # no turn at all (reset failed)
                        dtype=torch.float32)
    rewards = place_reward(torch.tensor([1.0, 0.5, 0.7]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 0, 1, 0, 0], [0, 0.5, 0, 0, 0, 0, 0, 0, 0], [0] * 9]


def test_reinforce_pp_discounts_over_action_tokens_only():
    rewards = place_reward(torch.tensor([1.0]), MASK)
    returns = reinforce_pp(rewards, MASK, gamma=0.5, whiten=False)
    # action tokens 1, 2, 5: returns 0.25, 0.5, 1; the two observation tokens between 2 and 5 do not discount
    assert returns.tolist() == [[0, 0.25, 0.5, 0, 0, 1.0, 0]]
    whitened = reinforce_pp(rewards, MASK, gamma=0.5)
    mean, std = 7 / 12, math.sqrt(((0.25 - 7 / 12) ** 2 + (0.5 - 7 / 12) ** 2 + (1 - 7 / 12) ** 2) / 2)
    expected = [(x - mean) / math.sqrt(std**2 + 1e-8) for x in (0.25, 0.5, 1.0)]
    assert whitened[0, [1, 2, 5]].tolist() == pytest.approx(expected, rel=1e-5)
    assert whitened[0, [0, 3, 4, 6]].tolist() == [0, 0, 0, 0]


def test_reinforce_pp_whitens_over_the_whole_batch():
    mask = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    rewards = place_reward(torch.tensor([1.0, 0.0]), mask)
    out = reinforce_pp(rewards, mask, gamma=1.0)
    # returns over the five action tokens: 1, 1, 0, 0, 0 -> mean 0.4, unbiased std sqrt(0.3)
    hi, lo = 0.6 / math.sqrt(0.3 + 1e-8), -0.4 / math.sqrt(0.3 + 1e-8)
    torch.testing.assert_close(out, torch.tensor([[hi, 0, hi, 0], [0, lo, lo, lo]]))


def test_equal_rewards_give_zero_and_no_nan_for_token_estimators():
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 0, 1, 1]], dtype=torch.float32)
    for score in (0.0, 1.0):
        rewards = place_reward(torch.tensor([score, score]), mask)
        out = reinforce_pp(rewards, mask, gamma=1.0)
        advantages, returns = gae(rewards, torch.zeros_like(mask), mask)
        for x in (out, advantages, returns):
            assert torch.isfinite(x).all()
        assert out.abs().max() == 0 and advantages.abs().max() == 0
        assert returns.tolist() == (score * mask).tolist()


def test_gae_with_unit_gamma_lambda_and_zero_critic_is_the_outcome_on_every_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 1, 0],
                         [0, 0, 1, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.3])
    advantages, returns = gae(place_reward(scores, mask), torch.zeros_like(mask), mask, gamma=1.0, lam=1.0, whiten=False)
    assert advantages.tolist() == (scores[:, None] * mask).tolist()
    assert returns.tolist() == (scores[:, None] * mask).tolist()


def test_gae_bootstraps_from_the_next_action_token_never_an_observation():
    # V before each action token: 0.2, 0.4, 0.5; observation tokens carry a large value that must not be used
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 9.0, 0.5, 9.0]])
    rewards = place_reward(torch.tensor([1.0]), MASK)
    advantages, returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8, whiten=False)
    # t5: delta = 1 - 0.5 = 0.5                        A = 0.5
    # t2: delta = 0.9 * 0.5 - 0.4 = 0.05               A = 0.05 + 0.72 * 0.5 = 0.41
    # t1: delta = 0.9 * 0.4 - 0.2 = 0.16               A = 0.16 + 0.72 * 0.41 = 0.4552
    assert advantages.tolist()[0] == pytest.approx([0, 0.4552, 0.41, 0, 0, 0.5, 0])
    assert returns.tolist()[0] == pytest.approx([0, 0.6552, 0.81, 0, 0, 1.0, 0])
    whitened, same_returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    torch.testing.assert_close(whitened, masked_whiten(advantages, MASK))
    assert same_returns.tolist() == returns.tolist()


def test_whitening_statistics_can_be_summed_over_processes():
    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    together = masked_whiten(x, mask)
    # process 0 holds row 0, process 1 row 1; `reduce` adds the other process's statistics
    stats = [torch.stack([(x[i] * mask[i]).sum(), (x[i] ** 2 * mask[i]).sum(), mask[i].sum()]).double() for i in (0, 1)]
    apart = [masked_whiten(x[i:i + 1], mask[i:i + 1], reduce=lambda s, i=i: s + stats[1 - i]) for i in (0, 1)]
    torch.testing.assert_close(torch.cat(apart), together)


def median_baseline(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """A test estimator, step 1 of docs/algorithms.md's "Add an advantage estimator": each sample's score minus the median of
    the other samples of its task."""
    def within(s):
        return s - torch.stack([torch.cat([s[:i], s[i + 1:]]).median() for i in range(len(s))])

    return _within_groups(scores, groups, within)


def test_a_new_grouped_estimator_is_one_function_and_its_entry(monkeypatch, tmp_path):
    """The recipe followed: the function above (for AdvantageInputs.per_episode) and its entry in ESTIMATORS, which
    --algo's choices are made of (tyro's check on a command line is stood in for here by dataclasses.replace).
    train.py then refuses a group of one, trains a step with it, and logs each trajectory's advantage as the
    estimator gives it."""
    import train

    def median(x: AdvantageInputs):
        return x.per_episode(median_baseline), None

    monkeypatch.setitem(ESTIMATORS, "median", Estimator(median, grouped=True))
    args = train.parse_args(["--engine", "hf", "--steps", "1", "--tasks-per-step", "2", "--n", "3", "--horizon", "2",
                             "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", "median"])
    args = dataclasses.replace(args, algo="median")
    with pytest.raises(SystemExit, match="--n 2 or more"):
        train.check(dataclasses.replace(args, n=1), world=1)
    run_dir = train.main(args)
    assert json.loads((run_dir / "config.json").read_text())["algo"] == "median"
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(metrics["losses/policy"]) and metrics["losses/grad_norm"] > 0
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 6
    for group in {r["group"] for r in records}:
        members = [r for r in records if r["group"] == group]
        expected = median_baseline(torch.tensor([r["reward"] for r in members]), torch.zeros(len(members)))
        assert [r["advantages"] for r in members] == pytest.approx(expected.tolist(), abs=1e-6)


def to_go(x: AdvantageInputs):
    """A token-level test estimator: the discounted return of every action token, unwhitened (plain REINFORCE)."""
    return reinforce_pp(x.rewards(), x.mask, x.gamma, whiten=False), None


def value_baseline(x: AdvantageInputs):
    """A critic-based test estimator: the return of every action token less the critic's value (no GAE)."""
    returns = reinforce_pp(x.rewards(), x.mask, x.gamma, whiten=False)
    return (returns - x.values) * x.mask, returns


@pytest.mark.slow
@pytest.mark.parametrize("name, estimator", [("to_go", Estimator(to_go, gamma=0.5)),
                                             ("value_baseline", Estimator(value_baseline, critic=True, gamma=1.0))])
def test_a_new_token_level_or_critic_based_estimator_is_one_function_and_its_entry(name, estimator, monkeypatch,
                                                                                   tmp_path):
    """The same recipe for an estimator over tokens, and for one with a critic: its entry's `gamma` is the discount's
    default, and `critic` builds, trains and checkpoints a critic (rl/model.py), plans its memory and lets the
    critic's flags through; nothing else is edited."""
    import train
    from rl.memory import plan
    from rl.model import load_model
    from rl.records import decode_array

    monkeypatch.setitem(ESTIMATORS, name, estimator)
    args = train.parse_args(["--engine", "hf", "--steps", "1", "--tasks-per-step", "2", "--n", "1", "--horizon", "2",
                             "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", name])
    args = dataclasses.replace(args, algo=name)
    train.check(args, world=1)  # (a group of one is fine: it compares no samples)
    train.check(dataclasses.replace(args, gamma=0.9), world=1)
    if estimator.critic:
        train.check(dataclasses.replace(args, critic_warmup=2), world=1)
        with pytest.raises(SystemExit, match="two optimizers"):
            train.check(train.replace(args, mixed_precision="fp16"), world=1)  # (a ModelArgs flag)
    else:
        with pytest.raises(SystemExit, match="--critic-warmup"):
            train.check(dataclasses.replace(args, critic_warmup=2), world=1)
    settings = dict(algo=name, lora_rank=0, lora_targets=("all-linear",), processes=1, sharded=False, reference=True,
                    offload_reference=False, micro_tokens=4096, checkpointing=False, engine="hf", engine_share=0.3,
                    engine_sleeps=True, gpu_gib=80.0, batch=8, context=4096, logits_elements=2**26)
    held = plan(load_model("tiny-agent").config, **settings)["phases"]["update"]
    assert any("critic" in part for part in held) == estimator.critic, held
    run_dir = train.main(args)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(metrics["losses/policy"]) and metrics["losses/grad_norm"] > 0
    assert ("losses/value" in metrics and metrics["losses/critic_grad_norm"] > 0) == estimator.critic

    def at_tokens(value, n):  # (a record holds one number where all its action tokens' are equal)
        values = decode_array(value)
        return values * n if len(values) == 1 else values

    for record in (json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()):
        if record.get("error") is not None:
            continue
        n = record["action_tokens"]
        advantages = at_tokens(record["advantages"], n)
        if estimator.critic:  # the return less the value, at every action token
            returns, values = at_tokens(record["returns"], n), at_tokens(record["values"], n)
            assert advantages == pytest.approx([r - v for r, v in zip(returns, values)], abs=1e-5)
        else:  # the outcome discounted by 0.5 (the entry's default) per later action token
            assert advantages == pytest.approx([record["reward"] * 0.5 ** (n - 1 - k) for k in range(n)], abs=1e-6)
