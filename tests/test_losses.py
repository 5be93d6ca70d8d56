"""Loss terms and their aggregation, against numbers worked out by hand."""

import math

import pytest
import torch

from rl.losses import aggregate, kl, policy_loss, value_loss


def ratios(*r):
    return torch.log(torch.tensor([list(r)]))


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    loss, clipped = policy_loss(ratios(1.5, 0.5, 1.1, 1.5), old, adv, 0.2)
    # A>0, r=1.5: min(1.5, 1.2)*1 = 1.2 -> -1.2 (clipped); A>0, r=0.5: min(0.5, 0.8) = 0.5 -> -0.5
    # A<0, r=1.1: -A*r = 2.2 (inside the range); A<0, r=1.5: max(1.5, 1.2) = 1.5 (unclipped side)
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, 2.2, 1.5])
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_clip_higher_gives_more_room_above_only():
    old, adv = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]])
    symmetric, _ = policy_loss(ratios(1.25, 1.35, 0.7), old, adv, 0.2)
    higher, clipped = policy_loss(ratios(1.25, 1.35, 0.7), old, adv, 0.2, clip_high=0.28)
    assert symmetric.tolist()[0] == pytest.approx([-1.2, -1.2, 0.8])
    # 1.25 is now inside [0.8, 1.28]; 1.35 is clipped at 1.28; the lower side is unchanged
    assert higher.tolist()[0] == pytest.approx([-1.25, -1.28, 0.8])
    assert clipped.tolist() == [[0.0, 1.0, 1.0]]


def test_dual_clip_bounds_negative_advantages_only():
    old, adv = torch.zeros(1, 3), torch.tensor([[-1.0, -1.0, 2.0]])
    loss, clipped = policy_loss(ratios(5.0, 1.1, 5.0), old, adv, 0.2, dual_clip=3.0)
    # A<0, r=5: max(5, 1.2) = 5, bounded at -A*3 = 3; A<0, r=1.1: 1.1 < 3, untouched; A>0: the usual -2*1.2
    assert loss.tolist()[0] == pytest.approx([3.0, 1.1, -2.4])
    assert clipped.tolist() == [[1.0, 0.0, 1.0]]
    new = ratios(5.0, 1.1, 5.0).requires_grad_()
    policy_loss(new, old, adv, 0.2, dual_clip=3.0)[0].sum().backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0  # the bounded token has no gradient


def test_value_loss_clips_around_the_old_values():
    values = torch.tensor([[1.0, 0.3]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.2]])
    loss, clipped = value_loss(values, old, returns, clip=0.5)
    # token 0: (1 - 2)^2 = 1 vs (0.5 - 2)^2 = 2.25 -> 0.5 * 2.25; token 1: inside the clip, 0.5 * 0.01
    assert loss.tolist()[0] == pytest.approx([1.125, 0.005])
    assert clipped.tolist() == [[1.0, 0.0]]
    assert value_loss(values, old, returns, clip=None)[0].tolist()[0] == pytest.approx([0.5, 0.005])


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.5]])  # d = ref - logp = 0, 0.5
    assert kl(logp, ref, "k1").tolist()[0] == pytest.approx([0.0, -0.5])
    assert kl(logp, ref, "k2").tolist()[0] == pytest.approx([0.0, 0.125])
    assert kl(logp, ref, "k3").tolist()[0] == pytest.approx([0.0, math.exp(0.5) - 0.5 - 1])
    with pytest.raises(ValueError):
        kl(logp, ref, "k4")


def test_k3_is_nonnegative_and_averages_to_the_true_kl():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen), 0)
    q = torch.softmax(torch.randn(6, generator=gen), 0)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, logq = p.log()[samples], q.log()[samples]
    true = float((p * (p.log() - q.log())).sum())
    assert (kl(logp, logq, "k3") >= 0).all()
    for estimator in ("k1", "k3"):  # both unbiased
        assert float(kl(logp, logq, estimator).mean()) == pytest.approx(true, rel=0.03)


def test_aggregation_modes_by_hand_and_under_micro_batching():
    terms = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [7.0, 7.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2: no action token
    assert aggregate(terms, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(terms, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(terms, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):  # split into micro-batches of one row
        whole = aggregate(terms, mask, mode)
        split = sum(aggregate(terms[i:i + 1], mask[i:i + 1], mode, tokens=4, sequences=2) for i in range(3))
        assert split.item() == pytest.approx(whole.item())
    with pytest.raises(ValueError):
        aggregate(terms, mask, "sum")


def test_k3_gradient_stays_finite_far_from_the_reference():
    """exp of a huge log-ratio is inf; an unclamped k3 would send NaN gradients into the weights even
    from masked positions (0 * NaN is NaN)."""
    logp = torch.tensor([[-95.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.2]])
    mask = torch.tensor([[0.0, 1.0]])
    aggregate(kl(logp, ref, "k3"), mask).backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 0] == 0


def test_aggregate_divides_by_a_fractional_count():
    """Under DDP a mini-batch's count over processes, divided by their number, can be below 1 (3
    sequences on 8 GPUs): it must be divided by as it is, not rounded up to 1."""
    terms, mask = torch.ones(1, 4), torch.ones(1, 4)
    assert aggregate(terms, mask, "seq-mean-token-mean", sequences=3 / 8).item() == pytest.approx(8 / 3)
    assert aggregate(terms, mask, "token-mean", tokens=0.5).item() == pytest.approx(8.0)
    assert aggregate(terms, mask * 0, "token-mean", tokens=0).item() == 0.0
