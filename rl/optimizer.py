"""Optimizer steps over mini-batches, for RL (train.py's update) and for SFT/DPO (its offline passes) alike.

    sums = UpdateSums()
    finite = accumulate(accelerator, micro_batches, [("policy", policy, loss_of)], sums)  # forward + backward
    norms = optimizer_steps(models, finite, grad_clip, accelerator, step, sums)         # clip, step, or skip

A mini-batch is one optimizer step however many micro-batches it is split into: gradients accumulate locally
and are all-reduced across processes once, at its last micro-batch. Every process runs as many micro-batches
(the most any of them needs), since a sharded model's passes and the all-reduce are collective. A loss or a
gradient that is NaN or infinite on any process skips the step on all of them; --max-nonfinite-updates such
steps in a row stop the run (stop_on_nonfinite). Statistics for the metrics add up in a typed accumulator
(`Sums`), the reducer sums them over processes (the identity on one process).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from rl import zero3

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a CPU tensor summed (or its max taken) over processes


def reducer(accelerator, op: str = "sum") -> Reduce:
    """A function that sums (or takes the max of) a CPU tensor over processes: the identity on one process."""
    if accelerator.num_processes == 1:
        return lambda t: t
    if op == "max":
        return lambda t: accelerator.gather(t.to(accelerator.device)).max(0, keepdim=True).values.cpu()
    return lambda t: accelerator.reduce(t.to(accelerator.device), "sum").cpu()


# ----------------------------------------------------------------------------------------------
# Statistics of a step, summed over micro-batches


def largest():
    """A field of Sums that keeps the largest value added to it, not their sum."""
    return field(default=0.0, metadata={"largest": True})


@dataclass
class Sums:
    """A typed accumulator: subclasses name the statistics of a micro-batch, and `add` sums another's into this one
    field by field (a `largest()` field keeps the maximum). Every step counts its skipped optimizer steps."""

    nonfinite_updates: int = 0  # optimizer steps skipped for a NaN or infinite loss or gradient

    def add(self, other: Sums) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.metadata.get("largest") else mine + theirs)

    def reduced(self, reduce: Reduce) -> Sums:
        """These sums summed over every process (fp64 on the way, so that counts stay exact; a largest() field would
        need the maximum: SFT's and DPO's sums, which cross processes, have none)."""
        names = [f.name for f in fields(self)]
        totals = reduce(torch.tensor([float(getattr(self, name)) for name in names], dtype=torch.float64)).tolist()
        return type(self)(**{name: type(getattr(self, name))(total) for name, total in zip(names, totals)})


# ----------------------------------------------------------------------------------------------
# Forward and backward over a mini-batch


LossOf = Callable[[dict], tuple[torch.Tensor, Sums, bool]]  # a micro-batch -> (loss, its statistics, finite?)


def accumulate(accelerator, micro_batches: list[dict], passes: list[tuple[str, torch.nn.Module, LossOf]], sums: Sums,
               count: int | None = None, blank: dict | None = None, train: bool = True, progress=None) -> dict[str, bool]:
    """Forward and backward of a mini-batch's micro-batches for each of `passes` (name, model, loss_of), in that
    order, their statistics added to `sums`. `count`: the micro-batches every process runs; past its own, this
    process runs `blank` ones, whose loss weighs nothing and whose statistics are dropped. `train` False: forward
    only, without gradients. Returns, per model, whether every loss of the mini-batch was finite; its backward at
    the last micro-batch knows too (a DeepSpeed engine then skips its step: see backward)."""
    count = len(micro_batches) if count is None else count
    modules = [model for _, model, _ in passes]
    finite = {name: True for name, _, _ in passes}
    for k in range(count):
        last, own = k == count - 1, k < len(micro_batches)
        with gradient_sync(accelerator, modules, now=last) if train else torch.no_grad():
            for name, model, loss_of in passes:
                loss, terms, ok = loss_of(micro_batches[k] if own else blank)
                if own:
                    finite[name] &= ok
                    sums.add(terms)
                else:
                    loss = loss * 0.0
                if train:
                    backward(model, loss, accelerator, last, finite[name])
        if progress is not None:
            progress()
    return finite


def gradient_sync(accelerator, modules: list, now: bool) -> contextlib.ExitStack:
    """No all-reduce of these modules' gradients unless `now`: micro-batches accumulate locally. Except under FSDP2,
    where every micro-batch reduce-scatters: without sync, each process would hold the whole model's unsharded gradient
    between micro-batches, in the policy's reduce dtype (fp32: 4 bytes a parameter on every GPU, 28 GiB at 7B), which
    sharding is there to avoid (found by a review; torchtitan syncs every micro-batch too)."""
    stack = contextlib.ExitStack()
    if not now and accelerator.distributed_type != "FSDP":
        for module in modules:
            stack.enter_context(accelerator.no_sync(module))
    return stack


def backward(model, loss: torch.Tensor, accelerator, last: bool, finite: bool) -> None:
    """Accelerate's backward, or under DeepSpeed the model's engine's own (rl/zero3.py: Accelerate drives only
    the engine it prepared last, and PPO's critic is another), where a loss that was not finite at any
    micro-batch of the mini-batch (`finite` False at its `last`) has the engine skip the step."""
    if zero3.is_engine(model):
        zero3.backward(model, loss, last, finite)
    else:
        accelerator.backward(loss)


# ----------------------------------------------------------------------------------------------
# Optimizer steps, and what stops a run whose steps keep failing


def optimizer_steps(models, finite: dict[str, bool], grad_clip: float, accelerator, step: int,
                    sums: Sums) -> dict[str, float]:
    """An optimizer step of each model named in `finite` (policy, critic: rl/model.py's Models.part), in that
    order, each skipped when its mini-batch's loss (`finite`) or gradient was not finite. Returns the gradient norm
    of each model that stepped."""
    norms = {}
    for name, ok in finite.items():
        grad_norm, nonfinite = optimizer_step(*models.part(name), grad_clip, accelerator, ok)
        count_nonfinite(models, sums, name, step, nonfinite, accelerator)
        if grad_norm is not None:
            norms[name] = grad_norm
    return norms


def optimizer_step(model, optimizer, scheduler, grad_clip: float, accelerator, finite: bool) -> tuple[float | None, bool]:
    """Clip the accumulated gradients, step the optimizer and its scheduler, clear. Returns the gradient
    norm (None when no step was taken) and whether the step was skipped for NaN or inf: a loss (`finite`
    False) or gradient that is not finite on any process leaves the weights, the optimizer's moments and
    the schedule as they were. Under fp16 the loss scaler decides on the gradients (it skips a step
    whose scaled gradients overflowed and lowers its scale, as it should: not a fault). A DeepSpeed engine
    does all of it itself (rl/zero3.py; a loss that was not finite already poisoned its gradients)."""
    if zero3.is_engine(model):
        return zero3.step(model, scheduler)
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), grad_clip))
    flags = torch.tensor([float(not finite), float(not math.isfinite(grad_norm))])
    bad_loss, bad_gradient = (reducer(accelerator)(flags) > 0).tolist()  # every process alike
    if accelerator.scaler is not None and not bad_loss:
        optimizer.step()
        stepped, nonfinite = not optimizer.step_was_skipped, False
    else:
        stepped = not (bad_loss or bad_gradient)
        nonfinite = not stepped
        if stepped:
            optimizer.step()
        elif accelerator.scaler is not None:  # a NaN loss under fp16: close the scaler's step (it lowers its scale)
            accelerator.scaler.update()
    if stepped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return (grad_norm if stepped else None), nonfinite


def count_nonfinite(models, sums: Sums, name: str, step: int, nonfinite: bool, accelerator) -> None:
    """Count an optimizer step of `name` skipped for NaN or inf, or end its streak of them (models.nonfinite_streak,
    per model: a healthy critic does not end the policy's streak)."""
    if not nonfinite:
        models.nonfinite_streak[name] = 0
        return
    models.nonfinite_streak[name] = models.nonfinite_streak.get(name, 0) + 1
    sums.nonfinite_updates += 1
    if accelerator.is_main_process:
        tqdm.write(f"warning: step {step}: NaN or infinite {name} loss or gradient, optimizer step skipped "
                   f"({models.nonfinite_streak[name]} in a row)")


def stop_on_nonfinite(models, batch, limit: int, accelerator, run_dir: Path, step: int) -> None:
    """After `limit` (--max-nonfinite-updates) optimizer steps in a row were skipped for NaN or infinite values,
    save this step's RL batch (each process's share; None for SFT/DPO) and stop: something upstream of the loss
    is broken."""
    streak = max(models.nonfinite_streak.values(), default=0)
    if streak < limit:
        return
    where = run_dir / f"nonfinite_step_{step}"
    if batch is not None:
        where.mkdir(parents=True, exist_ok=True)
        tensors = {key: value.contiguous() for key, value in batch.full.tensors().items()} | {"scores": batch.scores}
        save_file(tensors, str(where / f"batch_{accelerator.process_index}.safetensors"))
    message = (f"step {step}: {streak} optimizer steps in a row had a NaN or infinite loss or gradient and were "
               "skipped; " + (f"this step's batch is in {where} (input_ids, loss_mask, sampler_logprobs, advantages, "
                              "...). Check the rewards and " if batch is not None else "check the data and ")
               + "the model's dtype, or start a new run with a lower --lr.")
    accelerator.wait_for_everyone()  # (every process's share is written before any exits)
    raise SystemExit(message if accelerator.is_main_process else 1)
