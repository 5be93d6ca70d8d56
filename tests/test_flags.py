"""docs/flags.md's flag table: its defaults are what train.py's presets give (scripts/flags.py writes them); flags that
would be silently ignored, or cannot work, stop train.py with one sentence."""

import subprocess
import sys
import typing
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent


def test_the_flag_table_is_what_the_presets_give():
    done = subprocess.run([sys.executable, "scripts/flags.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    page = (ROOT / "docs" / "flags.md").read_text()
    table = done.stdout.strip()
    assert table in page, ("docs/flags.md's flag table differs from the code's defaults; `python scripts/flags.py --write` "
                             "rewrites it:\n" + "\n".join(line for line in table.splitlines() if line not in page))


@pytest.mark.parametrize("flags,message", [
    (["--algo", "ppo", "--gamma", "0"], r"--gamma 0 is a discount: give one in \(0, 1\]"),
    (["--algo", "reinforce_pp", "--gamma", "1.5"], r"--gamma 1.5 is a discount"),
    (["--algo", "gigpo", "--gamma", "-0.5"], r"--gamma -0.5 is a discount"),
    # an estimator's flag with an estimator that does not read it (rl/advantages.py's entries declare them)
    (["--gamma", "0.9"], "^--gamma is read only by --algo gigpo, reinforce_pp or ppo, not by --algo grpo: drop it"),
    (["--step-weight", "0.5"], "--step-weight is read only by --algo gigpo, not by --algo grpo"),
    (["--algo", "ppo", "--step-weight", "0"], "--step-weight is read only by --algo gigpo, not by --algo ppo"),
    (["--algo", "rloo", "--no-grpo-scale"], "--no-grpo-scale is read only by --algo grpo or gigpo, not by --algo rloo"),
    (["--algo", "gigpo", "--lam", "0.95"], "--lam is read only by --algo ppo, not by --algo gigpo"),
    (["--algo", "sft", "--data", "x.jsonl", "--gae-unit", "turn"], "--gae-unit is read only by --algo ppo, not by "
                                                                     "--algo sft"),
    (["--is-cap", "3"], "give --max-staleness too"),
    (["--top-p", "0"], r"--top-p 0 is the share of the probability mass"),
    (["--top-p", "1.5"], r"--top-p 1.5 is the share of the probability mass"),
    (["--rollout-server", "h:1", "--weight-bucket-mb", "0"], r"--weight-bucket-mb 0 is a bucket's size in MiB: give 1"),
    (["--weight-sync", "per-server"], "say how weights reach rollout servers: give --rollout-server too"),
    (["--weight-bucket-mb", "64"], "say how weights reach rollout servers: give --rollout-server too"),
])
def test_a_flag_that_would_be_ignored_or_cannot_work_stops_with_a_sentence(flags, message, tmp_path):
    args = train.parse_args(["--out-dir", str(tmp_path), *flags])
    with pytest.raises(SystemExit, match=message):
        train.check(args, 1)


@pytest.mark.parametrize("flags", [
    ["--algo", "ppo", "--gamma", "1"], ["--algo", "reinforce_pp", "--gamma", "0.99"],
    ["--algo", "gigpo", "--gamma", "0.95", "--step-weight", "0.5"], ["--algo", "gigpo", "--step-weight", "0"],
    ["--algo", "gigpo", "--no-grpo-scale"], ["--algo", "ppo", "--lam", "0.95", "--gae-unit", "turn"],
    ["--algo", "rloo", "--step-weight", "1.0", "--grpo-scale"],  # (given at its default: not given)
    ["--max-staleness", "1", "--is-cap", "3"], ["--algo", "gigpo", "--reasoning", "drop"],
])
def test_the_same_flags_where_they_apply_pass(flags, tmp_path):
    train.check(train.parse_args(["--out-dir", str(tmp_path), *flags]), 1)


def test_the_docs_of_reasoning_drop_name_every_estimator_it_accepts():
    from rl.advantages import is_grouped

    accepted = [algo for algo in typing.get_args(typing.get_type_hints(train.Args)["algo"]) if is_grouped(algo)]
    docstring = (ROOT / "rl" / "agent.py").read_text().split("reasoning: Literal")[1].split('"""')[1]
    row = next(line for line in (ROOT / "docs" / "reasoning-and-tools.md").read_text().splitlines()
               if line.startswith("| estimators |"))
    assert "gigpo" in accepted
    for algo in accepted:
        train.check(train.parse_args(["--algo", algo, "--reasoning", "drop"]), 1)
        assert algo in docstring and f"`{algo}`" in row.split("|")[3], algo


def test_eval_stops_on_a_top_p_that_leaves_nothing_to_draw(tmp_path):
    import eval as eval_script

    args = eval_script.tyro.cli(eval_script.Args, args=["--engine", "hf", "--top-p", "0", "--out", str(tmp_path / "e")])
    with pytest.raises(SystemExit, match="--top-p 0 is the share"):
        eval_script.main(args)


def test_option_strings_keep_their_meaning_for_each_flag():
    """One parser for --env-options and --chat-template-kwargs (envs.parse_options), which each keep what they meant:
    a template's true/false/none are Python's (Jinja would take the string "false" for true), an env's stay its own
    words (WebArena's `map_services none`); literals parse alike in both."""
    import envs
    from rl.agent import LayoutArgs, chat_format
    from rl.model import load_tokenizer

    given = {"enable_thinking": "false", "map_services": "none", "topk": "3", "strict": "False", "sites": "shopping"}
    assert envs.parse_options(given) == {"enable_thinking": "false", "map_services": "none", "topk": 3, "strict": False,
                                         "sites": "shopping"}
    assert envs.parse_options(given, words=True) == {"enable_thinking": False, "map_services": None, "topk": 3,
                                                     "strict": False, "sites": "shopping"}
    fmt = chat_format(load_tokenizer("tiny-agent"), LayoutArgs(chat_template_kwargs={"enable_thinking": " FALSE "}))
    assert fmt.template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("algo, unread", [("rloo", {"grpo_scale": False}), ("grpo", {"lam": 0.9, "gamma": 0.99})])
def test_an_older_run_with_a_flag_its_estimator_never_read_resumes(algo, unread, tmp_path, capsys):
    """Before the estimators owned their flags, --no-grpo-scale with rloo or --lam with grpo was taken and did
    nothing; such a run resumes without it (one line says so), where check_estimator would refuse it."""
    import json

    from rl.flags import flat

    argv = ["--algo", algo, "--steps", "2", "--out-dir", str(tmp_path), "--run-name", "old"]
    checkpoint = tmp_path / "old" / "checkpoints" / "step_1"
    (checkpoint / "state").mkdir(parents=True)
    (tmp_path / "old" / "config.json").write_text(json.dumps(flat(train.parse_args(argv)) | {"preset": "tiny"} | unread))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1}))
    (checkpoint / "state" / "schedulers.json").write_text("{}")
    resumed = train.parse_args(["--resume", str(tmp_path / "old"), "--steps", "3"])
    train.check(resumed, 1, "NO")
    assert resumed.algo == algo and resumed.steps == 3
    assert all(getattr(resumed.estimator_args, name) != value for name, value in unread.items())
    assert f"went unread by --algo {algo} and is dropped on resume" in capsys.readouterr().out
