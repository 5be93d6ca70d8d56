"""A step's trajectories as tensors for the update: the padded batch [B, T] on the CPU, where advantages are
computed per trajectory, and the micro-batches that go through the model, with what moves values between them.

    layout = plan(lengths, micro_batch_size=4)                        # 4 trajectories a micro-batch
    layout = plan(lengths, token_budget=16384)                        # padded rows x width <= 16k tokens
    layout = plan(lengths, token_budget=16384, pack=True)             # rows of <= 16k tokens, no padding
    batch = make_batch(trajectories, pad_id, layout, device, count=n)  # n micro-batches (equal on every process)

Micro-batches are made of length-sorted trajectories, so a padded one wastes little. With `pack`, several
trajectories share a row: positions restart at each one, which is what keeps them from attending to each other
(rl/logprobs.forward_inputs), so a trajectory's log-probs are those it has alone, whatever the model's attention
implementation (tests/test_batch.py), and a row holds no padding but its tail. Every process must run the same
number of micro-batches, since a data-parallel or sharded backward is collective: `count` pads a layout with
empty micro-batches (one masked token each).

The model sees, per micro-batch: input_ids, attention_mask [R, W] (padded) or position_ids [R, W] (packed),
loss_mask, sampler_logprobs and `segments` (which trajectory of the step each token belongs to, -1 for padding:
the per-trajectory means of rl/losses.aggregate). `pieces` say where each trajectory lies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.logprobs import collate

Layout = list[list[list[int]]]  # micro-batches -> rows -> the trajectories (indices) in each row, in order


@dataclass
class Piece:
    """Where one trajectory's tokens lie in a micro-batch."""

    trajectory: int  # its row in the full batch
    row: int  # its row in the micro-batch
    offset: int  # where it starts in that row
    length: int


@dataclass
class Batch:
    """`full`: padded [B, T] tensors on the CPU; `micro`: the micro-batches on the device; `pieces[i]`: where the
    trajectories of micro-batch i lie. A trajectory that ended in an env error is no outcome: its tokens are not
    trained on (mask 0), but it stays, so that its process runs the same micro-batches as the others."""

    full: dict[str, torch.Tensor]
    micro: list[dict[str, torch.Tensor]]
    pieces: list[list[Piece]]
    scores: torch.Tensor  # [B] outcome rewards
    groups: torch.Tensor  # [B] which task's group
    ok: torch.Tensor  # [B] False where the env failed

    @property
    def tokens(self) -> int:
        """Trajectory tokens in the micro-batches (this process's)."""
        return sum(piece.length for pieces in self.pieces for piece in pieces)

    @property
    def positions(self) -> int:
        """Positions in the micro-batches, padding included."""
        return sum(micro["input_ids"].numel() for micro in self.micro)


def plan(lengths: list[int], micro_batch_size: int = 4, token_budget: int = 0, pack: bool = False,
         minimum: int = 1) -> Layout:
    """Which trajectories go into which micro-batch (and row). Without a token budget, `micro_batch_size`
    trajectories each; with one, as many as fit in it (padded: rows x the longest row; packed: one row of at most
    that many tokens, first fit, longest first; a trajectory longer than the budget goes alone). Micro-batches
    are split further, the largest first, until there are at least `minimum` (optimizer steps need one each)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if pack:
        rows: list[list[int]] = []
        for i in reversed(order):  # longest first, into the first row with room
            room = next((row for row in rows if sum(lengths[j] for j in row) + lengths[i] <= token_budget), None)
            if room is None:
                rows.append([i])
            else:
                room.append(i)
        layout = [[row] for row in rows]
    elif token_budget:
        layout, current = [], []
        for i in order:  # ascending: the newest is the longest of its micro-batch
            if current and (len(current) + 1) * lengths[i] > token_budget:
                layout.append(current)
                current = []
            current.append(i)
        layout = [[[i] for i in group] for group in layout + ([current] if current else [])]
    else:
        layout = [[[i] for i in order[k:k + micro_batch_size]] for k in range(0, len(order), micro_batch_size)]
    while len(layout) < minimum and any(len(_members(micro)) > 1 for micro in layout):
        largest = max(range(len(layout)), key=lambda k: len(_members(layout[k])))
        layout[largest:largest + 1] = _halves(layout[largest])
    return layout


def _members(micro: list[list[int]]) -> list[int]:
    return [i for row in micro for i in row]


def _halves(micro: list[list[int]]) -> list[list[list[int]]]:
    """A micro-batch as two: its rows halved, or a packed row's trajectories."""
    if len(micro) > 1:
        return [micro[:len(micro) // 2], micro[len(micro) // 2:]]
    row = micro[0]
    return [[row[:len(row) // 2]], [row[len(row) // 2:]]]


def make_batch(trajectories, pad_id: int, layout: Layout, device, count: int | None = None,
               pack: bool = False) -> Batch:
    """The step's tensors: `full` from every trajectory, and a micro-batch per entry of `layout`, padded with
    empty micro-batches up to `count`."""
    ok = torch.tensor([t.error is None for t in trajectories])
    full = collate(trajectories, pad_id)
    full["loss_mask"] *= ok[:, None]
    lengths = [len(t.token_ids) for t in trajectories]
    micro, pieces = [], []
    for rows in layout + [[[]] for _ in range(max(0, (count or 0) - len(layout)))]:
        placed = [Piece(i, r, sum(lengths[j] for j in row[:k]), lengths[i])
                  for r, row in enumerate(rows) for k, i in enumerate(row)]
        micro.append(_micro(full, rows, placed, pad_id, pack, device))
        pieces.append(placed)
    return Batch(full, micro, pieces, scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                 groups=torch.tensor([t.group for t in trajectories], dtype=torch.long), ok=ok)


def _micro(full: dict, rows: list[list[int]], pieces: list[Piece], pad_id: int, pack: bool, device) -> dict:
    """One micro-batch's tensors. An empty one holds a single masked pad token."""
    width = max([1] + [piece.offset + piece.length for piece in pieces])
    micro = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
             "loss_mask": torch.zeros((len(rows), width)), "sampler_logprobs": torch.zeros((len(rows), width)),
             "segments": torch.full((len(rows), width), -1, dtype=torch.long)}
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for piece in pieces:
        span = slice(piece.offset, piece.offset + piece.length)
        for key in ("input_ids", "loss_mask", "sampler_logprobs"):
            micro[key][piece.row, span] = full[key][piece.trajectory, :piece.length]
        micro["segments"][piece.row, span] = piece.trajectory
        position_ids[piece.row, span] = torch.arange(piece.length)
    if pack:  # (the tail's pads at position 0: each a sequence of its own)
        micro["position_ids"] = position_ids
    else:
        micro["attention_mask"] = (micro["segments"] >= 0).long()
        micro["attention_mask"][:, 0] = 1  # an empty row attends to its one pad (all-masked rows give NaN)
    return {key: value.to(device) for key, value in micro.items()}


def scatter(batch: Batch, keys: tuple[str, ...]) -> None:
    """Copy the micro-batches' tensors named `keys` into `full`, [B, T] on the CPU."""
    for pieces, micro in zip(batch.pieces, batch.micro):
        for key in keys:
            if key not in micro:
                continue
            target = batch.full.setdefault(key, torch.zeros_like(batch.full["loss_mask"]))
            values = micro[key].float().cpu()
            for piece in pieces:
                target[piece.trajectory, :piece.length] = values[piece.row, piece.offset:piece.offset + piece.length]


def attach(batch: Batch, advantages: torch.Tensor, returns: torch.Tensor | None) -> None:
    """Give every micro-batch its trajectories' advantages (and returns), on its device."""
    batch.full["advantages"] = advantages
    if returns is not None:
        batch.full["returns"] = returns
    for pieces, micro in zip(batch.pieces, batch.micro):
        for key in ("advantages", "returns"):
            if key not in batch.full:
                continue
            values = torch.zeros(micro["input_ids"].shape)
            for piece in pieces:
                values[piece.row, piece.offset:piece.offset + piece.length] = batch.full[key][piece.trajectory, :piece.length]
            micro[key] = values.to(micro["input_ids"].device)


def count_sequences(micro: dict) -> int:
    """Trajectories with an action token in a micro-batch (rows, or segments of packed rows)."""
    segments = micro["segments"][micro["loss_mask"] > 0]
    return int(segments.unique().numel())
