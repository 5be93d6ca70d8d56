"""DeepSpeed ZeRO-3 under Accelerate (configs/zero3.yaml): what training does differently there.

Accelerate prepares each model as a DeepSpeed engine that partitions its weights, gradients and optimizer states
over the processes (as FSDP2 does) and gathers a layer's weights for its forward and backward. Three things differ
from the plain PyTorch path, and they are all here:

- The engine steps the optimizer itself (`engine.step()`: clip to `gradient_clipping`, step, zero the gradients),
  and skips a step whose gradients are not finite. (It would step only a scheduler of DeepSpeed's own kinds; ours,
  a LambdaLR on the same optimizer, steps after each applied step.) train.py's update takes a varying number of
  micro-batches per optimizer step and normalises the loss over the whole mini-batch itself, so the engine is
  configured with one micro-batch per "accumulation boundary" (`gradient_accumulation_steps` 1: it never rescales
  the loss) and rl/optimizer.py calls `step()` once, after the mini-batch's last backward; ZeRO-3 accumulates the
  partitioned gradients across the backwards in between. Accelerate drives only the engine it prepared last, and
  PPO has two (policy and critic), so rl/optimizer.py calls each engine's backward and step itself.
- Models are loaded partitioned: once DeepSpeed's config is set, transformers' from_pretrained builds every model
  under ZeRO-3's partitioning (no process ever holds a whole copy of the policy, the reference or the critic). The
  HF engine's own copy, which must be whole, is loaded `unpartitioned`; a critic's weights from a checkpoint go into
  its partitions with `load_weights`.
- Parameters are partitioned tensors (`ds_id`, an empty `.data` outside a gather): reading a whole weight (the
  engine sync, the gradient in tests) goes through `gathered`, one module's parameters at a time.
- The optimizer's state is per process (the flat fp32 partition of the weights it updates and Adam's moments of
  that partition): checkpoints save and restore it as each process's shard (`save_optimizer`, `load_optimizer`),
  in safetensors like the rest of our checkpoints (DeepSpeed's own checkpoints are pickles).

Every other launch never imports DeepSpeed (`keep_out`): on a machine without a GPU its import prints a warning
about its accelerator, in every run of the CPU demo.
"""

from __future__ import annotations

import contextlib

import torch
from safetensors import safe_open

from rl import checkpoint

REQUIRED = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
_ACCELERATE = {}  # Accelerate's own functions that keep_out replaces, to put back


def active(accelerator) -> bool:
    return accelerator.distributed_type == "DEEPSPEED"


def keep_out(accelerator) -> None:
    """Outside a DeepSpeed launch, keep Accelerate from importing DeepSpeed. Its unwrap_model (which its prepare and
    get_state_dict call, and train.py) imports deepspeed whenever the package is installed, only to recognise a
    DeepSpeed engine, of which such a launch has none; the import prints "Setting accelerator to CPU" on a machine
    without a GPU (every CPU run). Accelerate asks is_deepspeed_available() there first: answered no, and as
    before again for a DeepSpeed launch later in the same process."""
    import accelerate.utils.other as other

    original = _ACCELERATE.setdefault("is_deepspeed_available", other.is_deepspeed_available)
    other.is_deepspeed_available = original if active(accelerator) else (lambda: False)


def configure(accelerator, grad_clip: float) -> None:
    """Settle the DeepSpeed config before any prepare(): ZeRO stage 3, one micro-batch per engine step (train.py
    accumulates and normalises), --grad-clip as the engine's clipping, whole weights gathered for saving."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    stage = config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise SystemExit(f"train.py runs DeepSpeed at ZeRO stage 3 (configs/zero3.yaml), not stage {stage}: ZeRO-1/2 "
                         "keep whole weights on every process, which data-parallel training does with less "
                         "(configs/ddp.yaml)")
    if config.get("fp16", {}).get("enabled") in (True, "true"):
        raise SystemExit("DeepSpeed with fp16 skips steps for its loss scaling, which train.py cannot tell from NaN "
                         "steps: use --mixed-precision bf16 (or mixed_precision: bf16 in the launch config)")
    config.update(REQUIRED)
    config["train_batch_size"] = accelerator.num_processes  # (one micro-batch of "1" per process and engine step)
    config["gradient_clipping"] = grad_clip
    # gradients summed over a mini-batch's micro-batches in fp32 (by default ZeRO-3 adds them in the weights' bf16)
    config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # (any dtype: the name is old)
    config.setdefault("zero_force_ds_cpu_optimizer", False)  # an offloaded optimizer stays torch's AdamW


@contextlib.contextmanager
def unpartitioned(accelerator):
    """Models loaded inside are whole, as without DeepSpeed."""
    if not active(accelerator):
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def prepare(accelerator, *objects):
    """accelerator.prepare for a model beside the policy (the reference, PPO's critic): an engine of its own.
    (Accelerate would warn that its backward drives only the first engine: rl/optimizer.py calls each engine's own.)"""
    accelerator.deepspeed_engine_wrapped = None
    return accelerator.prepare(*objects)


def load_weights(model, path) -> None:
    """A safetensors state dict into a model built partitioned, one parameter at a time (gathered, written,
    partitioned again); every process calls this alike."""
    import deepspeed
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    parameters = dict(model.named_parameters())
    missing = sorted(set(parameters) - set(tensors))
    if missing:
        raise SystemExit(f"{path} lacks {len(missing)} of the model's weights, e.g. {missing[0]}")
    with torch.no_grad():
        for name, parameter in parameters.items():
            with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0):
                parameter.copy_(tensors[name])


def offloaded(accelerator) -> bool:
    """Whether this launch keeps the shards of the weights or optimizer states in CPU memory."""
    if not active(accelerator):
        return False
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    return any((zero.get(key) or {}).get("device") == "cpu" for key in ("offload_param", "offload_optimizer"))


def is_engine(model) -> bool:
    """Whether `model` is a DeepSpeed engine (what Accelerate's prepare returns under DeepSpeed)."""
    return hasattr(model, "zero_optimization_stage") and hasattr(model, "was_step_applied")


def backward(model, loss: torch.Tensor, last: bool, finite: bool) -> None:
    """The engine's backward of one micro-batch. A loss that was not finite, on any process and at any micro-batch
    of the mini-batch (`finite` False here), poisons the last backward, so that the engine's step finds NaN
    gradients and skips, as rl/optimizer.py skips such steps everywhere else (the processes agree first: each calls this
    alike)."""
    if last:
        flag = torch.tensor([float(not finite)], device=loss.device)
        torch.distributed.all_reduce(flag)
        if flag.item() > 0:
            loss = loss * float("nan")
    model.backward(loss)


def step(model, scheduler) -> tuple[float | None, bool]:
    """The engine's optimizer step (clipping and zeroing included), then the scheduler's if it was taken. Returns
    the gradient norm before clipping (None when skipped) and whether the step was skipped for NaN or inf."""
    model.step()
    if not model.was_step_applied():
        return None, True
    scheduler.step()
    return float(model.get_global_grad_norm()), False


def gathered(parameters):
    """A context in which these parameters are whole on every process (read only); a no-op for plain ones."""
    parameters = [p for p in parameters if hasattr(p, "ds_id")]
    if not parameters:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)


def full_grad(parameter) -> torch.Tensor | None:
    """A partitioned parameter's whole gradient, between backward and step (every process calls this alike)."""
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(parameter)


def _zero(optimizer):
    """The ZeRO-3 optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


@contextlib.contextmanager
def _inner(zero):
    """The torch optimizer that ZeRO-3 steps on this process's flat fp32 partitions, with them as its parameters
    (DeepSpeed hands them to it only while it steps)."""
    zero._set_fp32_optimizer_param_groups()
    try:
        yield zero.optimizer
    finally:
        zero._clear_fp32_optimizer_param_groups()


def save_optimizer(optimizer, path) -> None:
    """This process's share of a ZeRO-3 optimizer's state (rl/checkpoint.py's format): Adam's moments of its fp32
    partitions, and the partitions themselves (under bf16 the model's weights are bf16 copies of them: saving the
    model alone would round them)."""
    zero = _zero(optimizer)
    masters = {f"master.{i}": flat.detach().cpu().contiguous() for i, flat in enumerate(zero.fp32_partitioned_groups_flat)}
    with _inner(zero) as inner:
        checkpoint.save_optimizer(inner, path, extra=masters)


def load_optimizer(optimizer, path) -> None:
    """The inverse of save_optimizer; the model's partitions are refreshed from the fp32 ones."""
    zero = _zero(optimizer)
    flats = zero.fp32_partitioned_groups_flat
    with safe_open(str(path), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys() if name.startswith("master.")}
    if shapes != {f"master.{i}": tuple(flat.shape) for i, flat in enumerate(flats)}:
        raise SystemExit(f"{path}: its ZeRO-3 partitions do not fit this launch: resume with the same number of "
                         "processes and the same configs/zero3.yaml settings as the run was saved with")
    with _inner(zero) as inner:
        masters = checkpoint.load_optimizer(inner, path)
    with torch.no_grad():
        for i, flat in enumerate(flats):
            flat.copy_(masters[f"master.{i}"])
        for partition, flat in zip(zero.fp16_partitioned_groups_flat, flats):  # (the model's, bf16 or fp32)
            partition.copy_(flat)
