"""Loss terms, per token. Every function takes [B, T] tensors and returns [B, T] terms; the caller
masks and aggregates them (token-mean over a mini-batch: sum over action tokens / their count)."""

from __future__ import annotations

import torch


def policy_loss(logprobs, old_logprobs, advantages, clip: float = 0.2):
    """PPO's clipped surrogate, to be minimised: max(-A * r, -A * clip(r, 1 - eps, 1 + eps)) with
    r = exp(logprobs - old_logprobs). Returns (loss terms, 1.0 where the clip was active)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip, 1 + clip)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def kl_k3(logprobs, ref_logprobs):
    """Schulman's low-variance, non-negative estimator of KL(policy || reference) from samples of
    the policy: exp(d) - d - 1 with d = ref - policy log-prob; clamped to [-10, 10] as upstream."""
    d = ref_logprobs - logprobs
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def token_mean(terms, mask, count=None):
    """Sum of terms over action tokens divided by `count` (default: their number). Pass the
    mini-batch's action-token count when a mini-batch is split into micro-batches, so that the
    gradient is the same however it is split."""
    count = mask.sum() if count is None else count
    return (terms * mask).sum() / max(float(count), 1.0)
