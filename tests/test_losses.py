"""Loss terms and their aggregation, against numbers worked out by hand."""

import math

import pytest
import torch

from rl.losses import (Counts, Objective, aggregate, importance_weights, kl, policy_loss, policy_objective,
                       value_loss)


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


def test_aggregate_over_packed_segments_takes_16_bit_terms():
    """Terms that come in bf16 (a model under a 16-bit output policy) against the fp32 mask: packed segments sum in
    the wider dtype, as the unpacked modes do (index_add refused the mix, on an H200 under FSDP2)."""
    terms = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    mask, segments = torch.tensor([[1.0, 1.0, 0.0, 1.0]]), torch.tensor([[0, 0, 1, 1]])
    for mode, expected in (("seq-mean-token-mean", (1.5 + 4) / 2), ("seq-mean-token-sum", (3 + 4) / 2)):
        packed = aggregate(terms, mask, mode, segments=segments)
        assert packed.dtype == torch.float32 and packed.item() == pytest.approx(expected)


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


# Two rows of action tokens (mask 1) and their log-ratios trainer - engine: row 0 one sequence, a stale token (lag 1) in
# it; row 1 packed with two sequences, 1 and 2, all lag 0.
MASK = torch.tensor([[0.0, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
LOG_RATIO = torch.tensor([[5.0, 0.1, 1.0, -0.3, 5.0], [0.8, 0.6, 0.1, -0.1, 5.0]])
LAG = torch.tensor([[0.0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
SEQUENCES = torch.tensor([[0, 0, 0, 0, -1], [1, 1, 2, 2, -1]])
ENGINE = torch.full_like(LOG_RATIO, -2.0)


def weighed(mode):
    return importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, LAG, SEQUENCES, mode, cap=1.5, is_cap=2.0)


def test_importance_weights_by_hand():
    """The stale token is decoupled PPO's (e^1.0 truncated at --is-cap 2) under every --mismatch; lag-0 tokens weigh
    1 (none), min(e^x, 1.5) (tis), or 0/1 by their sequence's geometric mean against [1/1.5, 1.5] (mis: sequence 0,
    e^((0.1 - 0.3) / 2), in; 1, e^0.7, out; 2, e^0, in); off the action tokens 1."""
    e = math.exp
    expected = {
        "none": [[1, 1, 2, 1, 1], [1, 1, 1, 1, 1]],
        "tis": [[1, e(0.1), 2, e(-0.3), 1], [1.5, 1.5, e(0.1), e(-0.1), 1]],
        "mis": [[1, 1, 2, 1, 1], [0, 0, 1, 1, 1]],
    }
    for mode, weights in expected.items():
        answer = weighed(mode)
        assert answer.weights.tolist() == [pytest.approx(row) for row in weights], mode
        assert answer.stale_truncated.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
        assert answer.truncated.tolist() == [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]  # (whatever the mode: for the logs)
        assert answer.masked.tolist() == [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]


def test_importance_weights_without_lag_or_sequences_are_the_synchronous_loop():
    """No lag (the synchronous loop): every action token is lag 0; no sequences: a row is one. A stale-looking ratio
    far off is then the mismatch's, and tis truncates it at its own cap."""
    answer = importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, mismatch="tis", cap=1.5, is_cap=2.0)
    assert answer.weights[0].tolist() == pytest.approx([1, math.exp(0.1), 1.5, math.exp(-0.3), 1])
    assert answer.stale_truncated.sum() == 0
    mis = importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, mismatch="mis", cap=1.5, is_cap=2.0)
    # row 0: e^(0.8 / 3), in; row 1 as one sequence: e^(1.4 / 4), in (as sequences 1 and 2 above, 1 is out)
    assert mis.weights.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_mis_judges_the_geometric_mean_whatever_the_length():
    """200 tokens each e^0.01 off: their product is e^2, past any cap of 1.5, their geometric mean e^0.01 is in; the
    same sequence at e^0.5 a token is out. 2 tokens at e^0.5 are out as well: the band does not depend on length."""
    for length, gap, kept in ((200, 0.01, True), (200, 0.5, False), (2, 0.5, False), (2, 0.01, True)):
        engine = torch.full((1, length), -1.0)
        answer = importance_weights(engine + gap, engine, torch.ones(1, length), mismatch="mis", cap=1.5)
        assert answer.weights.eq(1.0 if kept else 0.0).all(), (length, gap)


def gspo_batch():
    """One packed row of two sequences: 0 with action tokens at log-ratios 0.1, 0.3, 0.2 around an observation
    token (mask 0, log-ratio 5: it must count nowhere), 1 with -0.1 and 0.1; advantages 1 and -1."""
    from rl.batch import MicroBatch

    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    sequence = torch.tensor([[0, 0, 0, 0, 1, 1]])
    logprobs = torch.tensor([[0.1, 0.3, 5.0, 0.2, -0.1, 0.1]], requires_grad=True)
    micro = MicroBatch(input_ids=torch.zeros(1, 6, dtype=torch.long), loss_mask=mask, segments=sequence,
                       sequence=sequence, sampler_logprobs=torch.zeros(1, 6), old_logprobs=torch.zeros(1, 6),
                       advantages=torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0]]))
    return logprobs, micro


def test_a_sequence_level_ratio_is_gspo_by_hand():
    """ratio="sequence" (GSPO, Zheng et al., 2025): a sequence's ratio is exp of its action tokens' mean log-ratio,
    clipped as one. Sequence 0: exp(0.2) = 1.221 > 1.2, clipped: -1.2 on each token, no gradient; sequence 1:
    exp(0) = 1, -A * 1 = 1 on each token, whose gradient is GSPO's: -A * s / |y| for each of its tokens, over the
    2 sequences, 0.25 a token."""
    logprobs, micro = gspo_batch()
    objective = Objective(ratio="sequence", loss_agg="seq-mean-token-mean", entropy_coef=0.0)
    loss, terms = policy_objective(logprobs, torch.zeros(1, 6), micro, Counts(tokens=5, sequences=2), objective)
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2)
    assert terms.clipped[0].tolist() == [1, 1, 0, 1, 0, 0]
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0, 0, 0, 0, 0.25, 0.25])
    # per token (the default) the same numbers are another loss: 0.1 is inside the clip range, 0.3 and 0.2 outside
    token, _ = policy_objective(logprobs, torch.zeros(1, 6), micro, Counts(tokens=5, sequences=2),
                                Objective(loss_agg="seq-mean-token-mean", entropy_coef=0.0))
    assert token.item() == pytest.approx((-(math.exp(0.1) + 1.2 + 1.2) / 3 + (math.exp(-0.1) + math.exp(0.1)) / 2) / 2)


def test_a_flag_named_as_an_objective_field_sets_it():
    """The one flag a loss variant adds: train.py builds the Objective from the flags of its fields' names, so a field
    of Args named `ratio` would select GSPO with no other edit (there is no such flag today: shown with a subclass)."""
    import dataclasses

    import train

    args = train.parse_args(["--clip", "0.3", "--loss-agg", "token-mean", "--kl-in-reward"])
    assert train.objective(args) == Objective(clip=0.3, loss_agg="token-mean", kl_in_reward=True)
    with_ratio = dataclasses.make_dataclass("WithRatio", [("ratio", str, "sequence")], bases=(train.Args,))
    assert train.objective(with_ratio()).ratio == "sequence"
