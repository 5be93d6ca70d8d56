"""The HF engine's decoding (rl/engines/hf.py): a KV cache that grows in place and attention on grouped heads for
one-token steps.

Decoding a token costs a few small matmuls; with transformers' own cache and attention it also copied the whole KV
cache twice per layer (torch.cat of the cache and the new token; then repeat_kv, which copies each key/value head once
per query head of its group: SDPA takes no grouped heads under a padding mask): 55 ms a step for 48 rows of 600
tokens on the embedded model, 80% of it copies. Here the cache grows in place (GrowingLayer) and a one-token step
attends on grouped heads without repeating them (grouped_decode_attention, in transformers' registry in place of
SDPA while the engine decodes): 12 ms, the same arithmetic up to the order of a sum (log-probs within 1e-5 of
before). Prefill, training, models that call SDPA themselves and every other attention implementation are untouched.

What it changes end to end depends on the share of decoding: one-turn rollouts of long prompts (the learning tests'
bandit) play 1.4x faster; a default step's multi-turn rollout, where the engine prefills each turn's whole
conversation again, is still prefill-bound (scripts/bench.py --sections rollout: 128 -> 130 tokens/s).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             is_causal=None, **kwargs):
    """SDPA, except a one-token step of grouped-query attention: each key/value head's group of query heads is laid
    out as that head's query rows, (B, H, 1, d) -> (B, H_kv, H/H_kv, d), so no key or value is copied per query head;
    the padding mask (B, 1, 1, kv) broadcasts over the group. A mask per head, a position bias or sinks take SDPA's
    own path."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if length != 1 or heads == kv_heads or not shared_mask or any(kwargs.get(extra) is not None
                                                                   for extra in ("position_bias", "s_aux")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query.reshape(batch, kv_heads, heads // kv_heads, dim), key, value,
                                         attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


class GrowingLayer(DynamicLayer):
    """A layer of the KV cache that decoding writes in place: the prefill is kept as it comes (reorder_cache may pick
    its rows), then the keys and values move into buffers with room for a few more tokens (64, or a quarter of what
    is held, at most up to `room` new tokens), which grow by that again when full; the layer's keys and values are
    views of them. DynamicLayer's torch.cat copied the whole cache at every token. HFEngine calls update and
    reorder_cache only (DynamicLayer's crop, reset and the batch_* methods would miss the buffers)."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room
        self.key_buffer = self.value_buffer = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.keys, self.values = key_states, value_states
            self.end = key_states.shape[-2] + self.room  # the most this layer will hold
            return self.keys, self.values
        held = self.keys.shape[-2]
        length = held + key_states.shape[-2]
        if self.key_buffer is None or length > self.key_buffer.shape[-2]:
            size = max(length, min(self.end, length + max(64, length // 4)))
            self.key_buffer, self.value_buffer = (torch.cat([kept, kept.new_empty((*kept.shape[:2], size - held,
                                                                                    kept.shape[-1]))], dim=-2)
                                                  for kept in (self.keys, self.values))
        self.key_buffer[:, :, held:length] = key_states
        self.value_buffer[:, :, held:length] = value_states
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        length = self.keys.shape[-2] if self.is_initialized else 0
        if self.key_buffer is None:
            return super().reorder_cache(beam_idx)
        self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.device))
        self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.device))
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]


def decode_cache(config, room: int):
    """transformers' DynamicCache for `config`, its full-attention layers growing in place (sliding-window layers,
    which drop old tokens, are left as they are); `room`: the most tokens a row will add."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@contextmanager
def decode_attention():
    """Models that look SDPA up in transformers' registry get grouped_decode_attention while the engine decodes (the
    registry's entry for this process, restored after; masks and each model's own checks still see "sdpa")."""
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = grouped_decode_attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = before
