"""Loss terms and their aggregation, against numbers worked out by hand."""

import math

import pytest
import torch

from rl.batch import MicroBatch
from rl.losses import (Counts, Objective, aggregate, cispo_loss, importance_weights, kl, policy_loss, policy_objective,
                       sequence_mean, value_loss)
from rl.metrics import policy_sums


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
    return importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, LAG, SEQUENCES, mode, cap=1.5, band=(1 / 1.5, 1.5),
                              is_cap=2.0)


def test_importance_weights_by_hand():
    """The stale token is decoupled PPO's (e^1.0 truncated at --is-cap 2) under every --mismatch; lag-0 tokens weigh
    1 (none); min(e^x, 1.5) (tis); their sequence's product of lag-0 ratios, 0 above 1.5 (mis: sequence 0,
    e^(0.1 - 0.3); 1, e^1.4, out; 2, e^0); their own ratio inside [1/1.5, 1.5], 0 outside (icepop: e^0.8, e^0.6
    out); 1, or 0 by their sequence's geometric mean against [1/1.5, 1.5] (geo-rs: sequence 0 e^-0.1, in; 1, e^0.7,
    out; 2, e^0, in); off the action tokens 1."""
    e = math.exp
    expected = {
        "none": [[1, 1, 2, 1, 1], [1, 1, 1, 1, 1]],
        "tis": [[1, e(0.1), 2, e(-0.3), 1], [1.5, 1.5, e(0.1), e(-0.1), 1]],
        "mis": [[1, e(-0.2), 2, e(-0.2), 1], [0, 0, 1, 1, 1]],
        "icepop": [[1, e(0.1), 2, e(-0.3), 1], [0, 0, e(0.1), e(-0.1), 1]],
        "geo-rs": [[1, 1, 2, 1, 1], [0, 0, 1, 1, 1]],
    }
    for mode, weights in expected.items():
        answer = weighed(mode)
        assert answer.weights.tolist() == [pytest.approx(row) for row in weights], mode
        assert answer.stale_truncated.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
        # (whatever the mode, for the logs: what tis truncates and mis masks; icepop and geo-rs at the band given)
        for bound in (answer.truncated, answer.masked, weighed("icepop").masked_tokens, weighed("geo-rs").rejected):
            assert bound.tolist() == [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], mode
    # (under another mode the band is theirs by default: icepop's [0.5, 5] has them all, geo-rs's [0.999, 1.001] only
    # sequence 2, e^0)
    assert weighed("none").masked_tokens.sum() == 0
    assert weighed("none").rejected.tolist() == [[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]


def test_importance_weights_without_lag_or_sequences_are_the_synchronous_loop():
    """No lag (the synchronous loop): every action token is lag 0; no sequences: a row is one. A stale-looking ratio
    far off is then the mismatch's, and tis truncates it at its own cap."""
    answer = importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, mismatch="tis", cap=1.5, is_cap=2.0)
    assert answer.weights[0].tolist() == pytest.approx([1, math.exp(0.1), 1.5, math.exp(-0.3), 1])
    assert answer.stale_truncated.sum() == 0
    geo = importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, mismatch="geo-rs", band=(1 / 1.5, 1.5))
    # row 0: e^(0.8 / 3), in; row 1 as one sequence: e^(1.4 / 4), in (as sequences 1 and 2 above, 1 is out)
    assert geo.weights.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    mis = importance_weights(ENGINE + LOG_RATIO, ENGINE, MASK, mismatch="mis", cap=1.5)
    assert mis.weights.tolist() == [[1, 0, 0, 0, 1], [0, 0, 0, 0, 1]]  # (products e^0.8 and e^1.4: both out)


def test_mis_masks_a_sequence_that_the_geometric_mean_keeps():
    """400 tokens, 200 of them at a ratio of 2.2 and the rest at 1: their geometric mean, 1.48, is inside [1/2, 2],
    so the geometric-mean rule at the old `mis` band masks nothing (geo-rs, band 0.5:2); mis takes the sequence's
    own ratio, 2.2^200, and masks it at its default cap of 2; geo-rs at its default band, verl's 0.999:1.001, rejects
    it. A sequence whose product is under the cap (e^0.4) weighs that product, every token of it, one far below 1
    too (e^-3: mis masks only above the cap)."""
    log_ratio = torch.tensor([[math.log(2.2), 0.0] * 200])
    engine, mask = torch.full((1, 400), -3.0), torch.ones(1, 400)
    geometric = importance_weights(engine + log_ratio, engine, mask, mismatch="geo-rs", band=(0.5, 2.0))
    assert geometric.weights.eq(1.0).all() and geometric.rejected.sum() == 0
    mis = importance_weights(engine + log_ratio, engine, mask, mismatch="mis")
    assert mis.weights.eq(0.0).all() and mis.masked.eq(1.0).all()
    assert importance_weights(engine + log_ratio, engine, mask, mismatch="geo-rs").weights.eq(0.0).all()
    for gap in (0.4, -3.0):
        engine = torch.full((1, 4), -3.0)
        kept = importance_weights(engine + torch.tensor([[gap, 0.0, -0.1, 0.1]]), engine, torch.ones(1, 4),
                                  mismatch="mis")
        assert kept.weights[0].tolist() == pytest.approx([math.exp(gap)] * 4) and kept.masked.sum() == 0


def test_geo_rs_judges_the_geometric_mean_whatever_the_length():
    """200 tokens each e^0.01 off: their product is e^2, past a cap of 1.5 (mis masks them), their geometric mean
    e^0.01 is inside a band of [1/1.5, 1.5]; the same sequence at e^0.5 a token is out of it. 2 tokens at e^0.5 are
    out as well: geo-rs's band does not depend on length, mis's cap on the product does."""
    for length, gap, kept in ((200, 0.01, True), (200, 0.5, False), (2, 0.5, False), (2, 0.01, True)):
        engine = torch.full((1, length), -1.0)
        answer = importance_weights(engine + gap, engine, torch.ones(1, length), mismatch="geo-rs",
                                    band=(1 / 1.5, 1.5))
        assert answer.weights.eq(1.0 if kept else 0.0).all(), (length, gap)
        mis = importance_weights(engine + gap, engine, torch.ones(1, length), mismatch="mis", cap=1.5)
        assert mis.masked.eq(1.0 if length * gap > math.log(1.5) else 0.0).all(), (length, gap)


def gspo_batch():
    """One packed row of two sequences: 0 with action tokens at log-ratios 0.1, 0.3, 0.2 around an observation
    token (mask 0, log-ratio 5: it must count nowhere), 1 with -0.1 and 0.1; advantages 1 and -1."""

    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    sequence = torch.tensor([[0, 0, 0, 0, 1, 1]])
    logprobs = torch.tensor([[0.1, 0.3, 5.0, 0.2, -0.1, 0.1]], requires_grad=True)
    micro = MicroBatch(input_ids=torch.zeros(1, 6, dtype=torch.long), loss_mask=mask, segments=sequence,
                       sequence=sequence, sampler_logprobs=torch.zeros(1, 6), old_logprobs=torch.zeros(1, 6),
                       advantages=torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0]]))
    return logprobs, micro


def test_a_sequence_level_ratio_is_gspo_by_hand():
    """--policy-loss gspo (Zheng et al., 2025): a sequence's ratio is exp of its action tokens' mean log-ratio,
    clipped as one. Sequence 0: exp(0.2) = 1.221 > 1.2, clipped: -1.2 on each token, no gradient; sequence 1:
    exp(0) = 1, -A * 1 = 1 on each token, whose gradient is GSPO's: -A * s / |y| for each of its tokens, over the
    2 sequences, 0.25 a token."""
    logprobs, micro = gspo_batch()
    objective = Objective(policy_loss="gspo", loss_agg="seq-mean-token-mean", entropy_coef=0.0)
    loss, terms = policy_objective(logprobs, torch.zeros(1, 6), micro, Counts(tokens=5, sequences=2), objective)
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2)
    assert terms.clipped[0].tolist() == [1, 1, 0, 1, 0, 0]
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0, 0, 0, 0, 0.25, 0.25])
    # per token (the default) the same numbers are another loss: 0.1 is inside the clip range, 0.3 and 0.2 outside
    token, _ = policy_objective(logprobs, torch.zeros(1, 6), micro, Counts(tokens=5, sequences=2),
                                Objective(loss_agg="seq-mean-token-mean", entropy_coef=0.0))
    assert token.item() == pytest.approx((-(math.exp(0.1) + 1.2 + 1.2) / 3 + (math.exp(-0.1) + math.exp(0.1)) / 2) / 2)


def gspo_token_gradient(log_ratio, advantages, kind="gspo"):
    """The gradient of --policy-loss `kind` on one sequence of 4 action tokens (seq-mean-token-mean, clip 0.2) whose
    log-ratios to pi_old are `log_ratio`, with `advantages` a token: the loss and d loss / d log pi, a token each."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    old = logprobs.detach() - torch.tensor([log_ratio])
    micro = MicroBatch(input_ids=torch.zeros(1, 4, dtype=torch.long), loss_mask=torch.ones(1, 4), segments=None,
                       sequence=None, sampler_logprobs=old, old_logprobs=old, advantages=torch.tensor([advantages]))
    loss, _ = policy_objective(logprobs, torch.zeros(1, 4), micro, Counts(tokens=4, sequences=1),
                               Objective(policy_loss=kind, entropy_coef=0.0))
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist()


def test_gspo_token_keeps_each_tokens_advantage():
    """GSPO-token (Zheng et al., 2025, eqs. 13-14): a token's ratio has the sequence's value, s = exp(mean log-ratio),
    and its own log-prob's gradient, s grad log pi(y_t). GiGPO's turn advantages +1, +1, -1, -1 on one sequence at
    ratio 1: PPO's gradient is -A / 4 a token, [-0.25, -0.25, 0.25, 0.25], and so is GSPO's (the sequence form's,
    through s, is the mean advantage on every token: all 0). Log-ratios 0, 0.2, 0.1, 0.1: s = e^0.1 on every token
    (inside the clip), the gradient -A e^0.1 / 4; at 0.3 each, s = e^0.3 is past 1.2: the A > 0 tokens take the
    clipped -1.2 and no gradient, the A < 0 ones the unclipped A s and the gradient e^0.3 / 4."""
    turns = [1.0, 1.0, -1.0, -1.0]
    assert gspo_token_gradient([0.0] * 4, turns, "ppo")[1] == pytest.approx([-0.25, -0.25, 0.25, 0.25])
    assert gspo_token_gradient([0.0] * 4, turns)[1] == pytest.approx([-0.25, -0.25, 0.25, 0.25])
    loss, grad = gspo_token_gradient([0.0, 0.2, 0.1, 0.1], turns)
    assert loss == pytest.approx(0.0, abs=1e-7) and grad == pytest.approx([-a * math.exp(0.1) / 4 for a in turns])
    loss, grad = gspo_token_gradient([0.3] * 4, turns)
    assert loss == pytest.approx((-1.2 - 1.2 + 2 * math.exp(0.3)) / 4)
    assert grad == pytest.approx([0, 0, math.exp(0.3) / 4, math.exp(0.3) / 4])


def old_gspo(logprobs, old, advantages, mask, sequences, clip=0.2):
    """GSPO's sequence form as it was here: exp of the sequence's mean log-ratio on every token, its gradient too."""
    ratio = torch.exp(sequence_mean(logprobs - old, mask, sequences))
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gspo_token_is_gspo_with_one_advantage_a_sequence(agg):
    """With one advantage a sequence GSPO-token's gradient is the sequence form's under every aggregation: a packed
    row of a 3-token sequence (inside the clip, A 1.5) and a 2-token one (A -0.5), a row of one clipped (A 2)."""
    mask = torch.tensor([[1.0, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    sequences = torch.tensor([[0, 0, 0, 0, 1, 1], [2, 2, 2, -1, -1, -1]])
    advantages = torch.tensor([[1.5, 1.5, 0, 1.5, -0.5, -0.5], [2, 2, 2, 0, 0, 0]])
    old = torch.tensor([[-1.0, -0.4, -2, -0.3, -1.2, -0.8], [-1, -1, -1, 0, 0, 0]])
    logprobs = old + torch.tensor([[0.1, -0.05, 3, 0.02, 0.1, -0.3], [0.4, 0.2, 0.3, 0, 0, 0]])
    grads = []
    for loss_of in (lambda x: policy_loss(x, old, advantages, 0.2, mask=mask, sequences=sequences)[0],
                    lambda x: old_gspo(x, old, advantages, mask, sequences)):
        x = logprobs.clone().requires_grad_()
        aggregate(loss_of(x), mask, agg, segments=sequences, norm_tokens=8).backward()
        grads.append(x.grad)
    assert grads[0].abs().sum() > 0 and grads[0][1].abs().sum() == 0  # (the clipped row has none)
    assert torch.allclose(grads[0], grads[1], atol=1e-7), (grads[0], grads[1])


def test_the_loss_flags_are_the_objective_group():
    """The policy loss's flags keep their names (--clip, --loss-agg, ...) inside train.py's Objective group, and the
    tiny preset's aggregation reaches it."""
    import train

    args = train.parse_args(["--clip", "0.3", "--loss-agg", "token-mean", "--kl-in-reward", "--policy-loss", "cispo"])
    assert args.objective == Objective(policy_loss="cispo", clip=0.3, loss_agg="token-mean", kl_in_reward=True)
    assert train.parse_args([]).objective.loss_agg == "token-mean"  # (the tiny preset's)
    assert train.parse_args(["--model", "Qwen/Qwen2.5-7B-Instruct"]).objective == Objective()


def test_cispo_by_hand():
    """CISPO (MiniMax-M1): -A sg(clip(r, 1 - 0.2, 1 + 0.28)) log pi. Ratios e^0.5 (clipped to 1.28), e^0 and
    e^-0.5 (clipped to 0.8): the loss is -A w logp a token, and every token keeps a gradient, -A w, where PPO's clip
    leaves the first (A > 0, r above the band) and the last (A < 0, r below it) none."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logprobs.detach() - torch.tensor([[0.5, 0.0, -0.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    terms, clipped = cispo_loss(logprobs, old, advantages, 0.2, 0.28)
    weights = [1.28, 1.0, 0.8]
    assert terms[0].tolist() == pytest.approx([-1 * 1.28 * -1.0, -1 * 1.0 * -2.0, 1 * 0.8 * -0.5])
    assert clipped[0].tolist() == [1, 0, 1]
    terms.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-a * w for a, w in zip([1, 1, -1], weights)])
    ppo = logprobs.detach().clone().requires_grad_()
    policy_loss(ppo, old, advantages, 0.2, 0.28)[0].sum().backward()
    assert ppo.grad[0].tolist() == pytest.approx([0.0, -1.0, 0.0])


def test_the_three_policy_losses_agree_on_policy():
    """At r = 1 (one update a rollout) ppo, gspo and cispo have one gradient, -A grad log pi a token (their losses
    differ: cispo's is -A log pi)."""
    logprobs, micro = gspo_batch()
    micro.old_logprobs = logprobs.detach().clone()
    grads = []
    for kind in ("ppo", "gspo", "cispo"):
        x = logprobs.detach().clone().requires_grad_()
        loss, _ = policy_objective(x, torch.zeros(1, 6), micro, Counts(tokens=5, sequences=2),
                                   Objective(policy_loss=kind, loss_agg="token-mean", entropy_coef=0.0))
        loss.backward()
        grads.append(x.grad[0].tolist())
    assert grads[0] == pytest.approx([-0.2, -0.2, 0, -0.2, 0.2, 0.2])
    assert grads[1] == pytest.approx(grads[0]) and grads[2] == pytest.approx(grads[0])


def weights_batch():
    """MASK's two rows as a micro-batch, pi_old the trainer's log-probs (so the ratio is 1), advantages 1."""
    return MicroBatch(input_ids=torch.zeros(2, 5, dtype=torch.long), loss_mask=MASK, sequence=SEQUENCES,
                      segments=SEQUENCES, lag=LAG, sampler_logprobs=ENGINE, old_logprobs=ENGINE + LOG_RATIO,
                      advantages=torch.ones(2, 5))


def test_gspo_weighs_a_sequence_by_the_geometric_mean_of_its_tokens_weights():
    """Under gspo the importance weights (staleness, --mismatch) compose with the sequence's ratio as one number a
    sequence: the geometric mean of its tokens' weights (each truncated as under ppo), 0 when one of them is masked;
    at ratio 1 and A 1 a token's policy term is minus it. Row 0 of MASK: weights 1, 2 (the stale e^1.0 truncated at
    2) and 1 -> 2^(1/3) on each of its 3 tokens. Under icepop (band [1/1.5, 1.5]) row 0's lag-0 tokens weigh their
    ratios, e^0.1 and e^-0.3: (e^-0.2 2)^(1/3); row 1's sequence 1 (e^0.8, e^0.6: both out) 0, and 2 (e^0.1, e^-0.1:
    in) their geometric mean, 1. Under mis (cap 1.5) row 0's lag-0 tokens weigh their product e^-0.2 each, with the
    stale 2: (e^-0.4 2)^(1/3)."""
    cases = (("none", {}, [2 ** (1 / 3)] * 3, [1, 1, 1, 1]),
             ("icepop", {"mismatch_band": "0.6667:1.5"}, [(math.exp(-0.2) * 2) ** (1 / 3)] * 3, [0, 0, 1, 1]),
             ("mis", {"mismatch_cap": 1.5}, [(math.exp(-0.4) * 2) ** (1 / 3)] * 3, [0, 0, 1, 1]))
    for mode, bounds, row0, row1 in cases:
        objective = Objective(policy_loss="gspo", mismatch=mode, is_cap=2.0, entropy_coef=0.0, **bounds)
        _, terms = policy_objective(ENGINE + LOG_RATIO, torch.zeros(2, 5), weights_batch(), Counts(7, 3), objective)
        assert (-terms.policy[0, 1:4]).tolist() == pytest.approx(row0), mode
        assert (-terms.policy[1, :4]).tolist() == pytest.approx(row1, abs=1e-6), mode


def test_the_stale_tokens_weights_are_logged_as_they_are_under_gspo():
    """async/is_weight_mean and _max are the stale tokens' own weights under gspo too (the loss takes the sequence's
    geometric mean, 2^(1/3) here): the one stale token of MASK weighs 2 (e^1.0 truncated at --is-cap 2)."""
    for kind in ("ppo", "gspo"):
        micro = weights_batch()
        _, terms = policy_objective(ENGINE + LOG_RATIO, torch.zeros(2, 5), micro, Counts(7, 3),
                                    Objective(policy_loss=kind, entropy_coef=0.0))
        sums = policy_sums(terms, micro)
        assert sums.stale_tokens == 1 and sums.is_weight == pytest.approx(2.0) and sums.is_weight_max == 2.0, kind


def test_icepop_weighs_the_ratio_inside_its_band_and_masks_outside():
    """--mismatch icepop (Ring-1T): a lag-0 token weighs its own ratio k inside the band, 0 outside it. The paper's
    band, the default, [0.5, 5]: ratios 0.4 and 6 weigh 0, 0.6, 1.9 and 4 themselves. Under MASK (band [1/1.5, 1.5])
    the stale e^1.0 of row 0 keeps decoupled PPO's 2 (weighed() above); mis, at its product e^0.5 under its default
    cap of 2, keeps the row of which icepop masks one token."""
    ratios_ = torch.tensor([[0.4, 6.0, 0.6, 1.9, 4.0]])
    answer = importance_weights(torch.log(ratios_), torch.zeros(1, 5), torch.ones(1, 5), mismatch="icepop")
    assert answer.weights[0].tolist() == pytest.approx([0, 0, 0.6, 1.9, 4.0])
    assert answer.masked_tokens.tolist() == [[1, 1, 0, 0, 0]]
    assert weighed("icepop").masked_tokens.tolist() == [[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    long = importance_weights(torch.tensor([[0.5, 0.0, 0.0, 0.0]]), torch.zeros(1, 4), torch.ones(1, 4),
                              mismatch="icepop", band=(1 / 1.5, 1.5))
    assert long.weights.tolist() == [[0, 1, 1, 1]] and long.masked.sum() == 0


def test_dr_grpo_divides_token_sums_by_a_constant():
    """seq-mean-token-sum-norm (Dr. GRPO): each sequence's token sum over a fixed budget, then the mean over
    sequences; the same terms in a micro-batch of other lengths keep their weight (token-mean's would not)."""
    terms = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate(terms, mask, "seq-mean-token-sum-norm", norm_tokens=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    assert aggregate(terms, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(terms, mask, "seq-mean-token-sum-norm", sequences=4, norm_tokens=8).item() == pytest.approx(10 / 32)


@pytest.mark.parametrize("flags,message", [
    (["--dual-clip", "1"], "--dual-clip must be larger than 1"),
    (["--policy-loss", "cispo", "--dual-clip", "3"], "cispo's weight is clipped itself"),
    (["--loss-norm-tokens", "4096"], "--loss-norm-tokens is the constant of --loss-agg seq-mean-token-sum-norm"),
    (["--is-cap", "3"], "--is-cap truncates the importance weights of stale tokens"),
    (["--mismatch-cap", "3"], "--mismatch-cap bounds --mismatch tis's and mis's weights"),
    (["--mismatch", "icepop", "--mismatch-cap", "3"], "icepop's and geo-rs's bounds are --mismatch-band"),
    (["--mismatch", "mis", "--mismatch-band", "0.5:5"], "--mismatch-band is the band of --mismatch icepop and geo-rs"),
    (["--mismatch", "icepop", "--mismatch-band", "5"], "give LO:HI"),
    (["--mismatch", "geo-rs", "--mismatch-band", "1.001:1.01"], "LO in \\[0, 1\\) and HI above 1"),
    (["--algo", "sft", "--data", "x.jsonl", "--policy-loss", "gspo"], "sft, dpo and agentevol learn from trajectory"),
])
def test_bad_loss_flags_stop_with_a_sentence(flags, message, tmp_path):
    import train

    args = train.parse_args(["--out-dir", str(tmp_path), *flags])
    with pytest.raises(SystemExit, match=message):
        train.check(args, 1)
