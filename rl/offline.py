"""One pass of SFT or DPO over a batch of examples (train.py's learn and evolve): each process's share, as micro-batches
accumulated into one gradient whose loss is the batch's mean however the batch is split (rl/optimizer.accumulate)."""

from __future__ import annotations

import functools

import torch

from rl.batch import MicroBatch, example_micro_batches, padded
from rl.dpo import DPOSums, dpo_terms
from rl.model import Models
from rl.optimizer import accumulate, reducer
from rl.sft import SFTSums, sft_terms


def offline_pass(models: Models, examples: list, accelerator, pad_id: int, *, train: bool, dpo: bool,
                 micro_batch_size: int, beta: float, offload_reference: bool) -> tuple[SFTSums | DPOSums, dict[str, bool]]:
    """Forward (and when `train`, backward) over this process's share of a batch of examples (rl/optimizer.py's
    accumulate), the loss divided by the batch's size over all processes (its action tokens for sft, its pairs for
    `dpo`), so that the accumulated gradient is the batch's mean however it is split; every process runs as many
    micro-batches. Returns the statistics summed over every process, and whether this process's losses were finite."""
    share = examples[accelerator.process_index::accelerator.num_processes]
    micros = example_micro_batches(share, micro_batch_size, pad_id, dpo) if share else []
    local = sum(float(m.loss_mask.sum()) if not dpo else m.input_ids.shape[0] / 2 for m in micros)
    reduce = reducer(accelerator)
    local = torch.tensor([local], dtype=torch.float64)  # (a process with no share has the int 0: same dtype everywhere)
    size = float(reduce(local)[0]) / accelerator.num_processes
    count = int(reducer(accelerator, "max")(torch.tensor([len(micros)])))
    blank = padded([([pad_id], [0])] * (2 if dpo else 1), pad_id)  # (dpo: a chosen and a rejected row)
    sums = DPOSums() if dpo else SFTSums()
    loss_of = functools.partial(offline_terms, models, accelerator=accelerator, size=size, dpo=dpo, beta=beta,
                                offload_reference=offload_reference)
    finite = accumulate(accelerator, micros, [("policy", models.policy, loss_of)], sums, count=count, blank=blank,
                        train=train)
    return sums.reduced(reduce), finite


def offline_terms(models: Models, micro: MicroBatch, accelerator, size: float, dpo: bool, beta: float,
                  offload_reference: bool) -> tuple[torch.Tensor, SFTSums | DPOSums, bool]:
    """One micro-batch's loss, divided by the batch's `size` (sft: the NLL of its action tokens, rl/sft.py; dpo:
    the DPO loss of its pairs against the reference, rl/dpo.py), its statistics, and whether they are finite."""
    micro = micro.to(accelerator.device)
    if dpo:
        loss, sums, finite = dpo_terms(models, micro, beta, offload_reference, accelerator)
    else:
        loss, sums, finite = sft_terms(models.policy, micro, accelerator)
    return loss / max(size, 1e-9), sums, finite
