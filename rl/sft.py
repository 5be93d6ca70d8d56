"""Supervised fine-tuning on trajectories: cross-entropy on the action tokens (loss_mask 1) only,
so the model learns what the assistant said and never the prompt or the observations."""

from __future__ import annotations

import torch

from rl.logprobs import token_logprobs


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean negative log-likelihood of the action tokens of a collated batch."""
    logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    mask = batch["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)
