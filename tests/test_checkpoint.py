"""rl/checkpoint.py: optimizer and random state round-trip through safetensors and JSON exactly, a half
deleted checkpoint is never taken for complete, and resuming from an older checkpoint sets the newer
ones aside instead of mixing two histories."""

import json
import random

import numpy as np
import pytest
import torch

from rl import checkpoint as checkpoint_lib


def draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_random_state_round_trips(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    draws()
    checkpoint_lib.save_rng(tmp_path / "rng.safetensors")
    expected = [draws() for _ in range(3)]
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    checkpoint_lib.load_rng(tmp_path / "rng.safetensors")
    assert [draws() for _ in range(3)] == expected


def test_optimizer_state_round_trips_and_steps_identically(tmp_path):
    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)

    def train_step(model, optimizer, seed):
        torch.manual_seed(seed)
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = model_and_optimizer()
    for seed in range(3):
        train_step(model, optimizer, seed)
    checkpoint_lib.save_optimizer(optimizer, tmp_path / "optimizer.safetensors")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer, 7)

    restored, restored_optimizer = model_and_optimizer()
    restored.load_state_dict(weights)
    checkpoint_lib.load_optimizer(restored_optimizer, tmp_path / "optimizer.safetensors")
    train_step(restored, restored_optimizer, 7)
    for key, value in model.state_dict().items():
        assert torch.equal(value, restored.state_dict()[key])


def test_a_resumed_optimizer_keeps_this_runs_kernel_and_fp16_keeps_torchs_default(tmp_path, monkeypatch):
    """rl/model.adamw: fused on a GPU, except under fp16 (GradScaler's skipped steps must stay visible) and DeepSpeed;
    a checkpoint written by another kernel (on a CPU, or before fused AdamW) resumes with this run's, not its own."""
    import types

    from rl.model import adamw

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (fused AdamW runs on CPU tensors too)
    run = {f"{kind} {mixed}": types.SimpleNamespace(distributed_type=kind, mixed_precision=mixed)
           for kind, mixed in (("NO", "bf16"), ("NO", "fp16"), ("DEEPSPEED", "bf16"))}
    kernels = {name: adamw(accelerator, torch.nn.Linear(4, 3).parameters(), 0.1, 0.0).param_groups[0]["fused"]
               for name, accelerator in run.items()}
    assert kernels == {"NO bf16": True, "NO fp16": None, "DEEPSPEED bf16": None}
    saved = torch.nn.Linear(4, 3)
    foreach = torch.optim.AdamW(saved.parameters(), lr=0.1)
    saved(torch.randn(5, 4)).sum().backward()
    foreach.step()
    checkpoint_lib.save_optimizer(foreach, tmp_path / "optimizer.safetensors")
    model = torch.nn.Linear(4, 3)
    fused = adamw(run["NO bf16"], model.parameters(), 0.1, 0.0)
    checkpoint_lib.load_optimizer(fused, tmp_path / "optimizer.safetensors")
    assert fused.param_groups[0]["fused"] is True and fused.state[model.weight]["step"] == 1
    model(torch.randn(5, 4)).sum().backward()
    fused.step()
    assert fused.state[model.weight]["step"] == 2


def make(run_dir, step, complete=True):
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text("weights")
    if complete:
        (path / checkpoint_lib.STATE).write_text(json.dumps({"step": step}))
    return path


def test_only_complete_checkpoints_count_and_removal_unmarks_first(tmp_path, monkeypatch):
    make(tmp_path, 2), make(tmp_path, 10), make(tmp_path, 12, complete=False)
    (tmp_path / "checkpoints" / "step_14.tmp").mkdir()
    assert [p.name for p in checkpoint_lib.checkpoints(tmp_path)] == ["step_2", "step_10"]
    checkpoint_lib.prune(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_10", "step_12"]

    # a checkpoint's mark goes first, so that a crash mid-delete never leaves one that looks complete
    final = tmp_path / "checkpoints" / "step_10"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_lib.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_lib.remove(final)
    assert final.exists() and checkpoint_lib.checkpoints(tmp_path) == []


def test_resuming_from_an_older_checkpoint_sets_the_newer_ones_and_the_logs_aside(tmp_path):
    old, newer = make(tmp_path, 2), [make(tmp_path, 4), make(tmp_path, 6)]
    (tmp_path / "metrics.jsonl").write_text('{"charts/step": 1}\n' * 6)
    aside = checkpoint_lib.supersede(tmp_path, old, ("metrics.jsonl", "rollouts.jsonl"))
    assert checkpoint_lib.checkpoints(tmp_path) == [old]
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_4", "step_6"]
    assert (aside / "metrics.jsonl").read_text() == (tmp_path / "metrics.jsonl").read_text()
    assert not any(p.exists() for p in newer)
    assert checkpoint_lib.supersede(tmp_path, old, ("metrics.jsonl",)) is None  # nothing newer: nothing moves
