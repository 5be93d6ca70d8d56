"""HFEngine: sampling with a Hugging Face causal LM and its own KV-cache loop (the engine contract: rl/engines); its
cache and one-token attention are in rl/engines/hf_decoding.py."""

from __future__ import annotations

import time

import torch

from rl.engines import RoundEngine, Sample


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
        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logprobs = self._decode(prompts, limits)
        finally:
            self.model.train(was_training)
        samples = []
        for row, limit_row in enumerate(limits):
            ids = tokens[row][:max(limit_row, 0)]
            end = next((k + 1 for k, t in enumerate(ids) if t in self.fmt.stop_ids), len(ids))
            samples.append(Sample(ids[:end], logprobs[row][:end]))
        return samples

    def _decode(self, prompts: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's sampled tokens and their log-probs, up to the longest limit (the caller cuts each row)."""
        from rl.engines.hf_decoding import decode_attention, decode_cache  # (transformers: imported when needed)

        model, device = self.model, self.model.device
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
        with decode_attention():
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
        return torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()

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
