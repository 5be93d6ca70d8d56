"""Supervised fine-tuning on trajectories: cross-entropy on the action tokens (loss_mask 1) only,
so the model learns what the assistant said and never the prompt or the observations; and packing,
several conversations per row with no attention across them (their positions restart at each:
rl/logprobs.forward_inputs)."""

from __future__ import annotations

import torch

from rl.logprobs import token_logprobs


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean negative log-likelihood of the action tokens of a collated or packed batch."""
    logprobs, _ = token_logprobs(model, batch["input_ids"], batch.get("attention_mask"), batch["loss_mask"],
                                 position_ids=batch.get("position_ids"))
    mask = batch["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


def pack(sequences: list[tuple[list[int], list[int]]], max_tokens: int, pad_id: int) -> dict:
    """(token ids, loss mask) sequences packed into rows of at most `max_tokens`, none split, longest
    first into the first row with room. Returns input_ids, loss_mask and position_ids [R, L] (positions
    restart at 0 for every sequence, as if it were alone, which keeps sequences from attending to each other;
    a pad is at position 0, a sequence of its own), and `rows`: the sequence indices of each row, in order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0])):
        n = len(sequences[i][0])
        if n > max_tokens:
            raise ValueError(f"a sequence of {n} tokens does not fit in rows of {max_tokens}")
        row = next((r for r, left in enumerate(room) if left >= n), None)
        if row is None:
            rows.append([])
            room.append(max_tokens)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    width = max(max_tokens - left for left in room)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width))
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            ids, mask = sequences[i]
            span = slice(start, start + len(ids))
            input_ids[r, span], loss_mask[r, span] = torch.tensor(ids), torch.tensor(mask, dtype=torch.float32)
            position_ids[r, span] = torch.arange(len(ids))
            start += len(ids)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids, "rows": rows}
