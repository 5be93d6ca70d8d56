"""Outcome rewards -> advantages.

One trajectory, one outcome reward (the last env step's reward, as AgentGym-RL). GRPO compares
the n samples of a task with each other: no critic, the group is the baseline. The trajectory's
advantage is then spread over its action tokens (loss_mask 1); observation tokens get nothing.
"""

from __future__ import annotations

import torch


def grpo(scores: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO: (s - mean of its group) / (std of its group + eps), std unbiased (n - 1), as upstream.

    scores, groups: [B]. scale=False skips the division (Dr. GRPO). A group of one has nothing to
    compare with and gets advantage 0 (upstream gives it its raw score).
    """
    advantages = torch.zeros_like(scores, dtype=torch.float32)
    for g in groups.unique():
        members = groups == g
        s = scores[members].float()
        if len(s) < 2:
            continue
        centered = s - s.mean()
        advantages[members] = centered / (s.std() + eps) if scale else centered
    return advantages


def per_token(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast trajectory advantages [B] onto their action tokens: [B, T]."""
    return advantages[:, None] * loss_mask
