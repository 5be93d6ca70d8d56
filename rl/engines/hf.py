"""HFEngine: sampling with a Hugging Face causal LM and its own KV-cache loop (the engine contract: rl/engines).

Decoding a token costs a few small matmuls; with transformers' own cache and attention it also copied the whole KV
cache twice per layer (torch.cat of the cache and the new token; then repeat_kv, which copies each key/value head once
per query head of its group: SDPA takes no grouped heads under a padding mask): 55 ms a step for 48 rows of 600
tokens on the embedded model, 80% of it copies. Here the cache grows in place (GrowingLayer) and a one-token step
runs attention on grouped heads without repeating them (grouped_decode_attention): 12 ms, the same arithmetic up to
the order of a sum (log-probs within 1e-5 of before). Prefill, training and every other attention implementation
are untouched.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rl.engines import RoundEngine, Sample

DECODE_ATTENTION = "sdpa_grouped_decode"  # registered with transformers below: "sdpa" but for one-token steps


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             is_causal=None, **kwargs):
    """SDPA, except a one-token step of grouped-query attention: each key/value head's group of query heads is laid
    out as that head's query rows, (B, H, 1, d) -> (B, H_kv, H/H_kv, d), so no key or value is copied per query head;
    the padding mask (B, 1, 1, kv) broadcasts over the group."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads == kv_heads:
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
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@contextmanager
def decode_attention(model):
    """The model's attention is grouped_decode_attention while decoding, where it was SDPA."""
    config = model.config
    before = config._attn_implementation
    if before == "sdpa":
        config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


class HFEngine(RoundEngine):
    """Sampling with a Hugging Face causal LM and its KV cache. Prompts are left-padded, and a prompt that several
    rows share is prefilled once; each row stops at a stop token or its own token limit. Log-probs are taken under
    softmax(logits / T), the distribution the trainer scores (top-p/top-k only narrow what is drawn)."""

    name = "hf"

    def __init__(self, model, fmt, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 batch_size: int = 64, seed: int = 0, own: bool = False):
        super().__init__()
        self.model, self.fmt, self.own = model, fmt, own  # own: a copy of the trainer's weights, not the trainer's
        self.on_trainer_weights = not own
        self.temperature, self.top_p, self.top_k, self.batch_size = temperature, top_p, top_k, batch_size
        self.generator = torch.Generator(device=model.device).manual_seed(seed)

    @torch.no_grad()
    def load_weights(self, model, weights=None, verify: bool = True) -> dict[str, float]:
        """An engine with its own copy: the trainer's weights copied in ((name, tensor) pairs from `weights`, e.g.
        gathered from shards, else the model's state dict). An engine on the trainer's own model has nothing to do."""
        if not self.own:
            return {}
        start = time.perf_counter()
        mine = self.model.state_dict()
        for name, tensor in weights if weights is not None else model.state_dict().items():
            mine[name].copy_(tensor)
        return {"sync_s": time.perf_counter() - start}

    def generate(self, batch: list, limits: list[int]) -> list[Sample]:
        prompts = [traj.token_ids for traj in batch]
        samples = []
        for i in range(0, len(prompts), self.batch_size):
            samples += self._generate(prompts[i:i + self.batch_size], limits[i:i + self.batch_size])
        return samples

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], limits: list[int]) -> list[Sample]:
        if max(limits) <= 0:
            return [Sample([]) for _ in prompts]
        model, device = self.model, self.model.device
        was_training = model.training
        model.eval()
        # rows with the same prompt (a GRPO group's first turn) are prefilled once, then share that KV cache
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
        width = max(map(len, distinct))
        input_ids = torch.full((len(distinct), width), self.fmt.pad_id, dtype=torch.long)
        attention = torch.zeros((len(distinct), width), dtype=torch.long)
        for row, prompt in enumerate(distinct):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention[row, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = decode_cache(model.config, room=max(limits))
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if len(distinct) < len(prompts):
            rows = torch.tensor(source, device=device)
            cache.reorder_cache(rows)
            logits, attention, positions = logits[rows], attention[rows], positions[rows]
        stop = torch.tensor(sorted(self.fmt.stop_ids), device=device)
        limit = torch.tensor(limits, device=device)
        finished = limit <= 0
        tokens, logprobs = [], []
        with decode_attention(model):
            for step in range(max(limits)):
                token, logprob = self._sample(logits.float())
                tokens.append(token)
                logprobs.append(logprob)
                finished = finished | torch.isin(token, stop) | (limit <= step + 1)
                if finished.all():
                    break
                attention = torch.cat([attention, attention.new_ones((len(prompts), 1))], dim=1)
                positions = positions[:, -1:] + 1
                logits = model(input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                               past_key_values=cache, use_cache=True).logits[:, -1]
        model.train(was_training)

        tokens, logprobs = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
        samples = []
        for row, limit_row in enumerate(limits):
            ids = tokens[row][:max(limit_row, 0)]
            end = next((k + 1 for k, t in enumerate(ids) if t in self.fmt.stop_ids), len(ids))
            samples.append(Sample(ids[:end], logprobs[row][:end]))
        return samples

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.temperature <= 0:
            token = logits.argmax(-1)
            return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        logp = (logits / self.temperature).log_softmax(-1)
        weights = logp.clone()
        if self.top_k > 0:
            kth = weights.topk(min(self.top_k, weights.shape[-1]), dim=-1).values[:, -1:]
            weights = weights.masked_fill(weights < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logp, order = weights.sort(-1, descending=True)
            before = sorted_logp.softmax(-1).cumsum(-1) - sorted_logp.softmax(-1)  # mass strictly above
            sorted_logp = sorted_logp.masked_fill(before >= self.top_p, float("-inf"))
            weights = torch.full_like(weights, float("-inf")).scatter(-1, order, sorted_logp)
        token = torch.multinomial(weights.softmax(-1), 1, generator=self.generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
