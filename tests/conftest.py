"""Test settings: never touch the network, never wait on wandb, one OpenMP thread a worker; the runs that tests share (one
short training run for every test that only reads a run's outputs) and the short run of each env's training test.
Tests marked `slow` (pytest.ini) take more than a few seconds: `python -m pytest -q -m "not slow"` leaves them out."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py: spinning OpenMP threads starve env threads
if os.environ.get("PYTEST_XDIST_WORKER"):  # several workers on a few cores (pytest.ini): one OpenMP thread each, and in what it
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # launches, so that the workers do not oversubscribe the cores
os.environ.setdefault("AGENTGYM_RL_PLOTS", "0")  # no PNGs at the end of every short run (tests/test_view.py draws them)


import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

# The tiny preset evaluates the initial and final policies on 104 held-out tasks twice each (about a minute a
# run): the tests' short runs do without, unless they ask for it (--eval-every; tests/test_train.py does).
# Tests that run train.py in a subprocess pass --eval-every 0 themselves.
train.PRESETS["tiny"] = dataclasses.replace(train.PRESETS["tiny"], eval_every=0)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One short GRPO run of the embedded model on BabyAI, shared by every test that only reads what a run writes
    (tests/test_train.py, test_view.py, test_vllm.py): 2 steps of 2 tasks x 2 samples, 2 turns of 16 tokens, and
    evaluations of 4 test tasks x 2 at steps 0 and 2, on the default engine (vLLM where it is installed). Its lr,
    1e-4, is not the preset's (a resumed run must keep the run's own) and small enough that the policy still writes
    whole characters at step 2 (at 0.01 it samples stray bytes, which the viewer shows as raw pieces). A test that
    writes into a run (resumes it, draws its curves) works on a copy."""
    argv = ["--steps", "2", "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "16",
            "--lr", "1e-4", "--eval-every", "2", "--eval-tasks", "4",
            "--out-dir", str(tmp_path_factory.mktemp("trained")), "--run-name", "grpo"]
    return train.main(train.parse_args(argv))


@pytest.fixture
def tiny_run(tmp_path):
    """One training step of the embedded model on an env (2 tasks x 2 samples, 2 turns of 16 tokens),
    then, unless told not to, eval.py on 4 test tasks of its checkpoint. Returns (run directory,
    rollout-log records, eval results or None)."""
    import eval as eval_script

    def run(env: str, *flags: str, evaluate: bool = True):
        args = train.parse_args(["--env", env, "--steps", "1", "--tasks-per-step", "2", "--n", "2", "--horizon", "2",
                                 "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", env, *flags])
        run_dir = train.main(args)
        records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
        results = None
        if evaluate:
            results = eval_script.main(eval_script.Args(model=str(run_dir / "checkpoints" / "step_1"), limit=4, k=1,
                                                        out=str(tmp_path / "eval")))
        return run_dir, records, results

    return run
