"""Supervised fine-tuning on trajectories: cross-entropy on the action tokens (loss_mask 1) only,
so the model learns what the assistant said and never the prompt or the observations.

    loss = sft_loss(model, rows)   # token-mean NLL of a collated or packed batch
    total = nll(model, micro)      # train.py: summed, then divided by the batch's action tokens over all processes

Where it differs from AgentGym's SFT: several conversations share a row (rl/batch.py's `pack`: block-causal
masks, positions restarting per conversation) and the loss is averaged over the action tokens of the whole
batch however it is split into micro-batches and processes; AgentGym pads each conversation and averages per
micro-batch, which weighs a token of a short conversation more. The log-probs, and so the optimum, are the same
(tests/test_sft.py).
"""

from __future__ import annotations

import torch

from rl.logprobs import token_logprobs


def nll(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed negative log-likelihood of the action tokens of a collated or packed batch."""
    logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                 position_ids=batch.get("position_ids"))
    return -(logprobs * batch["loss_mask"]).sum()


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean negative log-likelihood of the action tokens of a collated or packed batch."""
    return nll(model, batch) / batch["loss_mask"].sum().clamp(min=1)
