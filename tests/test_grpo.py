"""GRPO advantages and the PPO loss terms, against numbers worked out by hand."""

import math

import pytest
import torch

from rl.advantages import grpo, per_token
from rl.losses import kl_k3, policy_loss, token_mean


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
    a = grpo(scores, groups, scale=False)
    assert a.tolist() == pytest.approx([-0.3, 0.5, 0.3, -0.5])


def test_grpo_equal_rewards_and_lone_samples_give_zero():
    a = grpo(torch.tensor([1.0, 1.0, 1.0, 0.7]), torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(a).all()
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_advantage_lands_on_action_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    out = per_token(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 2, 2, 0, 0, 2], [0, -1, -1, 0, 0, 0, 0]]


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))  # ratios 1.5, 0.5, 1.1, 1.5
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    loss, clipped = policy_loss(new, old, adv, clip=0.2)
    # A>0, r=1.5: min(1.5, 1.2)*1 = 1.2 -> -1.2 (clipped); A>0, r=0.5: min(0.5, 0.8) = 0.5 -> -0.5
    # A<0, r=1.1: -A*r = 2.2 (inside the range); A<0, r=1.5: max(1.5, 1.2) = 1.5 (unclipped side)
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, 2.2, 1.5])
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_k3_kl_is_zero_at_equality_and_matches_formula():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.5]])
    kl = kl_k3(logp, ref)
    d = 0.5
    assert kl.tolist()[0] == pytest.approx([0.0, math.exp(d) - d - 1])


def test_token_mean_with_a_minibatch_count():
    terms = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    assert token_mean(terms, mask).item() == pytest.approx(2.0)
    assert token_mean(terms, mask, count=8).item() == pytest.approx(0.5)
