"""What a user sees while episodes play and when they stop them (rl/progress.py): progress in turns and tokens with
the time left, on a line that a log gets now and then, not per turn; the share of turns the env refused or could
not read in every summary; and Ctrl-C (SIGINT) in eval.py and train.py: one line, the ended episodes written,
--resume auto from the newest whole checkpoint."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tqdm

import envs
import eval as eval_script
from rl import progress as progress_lib
from rl.engines import RoundEngine, Sample
from rl.engines.expert import ExpertEngine
from rl.metrics import eval_metrics, rl_line
from rl.model import load_tokenizer
from rl.progress import Progress, progress_bar
from rl.scores import score
from rollout import ChatFormat, Trajectory, rollout

ROOT = Path(__file__).resolve().parent.parent
INTERRUPT = Path(__file__).parent / "interrupt.py"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_counts_turns_and_tokens_and_estimates_the_time_left(monkeypatch):
    """The bar read "0/4 episodes" for 25 minutes: before any episode ends it counts turns and tokens, their rate, and
    the time left at most (the episodes going on run to their cap, at the rate of turns so far)."""
    clock = Clock()
    monkeypatch.setattr(progress_lib.time, "perf_counter", clock)
    progress = Progress(None, "eval", total=4, horizon=10)
    playing = [Trajectory("babyai", task, task, task, [], horizon=10) for task in range(2)]
    clock.now = 10.0
    for t in playing:
        t.turns, t.sampled = 2, 100
    progress(playing)
    assert progress.text() == "eval 0/4 episodes, 4 turns, 200 tokens (20/s), ~1m30s left"  # 36 turns at 0.4/s
    playing[0].finish, playing[0].turns = "done", 3  # an early end: its 7 turns below the cap are never played
    clock.now = 16.0
    progress(playing)
    assert progress.text() == "eval 1/4 episodes, 5 turns, 200 tokens (12/s), ~1m30s left"  # 28 turns at 5/16 a second
    assert progress.finished == [playing[0]]
    ended = [Trajectory("babyai", task, task, task, [], horizon=10, finish="done") for task in range(4)]
    replays = [Trajectory("babyai", task, task, task, [], horizon=10) for task in range(2)]
    progress = Progress(None, "train", total=4, horizon=10)
    progress(ended)
    progress(ended[2:] + replays)  # (--dynamic-sampling: a set's first two episodes play again on new tasks)
    assert progress.text().startswith("train 4/6 episodes")  # (not 4/4 with more under way)
    for t in replays:
        t.finish = "done"
    progress(ended[2:] + replays)
    assert progress.text().startswith("train 6/6 episodes")  # (not 6/4 at the end)


class Silent(RoundEngine):
    """A model that never writes an Action line (what SmolLM2 did): every reply is a thought."""

    def __init__(self, fmt):
        super().__init__()
        self.fmt = fmt

    def generate(self, batch, limits):
        ids = self.fmt.encode("Thought: I should look around the room first.") + [self.fmt.end_of_turn]
        return [Sample(ids[:limit], [0.0] * min(len(ids), limit)) for limit in limits]


def played(engine_of, task_ids=(3, 40, 81), horizon=3):
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    environments = [envs.make("babyai") for _ in task_ids]
    return rollout(engine_of(fmt, environments), fmt, environments, list(task_ids), list(range(len(task_ids))),
                   horizon=horizon, max_new_tokens=64, max_tokens=3072)


def test_no_action_lines_are_all_invalid_actions_and_every_summary_says_so():
    """The model never wrote an Action line and the summary said `malformed 0.0`: the share of turns the env refused
    or could not read is in the scores (overall and per category), eval's metrics and the step line."""
    silent = score(played(lambda fmt, _: Silent(fmt)), "babyai")
    expert = score(played(ExpertEngine), "babyai")
    assert silent["invalid_action_rate"] == 1.0 and silent["malformed"] == 0.0  # (replies the env read, and refused)
    assert all(c["invalid_action_rate"] == 1.0 for c in silent["categories"].values())
    assert expert["invalid_action_rate"] == 0.0 and expert["success"] == 1.0
    assert eval_metrics({"babyai": silent}, 3, 3072)["eval/invalid_action_rate"] == 1.0
    step = {"rollout/reward": 0.0, "rollout/success": 0.0, "rollout/turns": 3.0, "rollout/horizon": 3,
            "rollout/invalid_action_rate": 1.0, "losses/nonfinite_updates": 0, "perf/env_wait_share": 0.1,
            "perf/step_s": 2.0}
    assert "| invalid actions 100% |" in rl_line(1, step)


def test_eval_summarises_invalid_actions_and_warns_when_most_are(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(eval_script, "build_engine", lambda engine_args, fmt, *a, **k: Silent(fmt))
    args = eval_script.tyro.cli(eval_script.Args, args=["--engine", "hf", "--limit", "2", "--horizon", "2",
                                                        "--out", str(tmp_path / "silent")])
    results = eval_script.main(args)
    out = capsys.readouterr().out
    assert results["invalid_action_rate"] == 1.0
    assert json.loads((tmp_path / "silent.json").read_text())["invalid_action_rate"] == 1.0
    summary = next(line for line in out.splitlines() if line.startswith("babyai test: 2 tasks"))
    assert summary.endswith("turns 2.0  invalid actions 100.0%")
    assert sum(line.endswith("invalid actions 100.0%") for line in out.splitlines()) == 1 + len(results["categories"])
    assert "warning: the env refused or could not read 100% of the turns' actions" in out


def test_a_log_gets_a_progress_line_now_and_then_not_one_per_turn(monkeypatch):
    """Under no terminal (a log file, CI) the line is written at most every NON_TTY_S seconds; on a terminal it
    redraws in place as turns are played."""
    clock = Clock()
    monkeypatch.setattr(progress_lib.time, "time", clock)
    monkeypatch.setattr(tqdm.std, "time", clock)  # (the bar's clock, which the line's redraws follow)
    log = io.StringIO()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    line = progress_bar(total=8, desc="eval babyai", file=log, bar_format="{desc}{postfix}")
    progress = Progress(line, "", 8, 20)
    trajectory = Trajectory("babyai", 0, 0, 0, [], horizon=20)
    for turn in range(1, 21):  # 20 turns, a second apart: one line when the bar opened, one after 30 s
        clock.now, trajectory.turns = float(turn), turn
        progress([trajectory])
    clock.now = 40.0
    progress([trajectory])
    assert log.getvalue().count("\r") == 2 and "20 turns" in log.getvalue()

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    terminal = io.StringIO()
    line = progress_bar(total=8, desc="eval babyai", file=terminal, bar_format="{desc}{postfix}")
    progress = Progress(line, "", 8, 20)
    for turn in range(1, 4):
        clock.now, trajectory.turns = 40.0 + turn, turn
        progress([trajectory])
    assert [f"{turns} turns" in terminal.getvalue() for turns in (1, 2, 3)] == [True] * 3


def test_train_step_bar_counts_each_step_once_when_its_line_is_also_shown(monkeypatch):
    """The rollout's and the update's lines redraw train.py's step bar between its steps; the bar still counts the
    steps it went through (redraws that set tqdm's own clock made it count them again: "82it" at step 15 of 16)."""
    clock = Clock()
    monkeypatch.setattr(progress_lib.time, "time", clock)
    monkeypatch.setattr(tqdm.std, "time", clock)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    bar = progress_lib.step_bar(1, 16, True)
    bar.mininterval = 0.05
    for step in bar:
        for _ in range(2):  # the rollout's line, then the update's
            clock.now += 0.06
            progress_lib.show(bar, f"step {step}")
        assert bar.n <= step
    assert bar.n == 16 and "16/16" in str(bar)


def interrupted(script: str, point: str, n: int, *flags: str) -> subprocess.CompletedProcess:
    """`script` with `flags`, sent SIGINT at the n-th call of `point` (tests/interrupt.py)."""
    return subprocess.run([sys.executable, str(INTERRUPT), script, point, str(n), *flags], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})


@pytest.mark.slow
def test_ctrl_c_in_eval_writes_the_episodes_that_ended_and_says_so_in_one_line(tmp_path):
    """Ctrl-C printed a 117-line traceback and dropped the finished episodes: the ones that ended are written whole
    (results and episodes agree), with one line on stderr and the exit status of a stop by Ctrl-C."""
    out = tmp_path / "stopped"
    # 2 episodes at a time, 2 turns each: SIGINT at the 5th env step, the first of the second pair's
    done = interrupted("eval.py", "step", 5, "--engine", "hf", "--limit", "4", "--horizon", "2", "--batch-size", "2",
                       "--out", str(out))
    assert done.returncode == progress_lib.STOPPED, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "stopped by Ctrl-C: wrote the 2 episodes that had ended, of 4"
    results = json.loads(out.with_suffix(".json").read_text())
    episodes = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert results["stopped"] == "by Ctrl-C, after 2 of 4 episodes" and results["tasks"] == 2
    assert sorted(results["per_task"]) == sorted(str(e["task_id"]) for e in episodes) and len(episodes) == 2
    assert all(e["finish"] == "horizon" and e["turns"] == 2 for e in episodes)


@pytest.mark.slow
def test_ctrl_c_in_training_leaves_the_last_whole_checkpoint_and_resume_auto_goes_on(tmp_path):
    """Ctrl-C printed a 73-line traceback: one line that names the newest complete checkpoint; one being written
    when it came is left unfinished (never taken for one), and --resume auto goes on from the one before."""
    flags = ["--engine", "hf", "--steps", "3", "--save-every", "1", "--tasks-per-step", "2", "--n", "2", "--horizon",
             "2", "--max-new-tokens", "16", "--eval-every", "0", "--resume", "auto", "--out-dir", str(tmp_path),
             "--run-name", "r"]
    done = interrupted("train.py", "checkpoint", 2, *flags)  # while step 2's checkpoint is written
    assert done.returncode == progress_lib.STOPPED, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    checkpoints = tmp_path / "r" / "checkpoints"
    assert done.stderr.strip().splitlines()[-1] == (f"stopped by Ctrl-C: continue from {checkpoints / 'step_1'} with "
                                                    f"--resume auto --run-name r --out-dir {tmp_path}")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2.tmp"]
    resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 2" in resumed.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2", "step_3"]
