"""scripts/gpu_check.sh, the one command for a lent GPU, in its CPU smoke mode: every section runs the code that the GPU
run runs (train.py's models, engine and update; FSDP2 under accelerate launch), at a tiny size with the real Qwen
tokenizer, prints its figures, and the closing table says that every check passed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl import artifacts

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_runs_every_section_in_its_cpu_smoke_mode(tmp_path):
    missing = [problem for name in ("tokenizers/qwen3/tokenizer.json", "templates/qwen2_5.jinja")
               if (problem := artifacts.problem(name))]
    if missing and not (ROOT / ".gpu" / "tokenizer").is_dir():
        pytest.skip(f"{missing[0]}: run `python -m rl.artifacts`")
    env = os.environ | {"GPU_CHECK_DIR": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=840)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]

    rollout = re.search(r"\[rollout smoke\] 4 episodes, (\d+) turns, ([\d,]+) sampled tokens .*token-exact: yes "
                        r"\((\d+) whole .*mean ([-\d.e]+), max ([-\d.e]+) .*: within", out)
    assert rollout, out[-4000:]
    assert int(rollout[1]) >= 4 and int(rollout[2]) > 0 and int(rollout[3]) >= 1
    # (bf16 on this CPU, a left-padded KV-cache decode against one right-padded forward: measured mean 3e-05, max 0.0019)
    assert float(rollout[4]) < 1e-3 and float(rollout[5]) < 1e-2
    for label in ("update full smoke", "update lora smoke", "fsdp2 update full smoke"):
        update = re.search(rf"\[{label}\] 1 steps of 2 x 128 tokens .*: ([\d,]+) tokens/s, ([\d.]+) TFLOP/s model "
                           rf"FLOPs, MFU n/a .*peak ([\d.]+) GiB .*plan's ([\d.]+) GiB.*finite: yes; log-probs in fp32: yes; a bare "
                           rf".*: ([\d,]+) tokens/s, ours / bare ([\d.]+)", out)
        assert update, (label, out[-4000:])
        assert float(update[1].replace(",", "")) > 0 and float(update[3]) > 0 and float(update[4]) > 0
        assert float(update[5].replace(",", "")) > 0 and float(update[6]) > 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["section"] for row in rows] == ["device", "rollout smoke", "update full smoke", "update lora smoke",
                                                "fsdp2 update full smoke"]
    assert all(row["ok"] and row["seconds"] > 0 for row in rows)
    assert "5 sections in" in out and "all checks passed" in out


def test_the_gpu_check_makes_its_accelerator_from_train_pys_flag_groups():
    """The accelerator as train.py's main makes it, from the flags of the Args that gpu_check parses (--deterministic
    lives in the engine's flag group, --mixed-precision in the model's): the smoke run's first line, in a second."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    from accelerate.state import AcceleratorState

    args = gpu_check.train_args("tiny-agent", gpu_check.SMOKE, lora=False)[0]
    AcceleratorState._reset_state(reset_partial_state=True)  # (the process's other tests run fp32)
    try:
        accelerator, precision = gpu_check.accelerator_of(args)
        assert precision == accelerator.mixed_precision == "bf16"  # (the smoke run's: bf16 as on a GPU, on a CPU too)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
