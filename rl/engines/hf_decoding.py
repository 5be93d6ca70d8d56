"""The HF engine's decoding (rl/engines/hf.py): a KV cache that grows in place and attention on grouped heads for
one-token steps.

Decoding a token costs a few small matmuls; with transformers' own cache and attention it also copied the whole KV
cache twice per layer (torch.cat of the cache and the new token; then repeat_kv, which copies each key/value head once
per query head of its group: SDPA takes no grouped heads under a padding mask): 55 ms a step for 48 rows of 600
tokens on the embedded model, 80% of it copies. Here the cache grows in place (GrowingLayer) and a one-token step
runs attention on grouped heads without repeating them (grouped_decode_attention): 12 ms, the same arithmetic up to
the order of a sum (log-probs within 1e-5 of before). Prefill, training and every other attention implementation
are untouched. What it changes end to end depends on the share of decoding: one-turn rollouts of long prompts (the
learning tests' bandit) play 2x faster; a default step's multi-turn rollout, where the engine prefills each turn's
whole conversation again, is still prefill-bound (scripts/bench.py --sections rollout: 128 -> 130 tokens/s).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DECODE_ATTENTION = "sdpa_grouped_decode"  # registered with transformers below: "sdpa" but for one-token steps


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             is_causal=None, **kwargs):
    """SDPA, except a one-token step of grouped-query attention: each key/value head's group of query heads is laid
    out as that head's query rows, (B, H, 1, d) -> (B, H_kv, H/H_kv, d), so no key or value is copied per query head;
    the padding mask (B, 1, 1, kv) broadcasts over the group. Attention with a position bias or sinks takes SDPA's
    own path."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads == kv_heads or any(kwargs.get(extra) is not None for extra in ("position_bias", "s_aux")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query.reshape(batch, kv_heads, heads // kv_heads, dim), key, value,
                                         attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


class GrowingLayer(DynamicLayer):
    """A layer of the KV cache whose keys and values are views of buffers with room for `room` more tokens than the
    prompt (doubling when that runs out): a step writes its token in place instead of copying the cache
    (DynamicLayer's torch.cat). Rows are picked (reorder_cache) once, after a shared prefill."""

    def __init__(self, room: int):
        super().__init__()
        self.room, self.length = room, 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            shape = (*key_states.shape[:2], key_states.shape[2] + self.room, key_states.shape[3])
            self.key_buffer, self.value_buffer = key_states.new_empty(shape), value_states.new_empty(shape)
        length = self.length + key_states.shape[-2]
        if length > self.key_buffer.shape[-2]:
            more = (*key_states.shape[:2], length, key_states.shape[3])
            self.key_buffer = torch.cat([self.key_buffer, self.key_buffer.new_empty(more)], dim=-2)
            self.value_buffer = torch.cat([self.value_buffer, self.value_buffer.new_empty(more)], dim=-2)
        self.key_buffer[:, :, self.length:length] = key_states
        self.value_buffer[:, :, self.length:length] = value_states
        self.length = length
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.device))
            self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.device))
            self.keys = self.key_buffer[:, :, :self.length]
            self.values = self.value_buffer[:, :, :self.length]


def decode_cache(config, room: int):
    """transformers' DynamicCache for `config`, its full-attention layers growing in place (sliding-window layers,
    which drop old tokens, are left as they are)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@contextmanager
def decode_attention(model):
    """The language model's attention is grouped_decode_attention while decoding, where it was SDPA (its text
    config's only: a multimodal model's other towers keep theirs)."""
    config = model.config.get_text_config(decoder=True)
    before = config._attn_implementation
    if before == "sdpa":
        config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
