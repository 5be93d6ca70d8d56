"""What a new user meets on a first tour: every fault they can cause (a hub model offline, a silent env server, a
bad task file, a model without a chat template, two flags that contradict) ends in one sentence that names it,
never a traceback; nothing is imported or printed for parts a run does not use (DeepSpeed); a smoke run on
another env plays a bounded evaluation and says so when it starts; a 1-step run's curves show their points."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import eval as eval_script
from rl.flags import build
import train
from rl.model import EMBEDDED, load_model, load_tokenizer

ROOT = Path(train.__file__).resolve().parent
HUB_ID = "nobody/no-such-model"  # (tests run with HF_HUB_OFFLINE=1: conftest.py)
SMALL = ["--steps", "1", "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "8"]


def stopped(call) -> str:
    """The message a call stopped the script with (SystemExit), which must be one line."""
    with pytest.raises(SystemExit) as stop:
        call()
    message = str(stop.value.code)
    assert "\n" not in message, message
    return message


def test_a_hub_id_offline_is_one_sentence_from_every_script(tmp_path):
    """train.py, eval.py and --dry-run read a model through rl/model.py, and all say the same: give a local
    directory or go online."""
    said = {stopped(lambda: load_tokenizer(HUB_ID)), stopped(lambda: load_model(HUB_ID)),
            stopped(lambda: train.main(train.parse_args(["--dry-run", "--model", HUB_ID]))),
            stopped(lambda: train.main(train.parse_args(["--model", HUB_ID, *SMALL, "--out-dir", str(tmp_path)]))),
            stopped(lambda: eval_script.main(build(eval_script.Args, model=HUB_ID, engine="hf", limit=1, out=str(tmp_path / "e"))))}
    assert len(said) == 1, said
    message = said.pop()
    assert HUB_ID in message and "local model directory" in message and "HF_HUB_OFFLINE" in message
    assert "does not exist" in stopped(lambda: load_tokenizer(str(tmp_path / "nowhere")))


@pytest.mark.slow
def test_a_run_that_is_not_deepspeed_never_imports_it(tmp_path):
    """DeepSpeed is imported by ZeRO-3 launches only (rl/zero3.py keep_out): elsewhere its import printed "Setting
    accelerator to CPU" in every run without a GPU. The run's start line says what it will evaluate."""
    code = ("import sys, train; train.main(train.parse_args(sys.argv[1:])); "
            "print('deepspeed was imported' if 'deepspeed' in sys.modules else 'deepspeed was not imported')")
    done = subprocess.run([sys.executable, "-c", code, *SMALL, "--engine", "hf", "--eval-every", "1", "--eval-tasks", "2",
                           "--eval-k", "1", "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "AGENTGYM_RL_PLOTS": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "deepspeed was not imported" in done.stdout
    assert "Setting accelerator to CPU" not in done.stderr
    assert "evaluating 2 test tasks x 1 at steps 0 and 1" in done.stdout


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers (the kernel accepts them into the backlog)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_an_env_server_that_never_answers_is_one_sentence(silent_server, tmp_path):
    for message in (
        stopped(lambda: train.main(train.parse_args([*SMALL, "--env-url", silent_server, "--env-timeout", "1",
                                                     "--out-dir", str(tmp_path)]))),
        stopped(lambda: eval_script.main(build(eval_script.Args, env_url=silent_server, env_timeout=1, engine="hf", limit=2,
                                                          out=str(tmp_path / "e")))),
    ):
        assert silent_server in message and "no answer within 1 s" in message


@pytest.mark.parametrize("content, fault", [
    (None, "does not exist"),
    ("[{\"item_id\": \"babyai_1\"},", "is not JSON"),
    ("{\"item_id\": \"babyai_1\"}", "holds a JSON dict, not a list of task ids"),
    ("[{\"item_id\": \"textcraft_1\"}]", "is not a babyai task"),
    ("[{\"id\": 1}]", "entry 0 has no item_id"),
    ("[\"babyai_one\"]", "is not a task id"),
])
def test_a_bad_task_file_is_one_line_naming_it(tmp_path, content, fault):
    path = tmp_path / "tasks.json"
    if content is not None:
        path.write_text(content)
    for flag in ("--train-tasks", "--test-tasks"):
        message = stopped(lambda: train.check(train.parse_args([flag, str(path)]), world=1))
        assert message.startswith(f"{flag}: task id file {path}") and fault in message, message
    message = stopped(lambda: eval_script.main(build(eval_script.Args, tasks=str(path), engine="hf", out=str(tmp_path / "e"))))
    assert message.startswith(f"--tasks: task id file {path}") and fault in message, message


def test_a_model_without_a_chat_template_is_one_line(tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(EMBEDDED["tiny-agent"], model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for message in (
        stopped(lambda: train.main(train.parse_args(["--model", str(model), *SMALL, "--out-dir", str(tmp_path)]))),
        stopped(lambda: eval_script.main(build(eval_script.Args, model=str(model), engine="hf", limit=1, out=str(tmp_path / "e")))),
    ):
        assert message.startswith(f"{model} has no chat template"), message


def test_steps_and_epochs_together_are_refused_but_a_resumed_run_may_change_its_steps(tmp_path):
    assert "--steps and --epochs" in stopped(lambda: train.parse_args(["--steps", "2", "--epochs", "1"]))
    assert "--steps and --epochs" in stopped(lambda: train.parse_args(["--epochs=1", "--steps=2"]))
    assert train.parse_args(["--epochs", "1"]).epochs == 1  # with the preset's steps: --epochs decides
    # a run that was given --epochs, resumed with --steps: --steps replaces its epochs, as before
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_1"
    (checkpoint / "state").mkdir(parents=True)
    (checkpoint / "state" / "schedulers.json").write_text("{}")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1}))
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(train.parse_args(["--epochs", "1"]))))
    resumed = train.parse_args(["--resume", str(checkpoint), "--steps", "5"])
    assert (resumed.steps, resumed.epochs) == (5, None)
    assert "--steps and --epochs" in stopped(lambda: train.parse_args(["--resume", str(checkpoint), "--steps", "5",
                                                                       "--epochs", "2"]))


def planned_tests(args) -> dict[str, list[int]]:
    """The test tasks a run's evaluations play, by env (as train.py reads its flags)."""
    from rl.tasks import test_tasks

    return test_tasks(args.test_tasks, args.env, args.eval_tasks)


def test_the_tiny_preset_evaluates_all_its_babyai_tasks_and_a_bounded_share_elsewhere():
    """The default demo keeps its held-out comparison on the 105 tasks of TINY_TASKS; on another env a 1-step
    smoke run plays 16 test tasks (x --eval-k 2) at step 0 and at the end, not the whole split (SciWorld's 1,171)."""
    babyai = train.parse_args([])
    assert babyai.eval_tasks == 0 and len(planned_tests(babyai)["babyai"]) == 105
    for env in ("sciworld", "textcraft"):
        args = train.parse_args(["--env", env])
        assert len(planned_tests(args)[env]) == 16 and args.eval_k == 2
    assert len(planned_tests(train.parse_args(["--env", "sciworld", "--eval-tasks", "0"]))["sciworld"]) == 1171
    # with several envs, BabyAI keeps the tiny preset's tasks (spread) and the others their splits
    both = planned_tests(train.parse_args(["--env", "babyai", "textcraft"]))
    assert set(both["babyai"]) <= set(planned_tests(babyai)["babyai"]) and len(both["textcraft"]) == 16
    assert train.parse_args(["--env", "sciworld", "--model", "Qwen/Qwen2.5-3B-Instruct"]).eval_tasks == 64  # paper's


def test_dry_run_says_one_process_not_accelerates_word(capsys):
    train.main(train.parse_args(["--dry-run"]))
    out = capsys.readouterr().out
    assert "this launch: one process, not distributed" in out and "NO over" not in out


def test_a_one_step_runs_curves_show_their_points(tmp_path, monkeypatch):
    """scripts/plot.py draws a series of few points with a marker at each: a 1-step run's single points (a line of
    one point draws nothing) are seen."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot

    step = {"charts/step": 1, "rollout/reward": 0.2, "rollout/success": 0.25, "rollout/turns": 2.0, "rollout/horizon": 2,
            "finish/done": 0.25, "finish/horizon": 0.75, "losses/kl": 0.0, "losses/entropy": 0.5,
            "losses/clipfrac": 0.0, "losses/grad_norm": 0.1, "perf/tokens_per_s": 100.0, "perf/step_s": 3.0,
            "perf/rollout_peak_gib": 1.0, "eval/success": 0.1}
    figures = []
    monkeypatch.setattr(plot, "save", lambda figure, out: figures.append(figure))
    plot.plot({"run": [step]}, tmp_path / "curves.png")
    lines = [line for axis in figures[0].axes for line in axis.get_lines() if len(line.get_xdata()) == 1]
    assert len(lines) >= 10 and all(line.get_marker() not in (None, "None", "") for line in lines), \
        [line.get_label() for line in lines if line.get_marker() in (None, "None", "")]
