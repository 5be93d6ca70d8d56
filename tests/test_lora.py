"""LoRA (--lora-rank): only the adapters train, the reference is the base model (the policy with its adapters
off) while the old log-probs are the adapted policy's, and a saved adapter reloads into eval.py's loader and into
the vLLM engine with the trained policy's log-probs."""

import importlib.util
import json

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

import eval as eval_script
from rl import flags
from rl.flags import build
import train
from rl.losses import kl
from rl.logprobs import token_logprobs
from rl.model import EMBEDDED, build_models, full_weights, is_adapter, load_model, reference
from test_batch import trajectories


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    argv = ["--steps", "2", "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "16",
            "--lora-rank", "8", "--lr", "0.02", "--engine", "hf", "--out-dir", str(tmp_path_factory.mktemp("lora")),
            "--run-name", "lora"]
    return train.main(train.parse_args(argv))


def probe():
    ids = torch.arange(3, 60).reshape(1, -1)
    mask = torch.ones_like(ids)
    return ids, mask, mask.float()


@pytest.mark.slow
def test_only_the_adapters_change_and_the_checkpoint_is_the_adapter(run):
    checkpoint = run / "checkpoints" / "step_2"
    assert is_adapter(str(checkpoint)) and not (checkpoint / "model.safetensors").exists()
    assert {p.suffix for p in checkpoint.rglob("*") if p.is_file()} <= {".safetensors", ".json", ".jinja"}
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert any(float(t.abs().max()) > 0 for name, t in adapter.items() if "lora_B" in name)  # B starts at 0: trained
    base = load_file(EMBEDDED["tiny-agent"] / "model.safetensors")
    trained = load_model(str(checkpoint))
    for name, tensor in trained.get_base_model().state_dict().items():
        name = name.replace(".base_layer.", ".")
        if ".lora_" not in name and name in base:  # (a tied output layer is the embedding)
            assert torch.equal(tensor, base[name]), name  # the base is untouched
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["losses/kl"] == 0 and metrics[-1]["losses/kl"] > 0  # KL to the base, 0 until the adapters move


@pytest.mark.slow
def test_the_reference_is_the_base_model(run):
    trained = load_model(str(run / "checkpoints" / "step_2"))
    base = load_model("tiny-agent")
    ids, mask, loss_mask = probe()
    with torch.no_grad(), trained.disable_adapter():
        off, _ = token_logprobs(trained, ids, mask, loss_mask)
    with torch.no_grad():
        on, _ = token_logprobs(trained, ids, mask, loss_mask)
        expected, _ = token_logprobs(base, ids, mask, loss_mask)
    assert torch.equal(off, expected) and not torch.allclose(on, expected)


def test_old_log_probs_are_the_adapted_policys(tmp_path):
    """Paper-like settings (--minibatches 2, so old log-probs are scored before the update; the KL in the reward):
    the old log-probs are the policy's with its adapters on, only the reference's come with them off, so once the
    adapters have moved the KL penalty is not 0."""
    accelerator = Accelerator(cpu=True)
    args = train.parse_args(["--lora-rank", "8", "--minibatches", "2", "--kl-in-reward", "--tasks-per-step", "4",
                             "--n", "2", "--out-dir", str(tmp_path)])
    torch.manual_seed(0)
    models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
    policy = accelerator.unwrap_model(models.policy)
    for name, parameter in policy.named_parameters():
        if "lora_B" in name:  # adapters that have moved (B starts at 0: the adapted model is the base model)
            torch.nn.init.normal_(parameter, std=0.05)
    played = trajectories()
    for trajectory in played:
        trajectory.group = trajectory.row // 3  # groups of three (in twos, GRPO gives +-0.71 whatever the penalty)
    batch = train.batch_of(played, args, accelerator, 0)
    train.old_logprobs(models, batch, args, accelerator)
    adapters = [p for p in policy.parameters() if p.requires_grad]
    with reference(models, accelerator):  # (PEFT would turn their gradients off: FSDP2 then fixed bf16 ones for good)
        assert adapters and all(p.requires_grad for p in adapters)
    for micro in batch.micro:
        inputs = (micro.input_ids, micro.attention_mask, micro.loss_mask, args.engine_args.temperature)
        with torch.no_grad():
            adapted, _ = token_logprobs(policy, *inputs, position_ids=micro.position_ids)
            with policy.disable_adapter():
                base, _ = token_logprobs(policy, *inputs, position_ids=micro.position_ids)
        torch.testing.assert_close(micro.old_logprobs, adapted, rtol=0, atol=1e-6)
        torch.testing.assert_close(micro.ref_logprobs, base, rtol=0, atol=1e-6)
    full, mask = batch.full, batch.full.loss_mask > 0
    penalty = kl(full.old_logprobs, full.ref_logprobs, args.objective.kl_estimator)[mask]
    assert float(penalty.abs().max()) > 1e-4, f"KL penalty {float(penalty.abs().max())}"
    with_kl, _ = train.advantages_for(args, full, batch.scores, batch.groups, batch.ok, None)
    without, _ = train.advantages_for(flags.replace(args, kl_in_reward=False), full, batch.scores, batch.groups,
                                      batch.ok, None)
    assert not torch.allclose(with_kl, without)  # the penalty reaches the advantages


@pytest.mark.slow
def test_merged_weights_are_the_adapted_model(run):
    """What an engine receives (rl/model.full_weights: base naming, adapters merged) is the adapted model."""
    trained = load_model(str(run / "checkpoints" / "step_2"))
    merged = load_model("tiny-agent")
    weights = dict(full_weights(trained))
    assert weights.keys() == merged.state_dict().keys()
    merged.load_state_dict(weights)
    ids, mask, loss_mask = probe()
    with torch.no_grad():
        adapted, _ = token_logprobs(trained, ids, mask, loss_mask)
        plain, _ = token_logprobs(merged, ids, mask, loss_mask)
    torch.testing.assert_close(plain, adapted, rtol=0, atol=1e-5)
    base = dict(load_model("tiny-agent").state_dict())
    assert all(torch.equal(t, base[n.replace(".base_layer.", ".")]) for n, t in trained.get_base_model().state_dict().items()
               if ".base_layer." in n)  # merging never wrote into the base weights


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_adapter_reloads_into_eval_and_the_engine(run, tmp_path):
    """eval.py on the adapter checkpoint: its vLLM engine loads the base, gets the merged adapter, and its probe
    log-probs equal the trainer's (load_weights checks that); greedy episodes equal the HF engine's on the adapter."""
    checkpoint = str(run / "checkpoints" / "step_2")
    results = {engine: eval_script.main(build(eval_script.Args, model=checkpoint, limit=4, k=1, temperature=0.0, engine=engine,
                                                         out=str(tmp_path / engine)))
               for engine in ("hf", "vllm")}
    episodes = {engine: [json.loads(line) for line in (tmp_path / f"{engine}.jsonl").read_text().splitlines()]
                for engine in results}
    assert [e["messages"] for e in episodes["vllm"]] == [e["messages"] for e in episodes["hf"]]
