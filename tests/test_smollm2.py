"""SmolLM2-135M-Instruct (`--model smollm2-135m`: a genuinely pretrained model, a 49k BPE vocabulary, its own ChatML
template) through train.py on the HF engine, one step each: GRPO in full, GRPO with LoRA, and SFT on expert data.
The smallest settings that still run a real step (one task, two samples, one turn of 8 tokens; one expert
conversation): a finite loss and gradient norm in the step's metrics line, and its checkpoint written (under LoRA,
the adapter alone). Slow-marked: a step of a 135M model takes seconds to tens of seconds on 2 cores."""

import json
import math
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import train
from rl.model import is_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_expert_data  # noqa: E402

pytestmark = pytest.mark.slow

# (--kl-coef 0: no reference model to load and run, the update being the step's cost on a CPU)
SMALL = ["--model", "smollm2-135m", "--engine", "hf", "--steps", "1", "--eval-every", "0", "--max-tokens", "1024",
         "--kl-coef", "0"]
RL = ["--tasks-per-step", "1", "--n", "2", "--horizon", "1", "--max-new-tokens", "8"]


def one_step(tmp_path, *flags) -> tuple[Path, dict]:
    """Run train.py for one step; the step's metrics and its checkpoint, checked to have been written."""
    run_dir = train.main(train.parse_args([*SMALL, *flags, "--out-dir", str(tmp_path), "--run-name", "smol"]))
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["charts/step"] == 1
    assert math.isfinite(metrics["losses/grad_norm"]) and metrics["losses/grad_norm"] > 0
    checkpoint = run_dir / "checkpoints" / "step_1"
    assert (checkpoint / "trainer_state.json").is_file()
    return checkpoint, metrics


def test_one_grpo_step_in_full(tmp_path):
    checkpoint, metrics = one_step(tmp_path, *RL)
    assert math.isfinite(metrics["losses/policy"]) and metrics["rollout/tokens"] > 0
    assert (checkpoint / "model.safetensors").is_file() and not is_adapter(str(checkpoint))


def test_one_grpo_step_with_lora_saves_only_the_adapter(tmp_path):
    checkpoint, metrics = one_step(tmp_path, *RL, "--lora-rank", "8")
    assert math.isfinite(metrics["losses/policy"])
    assert is_adapter(str(checkpoint)) and not (checkpoint / "model.safetensors").exists()
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)


def test_one_sft_step_on_expert_data(tmp_path):
    data = tmp_path / "expert.jsonl"
    # (the first 12 train tasks hold two the oracle solves in one turn: conversations of ~510 tokens)
    make_expert_data.main(["--env", "babyai", "--limit", "12", "--horizon", "1", "--max-tokens", "1024",
                           "--model", "smollm2-135m", "--out", str(data)])
    checkpoint, metrics = one_step(tmp_path, "--algo", "sft", "--data", str(data), "--batch-size", "1")
    assert math.isfinite(metrics["sft/loss"])
    assert (checkpoint / "model.safetensors").is_file()
