"""train.py --dry-run (rl/memory.py): the plan's model state is what training allocates, its activations what a
forward keeps, sharding divides them, and the plan needs no weights."""

import pytest
import torch
from accelerate import Accelerator

import train
from rl.memory import activation_bytes, parameters, plan
from rl import model as model_lib
from rl.model import build_models, load_model

SETTINGS = dict(algo="grpo", lora_rank=0, lora_targets=("all-linear",), processes=1, sharded=False, reference=True,
                offload_reference=False, micro_tokens=4096, checkpointing=False, engine="vllm", engine_share=0.3,
                engine_sleeps=True, gpu_gib=80.0, batch=64, context=4096, logits_elements=2**26)


def state_bytes(models) -> dict[str, int]:
    """What a built, stepped policy really holds: its weights, its gradients, AdamW's moments."""
    policy = models.policy
    return {"weights": sum(p.numel() * p.element_size() for p in policy.parameters()),
            "gradients": sum(p.numel() * 4 for p in policy.parameters() if p.requires_grad),
            "moments": sum(t.numel() * t.element_size() for state in models.optimizer.state.values()
                           for key, t in state.items() if key in ("exp_avg", "exp_avg_sq"))}


@pytest.mark.slow
def test_the_model_state_is_what_training_allocates(tmp_path):
    accelerator = Accelerator(cpu=True)
    config = load_model("tiny-agent").config
    for flags, lora in (([], 0), (["--lora-rank", "8"], 8)):
        args = train.parse_args(["--out-dir", str(tmp_path), *flags])
        models = build_models(args, accelerator, args.model)
        for p in models.policy.parameters():  # one optimizer step creates the moments
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        models.optimizer.step()
        real = state_bytes(models)
        estimate = plan(config, **SETTINGS | {"lora_rank": lora})["phases"]["update"]
        assert estimate["policy weights (fp32)"] == real["weights"]
        assert estimate["AdamW moments (fp32)"] == real["moments"]
        assert estimate["gradients (fp32)"] == real["gradients"]
        assert parameters(config, lora)[1] == sum(p.numel() for p in models.policy.parameters() if p.requires_grad)
        accelerator.free_memory()


def test_activations_are_what_a_forward_keeps():
    """Measured with saved-tensor hooks on the embedded model (fp32 here: twice the plan's 16-bit bytes)."""
    model = load_model("tiny-agent")
    weights = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        if tensor.data_ptr() not in weights:
            kept[tensor.data_ptr(), tensor.numel()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=torch.randint(3, 500, (1, 1024)))
    assert 0.95 < sum(kept.values()) / (2 * activation_bytes(model.config, 1024, False)) < 1.05


def test_sharding_divides_the_state_and_a_plan_needs_no_weights(monkeypatch, capsys):
    config = load_model("tiny-agent").config
    alone = plan(config, **SETTINGS)["phases"]["update"]
    sharded = plan(config, **SETTINGS | {"processes": 8, "sharded": True})["phases"]["update"]
    assert sharded["AdamW moments (fp32)"] == alone["AdamW moments (fp32)"] / 8
    assert alone["policy weights (fp32)"] / 8 < sharded["policy weights (fp32)"] < alone["policy weights (fp32)"] / 2
    monkeypatch.setattr(model_lib, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights loaded")))
    assert train.main(train.parse_args(["--dry-run", "--engine", "hf", "--gpu-gib", "0.01"])) is None
    printed = capsys.readouterr().out
    assert "memory plan per GPU: tiny-agent" in printed and "does not fit" in printed
    train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", "configs/fsdp2.yaml", "--gpu-gib", "80"]))
    printed = capsys.readouterr().out
    assert "configs/fsdp2.yaml: FSDP over 8 processes" in printed and "fits" in printed
    train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", "configs/zero3.yaml", "--gpu-gib", "80"]))
    printed = capsys.readouterr().out  # (DeepSpeed under bf16: bf16 weights, and the fp32 ones in its optimizer)
    assert "configs/zero3.yaml: DEEPSPEED over 8 processes" in printed and "fp32 master weights" in printed
    zero3 = plan(config, **SETTINGS | {"processes": 8, "sharded": True, "bf16_weights": True})["phases"]["update"]
    assert zero3["policy weights (bf16)"] == sharded["policy weights (fp32)"] / 2
    assert zero3["fp32 master weights"] == alone["policy weights (fp32)"] / 8
    # offload configs: the shards in CPU memory, a gathered layer on the GPU; DeepSpeed holds its gradients throughout
    offloaded = plan(config, **SETTINGS | {"processes": 8, "sharded": True, "offload": True,
                                          "persistent_gradients": True})["phases"]
    assert offloaded["update"]["AdamW moments (fp32), shards in CPU memory"] == 0
    layer = alone["policy weights (fp32)"] / config.num_hidden_layers
    assert offloaded["update"]["policy weights (fp32), shards in CPU memory"] == layer
    assert "gradients (fp32), shards in CPU memory" in offloaded["rollout"]
    for launch in ("configs/fsdp2_offload.yaml", "configs/zero3_offload.yaml"):
        train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", launch, "--gpu-gib", "80"]))
        assert "AdamW moments (fp32), shards in CPU memory" in capsys.readouterr().out, launch
