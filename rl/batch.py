"""A step's trajectories as tensors for the update: the padded batch [B, T] on the CPU, where advantages are
computed per trajectory, and the micro-batches that go through the model, with what moves values between them.

    layout = arrange(lengths, micro_batch_size=4)                     # 4 trajectories a micro-batch
    layout = arrange(lengths, token_budget=16384)                     # padded rows x width <= 16k tokens
    layout = arrange(lengths, token_budget=16384, pack=True)          # rows of <= 16k tokens, no padding
    batch = make_batch(trajectories, pad_id, layout, device, count=n)  # n micro-batches (equal on every process)
    batch = make_batch(..., step=step)  # tokens that record their policy version get their lag behind `step`
    rows = pack(sequences, max_tokens, pad_id)                        # SFT's conversations, packed the same way

Micro-batches are made of length-sorted trajectories, so a padded one wastes little. With `pack`, several
trajectories share a row: positions restart at each one, which is what keeps them from attending to each other
(rl/logprobs.forward_inputs), so a trajectory's log-probs are those it has alone, whatever the model's attention
implementation (tests/test_batch.py, tests/test_sft.py), and a row holds no padding but its tail. Every process
must run the same number of micro-batches, since a data-parallel or sharded backward is collective: `count` pads
a layout with empty micro-batches (one masked token each).

The step's tensors are typed (`StepTensors`, [B, T], and `MicroBatch`, [R, W]): what a mode adds (`lag` under
--max-staleness, `weights` under --reasoning drop, `position_ids` with --pack) and what a phase fills (old and
reference log-probs, old values, advantages, returns, the trainer's log-probs) is None until it is there. The model
sees, per micro-batch: input_ids, attention_mask [R, W] (padded) or position_ids [R, W] (packed), loss_mask,
sampler_logprobs and `segments` (which trajectory of the step each token belongs to, -1 for padding: the
per-trajectory means of rl/losses.aggregate), and `sequence` (which row of `full` it is from: a trajectory, or
under --reasoning drop one turn's sequence; whole in one micro-batch, the unit --mismatch mis judges). `pieces` say
where each trajectory lies.

Under data parallelism the loss of a mini-batch is divided by its token (or sequence) count over all processes
(minibatch_counts), so every token weighs the same wherever it was played; upstream normalises per micro-batch
on each GPU, which `--loss-agg seq-mean-token-mean` (the paper preset's) matches when micro-batches hold one
trajectory, as in its scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from rl import staleness
from rl.losses import Counts
from rl.logprobs import collate, pad
from rl.trajectory import spans

Layout = list[list[list[int]]]  # micro-batches -> rows -> the trajectories (indices) in each row, in order


@dataclass(kw_only=True)
class Rows:
    """Token tensors of rows of a step, [R, W] each (float unless marked): those every row has, and those a mode
    adds or a phase fills (None until then)."""

    input_ids: torch.Tensor  # long
    loss_mask: torch.Tensor  # 1 on action tokens (0 on the tokens of a trajectory that ended in an env error)
    sampler_logprobs: torch.Tensor | None = None  # the engine's log-probs of the sampled tokens (RL's rows)
    attention_mask: torch.Tensor | None = None  # long: padded rows (None in packed micro-batches)
    versions: torch.Tensor | None = None  # the policy version that sampled each token, -1 elsewhere (make_batch
    # without a step: the tokens' lag is unknown)
    lag: torch.Tensor | None = None  # --max-staleness: the updates between the weights that sampled each token and
    # its step's (0 off the action tokens)
    weights: torch.Tensor | None = None  # --reasoning drop: 1 / the action tokens of the row's episode (see `weights`)
    old_logprobs: torch.Tensor | None = None  # pi_old's: with several updates per rollout, or the KL in the reward
    ref_logprobs: torch.Tensor | None = None  # the reference's: with a reference model
    old_values: torch.Tensor | None = None  # the critic's before the update (ppo)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # GAE's, the critic's targets (ppo)
    trainer_logprobs: torch.Tensor | None = None  # the policy's at its first pass of the update, for the rollout log

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor it has, by its field's name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device):
        """The same rows on `device`."""
        return replace(self, **{key: value.to(device) for key, value in self.tensors().items()})


@dataclass(kw_only=True)
class StepTensors(Rows):
    """The step's rows, [B, T] on the CPU: a trajectory each (--reasoning drop: a turn's sequence each), padded."""

    turn: torch.Tensor | None = None  # long: the episode's turn of each action token, -1 elsewhere (set by make_batch)


@dataclass(kw_only=True)
class MicroBatch(Rows):
    """One micro-batch, [R, W] on the device: R rows (padded, or packed with several trajectories each), W wide."""

    segments: torch.Tensor  # long: the episode of each token, -1 on padding
    sequence: torch.Tensor  # long: its row of the step's `full`, -1 on padding
    position_ids: torch.Tensor | None = None  # long: packed rows, restarting at each trajectory (None: padded)


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

    full: StepTensors
    micro: list[MicroBatch]
    pieces: list[list[Piece]]
    scores: torch.Tensor  # [B] outcome rewards
    groups: torch.Tensor  # [B] which task's group
    ok: torch.Tensor  # [B] False where the env failed
    episodes: torch.Tensor  # [B] which episode each row is of (--reasoning drop: a row per turn; else a row per episode)
    anchors: list[list[str | None]]  # per episode: the env's state key before each of its turns (GiGPO's anchor states)
    envs: list[str] = field(default_factory=list)  # [B] each row's env

    @property
    def tokens(self) -> int:
        """Trajectory tokens in the micro-batches (this process's)."""
        return sum(piece.length for pieces in self.pieces for piece in pieces)

    @property
    def positions(self) -> int:
        """Positions in the micro-batches, padding included."""
        return sum(micro.input_ids.numel() for micro in self.micro)


def arrange(lengths: list[int], micro_batch_size: int = 4, token_budget: int = 0, pack: bool = False,
            minimum: int = 1) -> Layout:
    """Which trajectories go into which micro-batch (and row). Without a token budget, `micro_batch_size`
    trajectories each; with one, as many as fit in it (padded: rows x the longest row; packed: one row of at most
    that many tokens, first fit, longest first; a trajectory longer than the budget goes alone). Micro-batches
    are split further, the largest first, until there are at least `minimum` (optimizer steps need one each)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if pack:
        layout = [[row] for row in first_fit(lengths, token_budget, reversed(order))]
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


def first_fit(lengths: list[int], budget: int, order) -> list[list[int]]:
    """Rows of at most `budget` tokens: each index of `order` in turn into the first row with room for it, else
    into a new row (alone, if it is longer than the budget)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        row = next((r for r, left in enumerate(room) if left >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(budget)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def pack(sequences: list[tuple[list[int], list[int]]], max_tokens: int, pad_id: int) -> dict:
    """(token ids, loss mask) sequences (SFT's conversations) packed into rows of at most `max_tokens`, none split,
    longest first into the first row with room. Returns a packed micro-batch's input_ids, loss_mask, position_ids
    (restarting at 0 for every sequence, as if it were alone, which keeps sequences from attending to each other;
    a pad is at position 0, a sequence of its own) and segments, and `rows`: the sequence indices of each row, in
    order."""
    lengths = [len(ids) for ids, _ in sequences]
    if max(lengths) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit in rows of {max_tokens}")
    rows = first_fit(lengths, max_tokens, sorted(range(len(sequences)), key=lambda i: -lengths[i]))
    micro = _micro(StepTensors(**pad(sequences, pad_id)), rows, _place(rows, lengths), pad_id, True, "cpu")
    return micro.tensors() | {"rows": rows}


def _members(micro: list[list[int]]) -> list[int]:
    return [i for row in micro for i in row]


def _halves(micro: list[list[int]]) -> list[list[list[int]]]:
    """A micro-batch as two: its rows halved, or a packed row's trajectories."""
    if len(micro) > 1:
        return [micro[:len(micro) // 2], micro[len(micro) // 2:]]
    row = micro[0]
    return [[row[:len(row) // 2]], [row[len(row) // 2:]]]


def rows_of(trajectories) -> tuple[list, list[int]]:
    """The rows an update trains on, and the episode (index in `trajectories`) of each: a trajectory is one row, or
    under --reasoning drop and --context window (rollout.py: Trajectory.sequences) one row per segment, each with
    the versions of the turns it sampled and the episode's outcome (rl/context.py: how they weigh)."""
    rows, episodes = [], []
    for k, traj in enumerate(trajectories):
        if not traj.sequences:
            rows.append(replace(traj))
            episodes.append(k)
        first = 0  # (the episode's first turn sampled in the segment: a segment's turns are its runs of loss-mask 1)
        for ids, mask, logprobs in traj.sequences:
            sampled = len(spans(mask))
            rows.append(replace(traj, token_ids=ids, loss_mask=mask, logprobs=logprobs, sequences=[],
                                versions=traj.versions[first:first + sampled],
                                summary_spans=[s - first for s in traj.summary_spans if first <= s < first + sampled]))
            episodes.append(k)
            first += sampled
    return rows, episodes


def make_batch(trajectories, pad_id: int, layout: Layout, device, count: int | None = None,
               pack: bool = False, episodes: list[int] | None = None, step: int | None = None) -> Batch:
    """The step's tensors: `full` from every trajectory (a row each; `episodes`: the episode each row is of, by
    default its own), and a micro-batch per entry of `layout`, padded with empty micro-batches up to `count`.
    Trajectories that record the versions of their tokens (rollout.Rollouts' under --max-staleness) give each token
    its `lag` behind `step`, the step they train (without it, they keep their `versions`)."""
    ok = torch.tensor([t.error is None for t in trajectories])
    full = StepTensors(**collate(trajectories, pad_id))
    full.loss_mask *= ok[:, None]
    width = full.loss_mask.shape[1]
    if any(t.versions for t in trajectories):  # (Rollouts': the policy version of every sampled token, -1 elsewhere)
        versions = torch.tensor([t.token_versions() + [-1] * (width - len(t.token_ids)) for t in trajectories],
                                dtype=torch.float32)
        if step is None:
            full.versions = versions
        else:  # (the updates since the sampling weights: rl/staleness's rule)
            full.lag = staleness.lag(step, versions) * full.loss_mask
    episodes = torch.tensor(range(len(trajectories)) if episodes is None else episodes, dtype=torch.long)
    if len(episodes.unique()) < len(episodes):  # rows of one episode: it weighs as one sequence (see `weights`)
        full.weights = weights(full.loss_mask, episodes)
    full.turn = turns(trajectories, episodes.tolist(), width)
    lengths = [len(t.token_ids) for t in trajectories]
    micro, pieces = [], []
    for rows in layout + [[[]] for _ in range(max(0, (count or 0) - len(layout)))]:
        placed = _place(rows, lengths)
        micro.append(_micro(full, rows, placed, pad_id, pack, device, episodes))
        pieces.append(placed)
    first = {int(e): t for e, t in reversed(list(zip(episodes.tolist(), trajectories)))}  # each episode's first row
    return Batch(full, micro, pieces, scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                 groups=torch.tensor([t.group for t in trajectories], dtype=torch.long), ok=ok, episodes=episodes,
                 anchors=[first[e].states[:first[e].turns] for e in sorted(first)], envs=[t.env for t in trajectories])


def shape_overlong(batch: Batch, rows: list, budgets: dict[str, int], buffer: int, penalty: float,
                   drop: bool) -> None:
    """DAPO's overlong shaping (Yu et al., 2025), on a step's batch in place: with `penalty` P, each episode's score
    loses P x how far its last sequence (the one its token budget bounds) went into the last `buffer` tokens of its
    env's budget (`budgets`), linearly from 0 to P, and an episode the budget ended (finish "max_tokens") loses P;
    with `drop`, those the budget ended leave the loss (mask 0: DAPO's overlong filtering), but stay in their group's
    mean and std, as there. `rows`: the batch's rows (rows_of), in order."""
    last = {episode: len(row.token_ids) for row, episode in zip(rows, batch.episodes.tolist())}  # (its last row's)
    capped = torch.tensor([row.finish == "max_tokens" for row in rows], dtype=torch.bool)
    if penalty:
        lengths = torch.tensor([last[episode] for episode in batch.episodes.tolist()], dtype=torch.float32)
        start = torch.tensor([budgets[row.env] - buffer for row in rows], dtype=torch.float32)
        soft = ((lengths - start) / buffer).clamp(0, 1)
        batch.scores = batch.scores - penalty * torch.where(capped, torch.ones_like(soft), soft)
    if drop and capped.any():
        batch.full.loss_mask[capped] = 0
        dropped = capped.nonzero().squeeze(1)
        for micro in batch.micro:
            micro.loss_mask = micro.loss_mask * ~torch.isin(micro.sequence, dropped.to(micro.sequence.device))


def turns(trajectories, episodes: list[int], width: int) -> torch.Tensor:
    """[B, T]: the episode's turn that each action token was sampled in, -1 on everything else. A row holds all its
    episode's turns, or (segments: rows_of) the turns after those of the episode's rows before it."""
    seen: dict[int, int] = {}
    rows = []
    for traj, episode in zip(trajectories, episodes):
        offset, own = seen.get(episode, 0), traj.token_turns()
        seen[episode] = offset + len(spans(traj.loss_mask)) - len(traj.summary_spans)  # (its env turns)
        rows.append([t + offset if t >= 0 else -1 for t in own] + [-1] * (width - len(traj.token_ids)))
    return torch.tensor(rows, dtype=torch.long)


def weights(mask: torch.Tensor, episodes: torch.Tensor) -> torch.Tensor:
    """[B, T]: 1 / the action tokens of the row's episode, on every token. A sequence-mean loss sums terms x weights
    per episode (rl/losses.aggregate): each episode's token mean, however its rows fall into micro-batches, so that
    an episode played as one row per turn (--reasoning drop) weighs what it weighs as one row."""
    per_episode = torch.zeros(int(episodes.max()) + 1).index_add(0, episodes, mask.float().sum(1))
    return (1.0 / per_episode.clamp(min=1))[episodes][:, None].expand_as(mask).clone()


def _place(rows: list[list[int]], lengths: list[int]) -> list[Piece]:
    """Where each trajectory of these rows lies: one after the other in its row."""
    return [Piece(i, r, sum(lengths[j] for j in row[:k]), lengths[i])
            for r, row in enumerate(rows) for k, i in enumerate(row)]


def _micro(full: StepTensors, rows: list[list[int]], pieces: list[Piece], pad_id: int, pack: bool, device,
           episodes: torch.Tensor | None = None) -> MicroBatch:
    """One micro-batch (the tensors of `full` it has: input_ids, loss_mask, sampler_logprobs, and those of weights,
    versions, lag there are), with `segments`, the episode of each token, and `sequence`, its row of `full` (-1:
    padding). An empty one holds a single masked pad token."""
    width = max([1] + [piece.offset + piece.length for piece in pieces])
    copied = {key: torch.zeros((len(rows), width)) for key in ("loss_mask", "sampler_logprobs", "weights", "versions",
                                                               "lag") if getattr(full, key) is not None}
    tensors = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long), **copied,
               "segments": torch.full((len(rows), width), -1, dtype=torch.long),
               "sequence": torch.full((len(rows), width), -1, dtype=torch.long)}
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for piece in pieces:
        span = slice(piece.offset, piece.offset + piece.length)
        for key in ("input_ids", *copied):
            tensors[key][piece.row, span] = getattr(full, key)[piece.trajectory, :piece.length]
        tensors["segments"][piece.row, span] = piece.trajectory if episodes is None else int(episodes[piece.trajectory])
        tensors["sequence"][piece.row, span] = piece.trajectory
        position_ids[piece.row, span] = torch.arange(piece.length)
    if pack:  # (the tail's pads at position 0: each a sequence of its own)
        tensors["position_ids"] = position_ids
    else:
        tensors["attention_mask"] = (tensors["segments"] >= 0).long()
        tensors["attention_mask"][:, 0] = 1  # an empty row attends to its one pad (all-masked rows give NaN)
    return MicroBatch(**{key: value.to(device) for key, value in tensors.items()})


def scatter(batch: Batch, keys: tuple[str, ...]) -> None:
    """Copy the micro-batches' tensors named `keys` (fields of MicroBatch that a phase filled) into `full`."""
    for key in keys:
        values = [getattr(micro, key) for micro in batch.micro]
        if any(value is not None for value in values):
            setattr(batch.full, key, to_full(batch, values))


def to_full(batch: Batch, values: list[torch.Tensor | None]) -> torch.Tensor:
    """[B, T] on the CPU from one [R, W] tensor per micro-batch (None: nothing of it), 0 where none lies."""
    full = torch.zeros_like(batch.full.loss_mask)
    for pieces, micro_values in zip(batch.pieces, values):
        if micro_values is None:
            continue
        micro_values = micro_values.float().cpu()
        for piece in pieces:
            full[piece.trajectory, :piece.length] = micro_values[piece.row, piece.offset:piece.offset + piece.length]
    return full


def attach(batch: Batch, advantages: torch.Tensor, returns: torch.Tensor | None) -> None:
    """Give every micro-batch its trajectories' advantages (and returns), on its device."""
    batch.full.advantages = advantages
    if returns is not None:
        batch.full.returns = returns
    for pieces, micro in zip(batch.pieces, batch.micro):
        for key in ("advantages", "returns"):
            if getattr(batch.full, key) is None:
                continue
            values = torch.zeros(micro.input_ids.shape)
            for piece in pieces:
                values[piece.row, piece.offset:piece.offset + piece.length] = \
                    getattr(batch.full, key)[piece.trajectory, :piece.length]
            setattr(micro, key, values.to(micro.input_ids.device))


def minibatch_counts(minibatch: list[MicroBatch], reduce, processes: int) -> Counts:
    """What the losses of a mini-batch are divided by: its action tokens and its sequences with any
    action token, over every process's share of it (`reduce` sums over processes: rl/optimizer.py's reducer),
    divided by the number of processes (a fraction when there are fewer than processes), since data-parallel
    training averages the processes' gradients. So each token (or sequence) weighs the same wherever it was
    played; with per-process counts a token on a process with 10 action tokens would weigh 19x one on
    a process with 190."""
    local = torch.tensor([sum(float(m.loss_mask.sum()) for m in minibatch), count_sequences(minibatch)],
                         dtype=torch.float64)
    return Counts(*(reduce(local) / processes).tolist())


def count_sequences(minibatch: list[MicroBatch]) -> float:
    """Episodes with an action token in a mini-batch's micro-batches (rows, or segments of packed rows). Under
    --reasoning drop an episode's turns may lie in several micro-batches, or mini-batches: each counts the share of
    the episode's action tokens it holds (the tokens' `weights` summed), so that every episode counts once."""
    if minibatch[0].weights is not None:
        return float(sum((micro.loss_mask * micro.weights).sum() for micro in minibatch))
    return len(set().union(*(micro.segments[micro.loss_mask > 0].unique().tolist() for micro in minibatch)))


def example_micro_batches(examples: list, size: int, pad_id: int, pairs: bool = False) -> list[MicroBatch]:
    """SFT's and DPO's examples (rl/data.py: examples_of) as micro-batches: conversations packed into rows as long as
    the longest of them (no attention across conversations; longer rows would only add attention across the
    mask), `size` rows each; with `pairs` (dpo), `size` pairs each, chosen rows first, then their rejected ones."""
    if pairs:
        return [padded([c for c, _ in examples[i:i + size]] + [r for _, r in examples[i:i + size]], pad_id)
                for i in range(0, len(examples), size)]
    packed = pack(examples, max(len(ids) for ids, _ in examples), pad_id)
    rows = len(packed.pop("rows"))
    return [MicroBatch(**{key: value[i:i + size] for key, value in packed.items()}) for i in range(0, rows, size)]


def padded(sequences: list[tuple[list[int], list[int]]], pad_id: int) -> MicroBatch:
    """(token ids, loss mask) sequences as one micro-batch of right-padded rows, a sequence each, on the CPU."""
    rows = [[i] for i in range(len(sequences))]
    return _micro(StepTensors(**pad(sequences, pad_id)), rows, _place(rows, [len(ids) for ids, _ in sequences]), pad_id,
                  False, "cpu")
