"""Reproducible runs: with --deterministic a seed fixes the whole run on the vLLM engine too (the HF engine's runs
always repeat), and a run resumed from a checkpoint logs what the uninterrupted run logs; an evaluation during
training never moves the random stream the training rollouts draw from. On a GPU (simulated: none here) a kernel
without a deterministic implementation is an error, said in one sentence, not a warning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "16", "--eval-tasks", "2"]


def logged(run_dir: Path) -> dict:
    """A run's record without timings, by step: metrics (less perf/ and sync/seconds), every trajectory played in
    training, every episode of its evaluations."""
    record = {"metrics": {}, "rollouts": {}, "evaluations": {}}
    for name in record:
        for line in (run_dir / f"{name}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            if name == "metrics":
                record[name][entry["charts/step"]] = {k: v for k, v in entry.items()
                                                      if not k.startswith("perf/") and k != "sync/seconds"}
            else:
                record[name].setdefault(entry["step"], []).append(entry)
    return record


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deterministic_vllm_runs_repeat_and_resume_exactly(tmp_path):
    """A 3-step run and a 1-step run with the same seed, the second then resumed to 3 steps, on vLLM with reflect
    (whose reflections are requests too) and evaluations (steps 0 and 2, and the last): the same trajectories, token
    for token, and the same metrics. The first two launches run side by side, so their envs answer in different
    orders: their step 1 is a repeat of one seed's step in another process, and the resumed steps 2-3 repeat the
    uninterrupted run's from a checkpoint. (A second whole 3-step run checked nothing these two do not.)"""
    pytest.importorskip("vllm")
    flags = ["--engine", "vllm", "--deterministic", "--agent", "reflect", "--attempts", "2", "--eval-every", "2",
             *SMALL, "--out-dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(*more):
        return subprocess.Popen([sys.executable, "train.py", *flags, *more], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finish(*processes):
        for process in processes:
            _, err = process.communicate(timeout=600)
            assert process.returncode == 0, err[-3000:]

    finish(launch("--steps", "3", "--run-name", "a"), launch("--steps", "1", "--run-name", "r"))
    finish(subprocess.Popen([sys.executable, "train.py", "--resume", str(tmp_path / "r" / "checkpoints" / "step_1"),
                             "--steps", "3"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True))
    a, resumed = (logged(tmp_path / name) for name in ("a", "r"))
    assert sorted(a["metrics"]) == [0, 1, 2, 3] and sorted(a["rollouts"]) == [1, 2, 3]
    assert sorted(a["evaluations"]) == [0, 2, 3]
    assert any(t.get("attempt") == 2 for step in a["rollouts"].values() for t in step)  # reflect's second attempts
    # the resumed run also evaluated at step 1, its last step then: the rest is the uninterrupted run's
    assert "eval/avg@k" in resumed["metrics"][1] and resumed["evaluations"].pop(1)
    resumed["metrics"][1] = {k: v for k, v in resumed["metrics"][1].items() if not k.startswith("eval/")}
    assert resumed == a


@pytest.mark.slow
def test_an_evaluation_does_not_move_the_training_sampler(tmp_path):
    """HF engine: a 1-step run (which evaluates at its last step) resumed to 2 steps equals a 2-step run (which
    does not evaluate at step 1) from step 2 on. Evaluations used to draw from the training sampler's stream, which
    the checkpoint then saved as the evaluation left it, so step 2 sampled differently (issue 30 measured a step-2
    reward of 0.114 against 0.0 on the tiny preset)."""
    flags = ["--engine", "hf", "--eval-every", "2", *SMALL, "--out-dir", str(tmp_path)]
    whole = train.main(train.parse_args([*flags, "--steps", "2", "--run-name", "whole"]))
    train.main(train.parse_args([*flags, "--steps", "1", "--run-name", "ended"]))
    checkpoint = tmp_path / "ended" / "checkpoints" / "step_1"
    extended = train.main(train.parse_args(["--resume", str(checkpoint), "--steps", "2"]))
    whole, extended = logged(whole), logged(extended)
    assert extended["metrics"][2] == whole["metrics"][2]
    assert extended["rollouts"] == whole["rollouts"]
    assert extended["evaluations"][2] == whole["evaluations"][2]


class NoAccelerator:
    """Accelerate's Accelerator in its place, on a machine that says it has a GPU and has none."""

    distributed_type = "NO"

    def __init__(self, **kwargs):
        pass


def test_deterministic_on_a_gpu_makes_kernels_without_a_deterministic_one_an_error(monkeypatch):
    import accelerate

    from rl.model import make_accelerator

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # (restored to absent after the test)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, warn_only=False: modes.append((mode, warn_only)))
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    monkeypatch.setattr(accelerate, "Accelerator", NoAccelerator)
    make_accelerator(deterministic=True)
    assert modes == [(True, False)]  # warn_only=True let a nondeterministic kernel pass with a warning
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def test_a_kernel_without_a_deterministic_implementation_stops_the_run_in_one_sentence():
    from torch._prims_common import alert_not_deterministic

    from rl.model import stop_on_nondeterministic

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        with pytest.raises(RuntimeError) as raised:
            alert_not_deterministic("index_add_cuda_")  # what such a kernel calls, as torch words it
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    with pytest.raises(SystemExit) as stopped:
        stop_on_nondeterministic(raised.value)
    message = str(stopped.value)
    assert message.startswith("--deterministic: index_add_cuda_ has no deterministic GPU kernel") and "\n" not in message
    stop_on_nondeterministic(RuntimeError("CUDA out of memory"))  # any other error: left to its caller
