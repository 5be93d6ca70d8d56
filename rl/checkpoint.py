"""Checkpoints that resume a run exactly and are safe to open: safetensors and JSON only, written atomically.

A checkpoint is a directory runs/<run>/checkpoints/step_<k>:

    model.safetensors, config.json, tokenizer   the policy: a Hugging Face model directory (eval.py, vLLM)
    state/critic.safetensors                    PPO's critic
    state/<name>.safetensors                    each optimizer: its tensors, its param groups as JSON metadata
                                                (<name>_<process>: each process's shard, under FSDP2
                                                and ZeRO-3, whose shard also holds its fp32 weights)
    state/schedulers.json                       the learning-rate schedulers (and fp16's loss scaler)
    state/rng_<process>.safetensors             Python's, NumPy's and torch's (CPU, CUDA) random state
    state/sampler_<process>.safetensors         the rollout engine's sampler
    trainer_state.json                          the step and how far the run's logs got: written last

It is written as step_<k>.tmp, every file fsynced, then renamed into place, so a crash at any moment
leaves either the whole checkpoint or none (a leftover .tmp is not a checkpoint). Nothing here
unpickles: a checkpoint from elsewhere cannot run code when it is opened.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

STATE = "trainer_state.json"


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all: beside its final name, fsynced, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync(path.parent)


def publish(tmp: Path, final: Path) -> None:
    """Make a fully written directory `tmp` the checkpoint `final`, atomically."""
    for path in sorted(tmp.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [tmp]:  # files, then their dirs
        fsync(path)
    remove(final)  # (this step's checkpoint from a history that a resume from an older one abandoned)
    tmp.rename(final)
    fsync(final.parent)


def remove(checkpoint: Path) -> None:
    """Delete a checkpoint, its completion mark first: one half deleted is never taken for complete."""
    (checkpoint / STATE).unlink(missing_ok=True)
    shutil.rmtree(checkpoint, ignore_errors=True)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    found = [path for path in (Path(run_dir) / "checkpoints").glob("step_*")
             if re.fullmatch(r"step_\d+", path.name) and (path / STATE).is_file()]
    return sorted(found, key=_step)


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete checkpoints, and any unfinished one (0: keep all)."""
    for tmp in (Path(run_dir) / "checkpoints").glob("step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep > 0:
        for path in checkpoints(run_dir)[:-keep]:
            remove(path)


def supersede(run_dir: Path, checkpoint: Path, logs: tuple[str, ...]) -> Path | None:
    """Resuming from `checkpoint` abandons the history after it: move the run's newer checkpoints and a
    copy of its logs (which the resumed run cuts back) to <run_dir>/superseded_<time>/, so that nothing is
    lost and --resume auto never picks a checkpoint of the abandoned history. Returns where, if anything
    was newer."""
    newer = [path for path in checkpoints(run_dir) if _step(path) > _step(checkpoint)]
    if not newer:
        return None
    aside = Path(run_dir) / time.strftime("superseded_%Y%m%d-%H%M%S")
    aside.mkdir()
    for name in logs:
        if (Path(run_dir) / name).is_file():
            shutil.copy2(Path(run_dir) / name, aside / name)
    for path in newer:
        path.rename(aside / path.name)
    fsync(aside)
    fsync(Path(run_dir) / "checkpoints")
    return aside


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[1])


# ----------------------------------------------------------------------------------------------
# Optimizers and random state as tensors + JSON


def save_optimizer(optimizer, path: Path, extra: dict[str, torch.Tensor] | None = None) -> None:
    """An optimizer's state dict: per-parameter tensors as `state.<param>.<key>`, everything else
    (param groups, non-tensor state such as a step count kept as a number) as JSON metadata. A sharded
    parameter's state (a DTensor, FSDP2) is saved as this process's shard, and listed in the metadata.
    `extra` tensors (ZeRO-3's fp32 weights) are saved beside, under their own names."""
    state_dict = optimizer.state_dict()
    tensors, numbers, shards = dict(extra or {}), {}, []
    for param, entries in state_dict["state"].items():
        for key, value in entries.items():
            if hasattr(value, "to_local"):
                shards.append(f"state.{param}.{key}")
                value = value.to_local()
            if torch.is_tensor(value):
                tensors[f"state.{param}.{key}"] = value.detach().cpu().contiguous()
            else:
                numbers.setdefault(str(param), {})[key] = value
    meta = {"param_groups": state_dict["param_groups"], "numbers": numbers, "shards": shards}
    save_file(tensors, str(path), metadata={"optimizer": json.dumps(meta)})


def load_optimizer(optimizer, path: Path) -> dict[str, torch.Tensor]:
    """The inverse of save_optimizer; a shard becomes a DTensor again, laid out as its parameter is. Returns
    the extra tensors."""
    from torch.distributed.tensor import DTensor

    params = [param for group in optimizer.param_groups for param in group["params"]]
    extra = {}
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["optimizer"])
        state: dict[int, dict] = {int(p): dict(v) for p, v in meta["numbers"].items()}
        for name in f.keys():
            if not name.startswith("state."):
                extra[name] = f.get_tensor(name)
                continue
            _, param, key = name.split(".", 2)
            value = f.get_tensor(name)
            if name in meta.get("shards", ()):
                like = params[int(param)]
                value = DTensor.from_local(value.to(like.device), like.device_mesh, like.placements,
                                           shape=like.shape, stride=like.stride())
            state.setdefault(int(param), {})[key] = value
    # (the kernel is this run's choice, rl/model.adamw: a checkpoint saved on a CPU or before fused AdamW keeps it)
    kernels = [{key: group[key] for key in ("fused", "foreach") if key in group} for group in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    for group, kernel in zip(optimizer.param_groups, kernels):
        group.update(kernel)
    return extra


def save_rng(path: Path) -> None:
    """This process's random state: Python's, NumPy's (legacy global generator) and torch's."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python": torch.tensor(words, dtype=torch.int64), "numpy": torch.from_numpy(keys.astype(np.int64)),
               "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    meta = {"python": [version, gauss], "numpy": [kind, pos, has_gauss, cached]}
    save_file(tensors, str(path), metadata={"rng": json.dumps(meta)})


def load_rng(path: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["rng"])
    tensors = load_file(str(path))
    version, gauss = meta["python"]
    random.setstate((version, tuple(tensors["python"].tolist()), gauss))
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors)) if f"cuda.{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
