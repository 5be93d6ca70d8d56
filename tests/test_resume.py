"""A run killed with SIGKILL at any moment and started again with the same command line (--resume auto)
ends with the same logs, step for step, as a run that was never stopped: the checkpoint holds every
piece of state, is written atomically, and the logs are cut back to what the checkpoint saw."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import Accelerator

import envs
import train
from rl.run import RunArgs, find_checkpoint, run_directory

CRASH = Path(__file__).parent / "crash_train.py"
# HF engine: its sampler's random stream is saved (vLLM's too under --deterministic: tests/test_deterministic.py).
# Checkpoints every 2 steps, so that a crash also throws away logged steps past the last checkpoint.
FLAGS = ["--engine", "hf", "--steps", "5", "--save-every", "2", "--keep-checkpoints", "2", "--tasks-per-step", "2",
         "--n", "2", "--horizon", "2", "--max-new-tokens", "16", "--lr", "0.01", "--resume", "auto", "--eval-every", "0"]


def launch(out: Path, point: str = "none", n: int = 0, *extra: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    command = [sys.executable, str(CRASH), point, str(n), *FLAGS, *extra, "--out-dir", str(out), "--run-name", "r"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600).returncode


def logged(run_dir: Path) -> tuple[list[dict], list[dict]]:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics], rollouts


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_anywhere_and_resumed_the_run_logs_what_an_uninterrupted_run_logs(tmp_path):
    assert launch(tmp_path / "whole") == 0
    crashed = tmp_path / "crashed"
    # Each launch is the same command line; each crash lands somewhere else (calls counted per launch):
    kills = [
        ("rollout", 12),  # step 2's rollout (8 env steps a step), before any checkpoint: starts over
        ("update", 3),  # step 3's update, after the step-2 checkpoint: resumes at 3
        ("checkpoint", 1),  # writing the step-4 checkpoint: a torn .tmp, resumes at 3 again
        ("log", 5),  # step 5's rollout log line, torn, after the step-4 checkpoint: resumes at 5
    ]
    for point, n in kills:
        assert launch(crashed, point, n) == -9, f"the {point} crash did not happen"
    assert (crashed / "r" / "checkpoints" / "step_4.tmp").exists() is False  # cleaned when step 4 was saved again
    assert launch(crashed) == 0

    whole, resumed = logged(tmp_path / "whole" / "r"), logged(crashed / "r")
    assert [m["charts/step"] for m in resumed[0]] == [1, 2, 3, 4, 5]
    assert resumed[0] == whole[0]  # every metric but timings, exactly
    assert resumed[1] == whole[1]  # every trajectory
    checkpoints = sorted(p.name for p in (crashed / "r" / "checkpoints").iterdir())
    assert checkpoints == ["step_4", "step_5"]  # --keep-checkpoints 2, nothing half-written left


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_asynchronous_run_killed_and_resumed_trains_every_task_group_once(tmp_path):
    """--max-staleness 2: in-flight episodes (the next two steps' sets, begun while a step updated) are not in the
    checkpoint; the resumed run plays those sets anew, so every step of the data cursor trains its own task groups,
    once, whatever was under way when the process died. Under --context window:1 (up to 3 turns: the third turn's
    prompt slides, a segment of its own), a resumed run's in-flight windows start over with their sets."""
    async_flags = ("--max-staleness", "2", "--context", "window:1", "--horizon", "3")
    kills = [
        ("update", 3),  # step 3's update (one micro-batch a step), after the step-2 checkpoint: sets 3-5 under way
        ("rollout", 10),  # resumed at 3: mid-rollout of sets 3-5, begun again from the step-2 weights
    ]
    for point, n in kills:
        assert launch(tmp_path, point, n, *async_flags) == -9, f"the {point} crash did not happen"
    assert launch(tmp_path, "none", 0, *async_flags) == 0

    metrics, rollouts = logged(tmp_path / "r")
    assert [m["charts/step"] for m in metrics] == [1, 2, 3, 4, 5]
    args = train.parse_args([*FLAGS, *async_flags, "--run-name", "r", "--out-dir", str(tmp_path)])
    (env,) = args.env
    train_ids = envs.load_task_ids(args.train_tasks, env) if args.train_tasks else envs.splits(env)["train"]
    for step in range(1, 6):
        played = sorted(r["task_id"] for r in rollouts if r["step"] == step)
        assert played == sorted(train.tasks_for(step, train_ids, 2, args.seed) * 2), step  # each group once, n = 2
        assert all(step - 3 <= v <= step - 1 for r in rollouts if r["step"] == step for v in r["versions"])
    assert any(r["segments"] == 2 for r in rollouts) and all(r["segments"] == max(1, r["turns"] - 1) for r in rollouts)


def test_resume_auto_and_run_directories(tmp_path):
    run_dir = tmp_path / "r"
    assert find_checkpoint("auto", str(tmp_path), "r") is None  # nothing yet: a new run
    (run_dir / "checkpoints" / "step_3.tmp").mkdir(parents=True)  # a crash while writing step 3
    (run_dir / "checkpoints" / "step_2").mkdir()
    (run_dir / "checkpoints" / "step_2" / "trainer_state.json").write_text('{"step": 2}')
    (run_dir / "checkpoints" / "step_10").mkdir()  # numbers, not names, order checkpoints
    (run_dir / "checkpoints" / "step_10" / "trainer_state.json").write_text('{"step": 10}')
    assert find_checkpoint("auto", str(tmp_path), "r") == run_dir / "checkpoints" / "step_10"
    (run_dir / "config.json").write_text("{}")
    assert find_checkpoint(str(run_dir), "runs", None) == run_dir / "checkpoints" / "step_10"
    # a new run (no --resume auto) does not write into a directory that holds another run
    with pytest.raises(SystemExit, match="already holds a run: continue it with --resume auto --run-name r"):
        run_directory(Accelerator(), RunArgs(out_dir=str(tmp_path), run_name="r"), "babyai-grpo")
