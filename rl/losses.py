"""Loss terms, per token, and how they are aggregated.

Every term function takes [B, T] tensors and returns [B, T] terms; `aggregate` masks them to the
action tokens and reduces them to a scalar. Signs: everything here is to be minimised.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]


def policy_loss(logprobs, old_logprobs, advantages, clip_low: float = 0.2, clip_high: float | None = None,
                dual_clip: float | None = None):
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = exp(logp - old logp).

    clip_high > clip_low is DAPO's clip-higher (more room for raising unlikely tokens); default
    clip_high = clip_low. dual_clip = c > 1 bounds the loss of a negative advantage at -A c, however
    large the ratio (Ye et al., 2020). Returns (loss terms, 1.0 where a clip was active).
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        active = active | dual
    return loss, active.float()


def behaviour_weights(proximal, behaviour, lag, cap: float = 2.0):
    """Decoupled PPO's importance weight of each token (Hilton et al., 2022; AReaL, Fu et al., 2025), for tokens
    sampled by an older policy than the one updated (asynchronous training): the clipped surrogate is taken
    around the proximal policy (the trainer's weights before the update: `proximal` log-probs) and weighted by
    pi_prox / pi_behav, the behaviour policy's (the sampler's: `behaviour`), truncated at `cap` (TIS, Yao et al.,
    2025) so that no stale token weighs more than `cap` times. `lag` [B, T]: versions between the weights that
    sampled the token and the proximal ones; at lag 0 they are the same weights (the engine's last-bit difference
    from the trainer is not an off-policy gap), so the weight is 1 and the loss is the synchronous one.
    Returns (weights, 1.0 where the cap truncated one)."""
    ratio = torch.exp((proximal - behaviour).clamp(max=20))
    stale = lag > 0
    return torch.where(stale, ratio.clamp(max=cap), torch.ones_like(ratio)), (stale & (ratio > cap)).float()


def value_loss(values, old_values, returns, clip: float | None = 0.5):
    """Clipped value loss: 0.5 max((V - R)^2, (V_clipped - R)^2) with V_clipped = V_old + clip(V - V_old, +-clip).
    Returns (loss terms, 1.0 where the clipped branch was the larger)."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def kl(logprobs, ref_logprobs, estimator: KLEstimator = "k3"):
    """Per-token estimators of KL(policy || reference) from tokens sampled from the policy (Schulman,
    "Approximating KL divergence"): k1 = logp - ref (unbiased, any sign); k2 = (logp - ref)^2 / 2
    (upstream's `mse`); k3 = exp(d) - d - 1 with d = ref - logp (unbiased, non-negative, low variance;
    upstream's `low_var_kl`, clamped to [-10, 10] as there). d is clamped to [-20, 20] first: exp of a
    large d is inf, and its gradient (0 * inf) would be NaN even at a masked position."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (torch.exp(d) - d - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def aggregate(terms, mask, mode: Aggregation = "token-mean", tokens: float | None = None,
              sequences: float | None = None, segments=None, weights=None):
    """Reduce [B, T] terms over the action tokens to one scalar.

    token-mean: sum over all action tokens / their number (every token weighs the same);
    seq-mean-token-mean: the mean over sequences of each sequence's token mean (every trajectory
    weighs the same); seq-mean-token-sum: the mean over sequences of each sequence's token sum (Dr.
    GRPO: no length normalisation). When a mini-batch is split into micro-batches, pass the whole
    mini-batch's `tokens` or `sequences` (those with an action token) so that the gradient is the
    same however it is split, and over processes (train.py passes the mini-batch's counts over all
    processes divided by their number, since data-parallel training averages their gradients: a
    fraction when there are fewer than processes). A count of 0 means nothing to average: the sum is 0.
    `segments` [B, T], when given, says which sequence each token belongs to (rows that pack several
    trajectories, rl/batch.py); otherwise a row is a sequence. `weights` [B, T], when given (an episode in several
    rows: --reasoning drop), are 1 / its sequence's action tokens, for seq-mean-token-mean to sum instead of dividing
    within the micro-batch, which may hold only some of the sequence's tokens.
    """
    mask = mask.float()
    if mode == "token-mean":
        count = mask.sum() if tokens is None else tokens
        return (terms * mask).sum() / (float(count) or 1.0)
    if segments is None:
        per_sequence, lengths = (terms * mask).sum(1), mask.sum(1)
    else:  # sums over each segment's action tokens (every token takes part, so that the graph always
        # reaches the terms: a micro-batch without action tokens still has a gradient, of zeros)
        ids, which = torch.where(mask > 0, segments, -1).flatten().unique(return_inverse=True)
        per_sequence = terms.new_zeros(len(ids)).index_add(0, which, (terms * mask).flatten())
        lengths = mask.new_zeros(len(ids)).index_add(0, which, mask.flatten())
    if mode == "seq-mean-token-mean" and weights is not None:
        per_sequence = (terms * mask * weights).sum()  # (each sequence's part of its mean; summed over sequences)
    elif mode == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths.clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    count = (lengths > 0).sum() if sequences is None else sequences
    return per_sequence.sum() / (float(count) or 1.0)
