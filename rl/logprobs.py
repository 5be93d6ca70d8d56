"""Trajectories -> padded tensors, and the log-prob (and entropy) of every action token under a model.

Only positions that predict an action token (loss_mask 1) go through the LM head: observation tokens
dominate multi-turn sequences. Even so the [positions x vocab] logits would be the largest tensors of a
step (3k action tokens x 152k vocab is 1.8 GB in fp32, and softmax, log-softmax and entropy each keep a
copy for the backward pass), so the head scores them in chunks of at most CHUNK_ELEMENTS logits, and
under autograd each chunk's logits are recomputed in the backward pass instead of kept: a step holds one
chunk's logits at a time. The chunking happens inside the model's forward (its output layer returns
[log-prob, entropy] pairs instead of logits while scoring), so that a sharded model (FSDP2, ZeRO-3) has its
output layer's weights gathered, and its backward hooks fire, as in any forward.

Packed rows (several sequences a row, rl/batch.py: RL's trajectories, SFT's conversations) carry no attention
mask of ours: positions that restart at 0 mark where a sequence begins, and transformers builds the block-causal
mask from them in the form that the model's attention implementation needs (`forward_inputs`). A boolean mask of ours was right under SDPA
only: eager attention adds the mask to the scores, so True/False added 1/0 and masked nothing (log-probs 1.7 nats
off those of each sequence alone).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

# the most logits (positions x vocab) scored at once: 256 MB in fp32
CHUNK_ELEMENTS = 2**26


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


def forward_inputs(model, input_ids, attention_mask, position_ids) -> dict:
    """The keyword arguments of a scoring forward: for a padded batch, its attention_mask [B, T], or none when every
    row is right-padded (ours are: `pad`, `collate`, rl/batch.py) and the attention is not flash attention's: a token
    then attends to the tokens before it, all of its own row, exactly as under the mask, and the pads after it change
    nothing it sees, so the causal mask alone gives the same log-probs (bit for bit here) while SDPA takes its fused
    causal kernel instead of materialising a [B, 1, T, T] mask (the embedded agent's update 1.3x faster on a CPU core;
    flash attention keeps the mask, any implementation of it, a hub kernel's too: it unpads by it, skipping the pads'
    work); for packed rows,
    attention_mask None and position_ids [B, T], restarting at 0 at each sequence (padding sits at position 0,
    each pad a sequence of its own). Transformers then finds the sequences from the positions
    (masking_utils.find_packed_sequence_indices) and masks across them as the model's attention implementation
    needs: a boolean mask for SDPA, an additive one (finfo.min) for eager, a BlockMask for flex attention, the
    sequences' boundaries (varlen) for flash attention, which finds them in a single row only. It looks at the
    positions only without a KV cache, so the forward never makes one (a config's use_cache would)."""
    if attention_mask is None and position_ids is not None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

        implementation = _module(model).config._attn_implementation
        masking = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation)
        if masking is None:
            raise SystemExit(f"packed rows need an attention implementation that transformers masks by position ids "
                             f"(sdpa, eager, flex_attention, flash_attention_2), not this model's {implementation!r}")
        if masking is flash_attention_mask and input_ids.shape[0] > 1:
            raise SystemExit(f"{implementation} keeps packed sequences apart in one row a forward only, and this "
                             f"micro-batch has {input_ids.shape[0]}: give --micro-batch-size 1")
    elif attention_mask is not None and right_padded(attention_mask) and "flash" not in attention_of(model):
        attention_mask = None
    return {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}


def attention_of(model) -> str:
    """The model's attention implementation (its config's), or "" for a model without one."""
    return getattr(getattr(_module(model), "config", None), "_attn_implementation", None) or ""


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a [B, T] attention mask is ones then zeros (its padding, if any, at the end)."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature: float = 1.0,
                   with_entropy: bool = False, position_ids=None,
                   chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token_t | tokens_<t) at every action token, under softmax(logits / temperature).

    input_ids, loss_mask: [B, T]; attention_mask [B, T], or None with position_ids [B, T] for packed rows
    (`forward_inputs`). Returns logprobs [B, T] (0 where no column of the batch has an action token) and, if
    asked, the entropy of the same distributions [B, T]. `model` is a model or its forward (a bound method).
    """
    columns = loss_mask.any(0).nonzero().squeeze(1)  # token positions with an action token in any row
    columns = columns[columns > 0]  # position 0 has no prediction (it is always prompt anyway)
    if columns.numel() == 0:
        # no action token at all: still score one (masked) position, so that the graph reaches every
        # weight; under DDP every process must produce gradients for the same parameters
        columns = torch.full((1,), input_ids.shape[1] - 1, device=input_ids.device)
    targets = input_ids[:, columns]  # [B, K]
    with scoring_head(model, targets, temperature, with_entropy, chunk_elements) as head:
        out = model(input_ids=input_ids, **forward_inputs(model, input_ids, attention_mask, position_ids),
                    logits_to_keep=(columns - 1).clamp(min=0)).logits
        scores = head.scores(out)  # [B, K, 2]: log-prob, entropy
    logprobs = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device)
    logprobs[:, columns] = scores[..., 0]
    entropy = None
    if with_entropy:
        entropy = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device)
        entropy[:, columns] = scores[..., 1]
    return logprobs, entropy


class _Head:
    """The output layer of a model while it scores `targets` [B, K]: hidden states [B, K, H] in, [B, K, 2]
    (log-prob of the target, entropy) out, chunk by chunk. Models whose logits are post-processed after the
    output layer (Gemma's soft-capping) keep their output layer; their logits are then scored whole."""

    def __init__(self, layer, targets, temperature: float, with_entropy: bool, chunk_elements: int, chunked: bool):
        self.targets, self.chunked, self.with_entropy = targets, chunked, with_entropy
        self.temperature = temperature if temperature > 0 else 1.0
        self.rows = max(1, chunk_elements // getattr(layer, "out_features", 1))
        self.linear = type(layer).forward.__get__(layer) if chunked else None  # the layer's own forward, not ours

    def forward(self, hidden):
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), self.targets.reshape(-1)
        recompute = torch.is_grad_enabled() and len(flat) > self.rows  # keep no chunk's logits for the backward
        parts = []
        for start in range(0, len(flat), self.rows):
            part = (flat[start:start + self.rows], targets[start:start + self.rows])
            parts.append(checkpoint(self._score, *part, use_reentrant=False) if recompute else self._score(*part))
        return torch.cat(parts).reshape(*self.targets.shape, 2)

    def _score(self, hidden, targets):
        return _score_logits(self.linear(hidden), targets, self.temperature, self.with_entropy)

    def scores(self, out):
        """The model's output as scores: already scores when the output layer made them, else logits to score."""
        if self.chunked:
            return out
        return _score_logits(out.reshape(-1, out.shape[-1]), self.targets.reshape(-1), self.temperature,
                             self.with_entropy).reshape(*self.targets.shape, 2)


def _score_logits(logits, targets, temperature: float, with_entropy: bool):
    """[N, V] logits, [N] targets -> [N, 2]: log p(target) and the entropy (0 unless asked) under softmax(logits / T)."""
    logp = (logits.float() / temperature).log_softmax(-1)
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros_like(picked)
    return torch.stack([picked, entropy], -1)


@contextlib.contextmanager
def scoring_head(model, targets, temperature: float, with_entropy: bool, chunk_elements: int = CHUNK_ELEMENTS):
    """For the duration of one forward, `model`'s output layer scores `targets` instead of returning logits."""
    module = _module(model)
    layer = module.get_output_embeddings()
    config = getattr(module, "config", None)
    chunked = layer is not None and not getattr(config, "final_logit_softcapping", None)
    head = _Head(layer, targets, temperature, with_entropy, chunk_elements, chunked)
    if chunked:
        layer.forward = head.forward  # (an instance attribute: nn.Module.__call__ finds it first)
    try:
        yield head
    finally:
        if chunked:
            del layer.forward


def _module(model):
    """The model behind a bound forward or a DistributedDataParallel wrapper."""
    module = getattr(model, "__self__", model)  # a bound forward
    return getattr(module, "module", module)  # inside DistributedDataParallel


def token_values(critic, input_ids, attention_mask, loss_mask, position_ids=None) -> torch.Tensor:
    """The critic's value of the state before every action token: values[t] = V(tokens_<t), read off the
    hidden state at t - 1 (the position whose output also predicts token t). [B, T], 0 off the mask; the inputs
    as token_logprobs'."""
    inputs = forward_inputs(critic, input_ids, attention_mask, position_ids)
    out = critic(input_ids=input_ids, **inputs).logits[..., 0].float()
    values = torch.zeros_like(out)
    values[:, 1:] = out[:, :-1]
    return values * loss_mask
