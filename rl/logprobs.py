"""Trajectories -> padded tensors, and the log-prob of every action token under a model.

Only positions that predict an action token (loss_mask 1) go through the LM head: observation
tokens dominate multi-turn sequences, and the [tokens x vocab] logits are the largest tensor of a
step (8k tokens x 152k vocab is 5 GB in fp32), so this is most of the memory of a training step.
"""

from __future__ import annotations

import torch


def collate(trajectories, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors: input_ids, attention_mask, loss_mask, and the sampler's logprobs."""
    width = max(1, max(len(t.token_ids) for t in trajectories))
    batch = {
        "input_ids": torch.full((len(trajectories), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(trajectories), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(trajectories), width), dtype=torch.float32),
        "sampler_logprobs": torch.zeros((len(trajectories), width), dtype=torch.float32),
    }
    for row, t in enumerate(trajectories):
        n = len(t.token_ids)
        batch["input_ids"][row, :n] = torch.tensor(t.token_ids, dtype=torch.long)
        batch["attention_mask"][row, :max(n, 1)] = 1  # an empty trajectory (failed reset) attends to one pad:
        # a row with nothing to attend to would make NaN logits, and NaN * 0 is still NaN
        batch["loss_mask"][row, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        batch["sampler_logprobs"][row, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    return batch


def pad(sequences: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """(token ids, loss mask) sequences as right-padded [B, T] input_ids, attention_mask and loss_mask."""
    width = max(1, max(len(ids) for ids, _ in sequences))
    batch = {"input_ids": torch.full((len(sequences), width), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(sequences), width), dtype=torch.long),
             "loss_mask": torch.zeros((len(sequences), width), dtype=torch.float32)}
    for row, (ids, mask) in enumerate(sequences):
        batch["input_ids"][row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        batch["attention_mask"][row, :max(len(ids), 1)] = 1
        batch["loss_mask"][row, :len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return batch


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature: float = 1.0,
                   with_entropy: bool = False, position_ids=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token_t | tokens_<t) at every action token, under softmax(logits / temperature).

    input_ids, loss_mask: [B, T]; attention_mask [B, T], or [B, 1, T, T] with position_ids [B, T] for
    packed rows (rl/sft.py: pack). Returns logprobs [B, T] (0 where no column of the batch has an action
    token) and, if asked, the entropy of the same distributions [B, T].
    """
    columns = loss_mask.any(0).nonzero().squeeze(1)  # token positions with an action token in any row
    columns = columns[columns > 0]  # position 0 has no prediction (it is always prompt anyway)
    if columns.numel() == 0:
        # no action token at all: still score one (masked) position, so that the graph reaches every
        # weight; under DDP every process must produce gradients for the same parameters
        columns = torch.full((1,), input_ids.shape[1] - 1, device=input_ids.device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=(columns - 1).clamp(min=0)).logits
    logits = logits.float() / (temperature if temperature > 0 else 1.0)  # [B, K, V]
    logp_all = logits.log_softmax(-1)
    picked = logp_all.gather(-1, input_ids[:, columns].unsqueeze(-1)).squeeze(-1)  # [B, K]
    logprobs = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device)
    logprobs[:, columns] = picked
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, K]
        entropy = torch.zeros(input_ids.shape, dtype=ent.dtype, device=ent.device)
        entropy[:, columns] = ent
    return logprobs, entropy


def token_values(critic, input_ids, attention_mask, loss_mask) -> torch.Tensor:
    """The critic's value of the state before every action token: values[t] = V(tokens_<t), read off the
    hidden state at t - 1 (the position whose output also predicts token t). [B, T], 0 off the mask."""
    out = critic(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0].float()  # [B, T]
    values = torch.zeros_like(out)
    values[:, 1:] = out[:, :-1]
    return values * loss_mask
