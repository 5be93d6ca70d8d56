"""Supervised fine-tuning on trajectories: cross-entropy on the action tokens (loss_mask 1) only,
so the model learns what the assistant said and never the prompt or the observations.

    loss = sft_loss(model, rows)                       # token-mean NLL of a collated or packed batch
    total, sums, finite = sft_terms(model, micro, accelerator)  # train.py: summed, then divided by the batch's
                                                                # action tokens over all processes

Where it differs from AgentGym's SFT: several conversations share a row (rl/batch.py's `pack`), with no
attention across them (their positions restart at each: rl/logprobs.forward_inputs), and the loss is averaged
over the action tokens of the whole batch however it is split into micro-batches and processes; AgentGym pads
each conversation and averages per micro-batch, which weighs a token of a short conversation more. The
log-probs, and so the optimum, are the same (tests/test_sft.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl.logprobs import token_logprobs
from rl.optimizer import Sums


def nll(model, input_ids, attention_mask, loss_mask, position_ids=None) -> torch.Tensor:
    """The summed negative log-likelihood of the action tokens of padded or packed rows, [B, T] each."""
    logprobs, _ = token_logprobs(model, input_ids, attention_mask, loss_mask, position_ids=position_ids)
    return -(logprobs * loss_mask).sum()


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean negative log-likelihood of the action tokens of a collated or packed batch (rl/logprobs.collate,
    rl/batch.pack)."""
    mask = batch["loss_mask"]
    return nll(model, batch["input_ids"], batch.get("attention_mask"), mask, batch.get("position_ids")) / \
        mask.sum().clamp(min=1)


@dataclass
class SFTSums(Sums):
    """An SFT pass's statistics, summed over its micro-batches (and processes)."""

    nll: float = 0.0
    tokens: float = 0.0  # action tokens

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The mean NLL per action token (sft/loss; `prefix` val_: on the held-out tasks) and the tokens."""
        return {f"sft/{prefix}loss": self.nll / max(self.tokens, 1.0), f"sft/{prefix}tokens": self.tokens}


def sft_terms(model, micro, accelerator) -> tuple[torch.Tensor, SFTSums, bool]:
    """One micro-batch of train.py's SFT (rl/batch.MicroBatch): its summed NLL (under Accelerate's autocast), its
    statistics, and whether they are finite."""
    with accelerator.autocast():
        loss = nll(model, micro.input_ids, micro.attention_mask, micro.loss_mask, micro.position_ids)
    sums = SFTSums(nll=float(loss.detach()), tokens=float(micro.loss_mask.sum()))
    return loss, sums, math.isfinite(sums.nll)
