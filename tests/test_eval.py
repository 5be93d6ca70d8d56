"""eval.py's results people can compare: the turn-budget sweep (its table, its PNG, and why one play under the
largest cap scores every lower cap), reflect's success per attempt, the settings and code revision in every
result, and --compare's per-category differences with paired intervals; every protocol's trajectory budget within
the model's context window."""

import importlib.util
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

import envs
import eval as eval_script
from rl.flags import build
from rl.agent import make_agent
from rl.agent import LayoutArgs, chat_format
from rl.engines import RoundEngine, Sample
from rl.engines.expert import ExpertEngine
from rl.model import EMBEDDED, load_tokenizer
from rl.progress import Progress
from rollout import ChatFormat, rollout

ROOT = Path(__file__).resolve().parent.parent


def run_eval(tmp_path, name, *flags):
    args = eval_script.tyro.cli(eval_script.Args, args=["--engine", "hf", "--out", str(tmp_path / name), *flags])
    results = eval_script.main(args)
    return results, json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.slow
def test_a_sweep_scores_every_turn_budget_and_draws_it(tmp_path, capsys):
    results, written = run_eval(tmp_path, "sweep", "--tasks", str(envs.DATA_DIR / "babyai_tiny_test.json"), "--limit", "12",
                                "--k", "2", "--max-turns", "4", "1", "2")
    assert written["horizons"] == [1, 2, 4] and written["horizon"] == 4
    sweep = written["sweep"]
    assert [row["horizon"] for row in sweep] == [1, 2, 4]
    assert {key: sweep[-1][key] for key in ("avg@k", "pass@k", "success")} == {
        key: written[key] for key in ("avg@k", "pass@k", "success")}  # the largest cap is the run itself
    for low, high in zip(sweep, sweep[1:]):  # a success within fewer turns is one within more
        assert low["success"] <= high["success"] and low["pass@k"] <= high["pass@k"] and low["turns"] <= high["turns"]
        assert set(low["categories"]) == set(written["categories"])
    assert all(row["turns"] <= row["horizon"] for row in sweep)
    table = capsys.readouterr().out
    assert "turns" in table and "Avg@2 / Pass@2" in table and len([line for line in table.splitlines()
                                                                   if line.strip().startswith(("1 ", "2 ", "4 "))]) == 3
    done = subprocess.run(["python", str(ROOT / "scripts" / "plot.py"), str(tmp_path / "sweep.json")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_an_env_failure_after_the_lower_cap_is_one_it_never_met():
    from rollout import Trajectory

    failed = Trajectory("babyai", 3, 0, 0, [], turns=5, turn_rewards=[0.0, 0.0, 0.0, 0.0], finish="error", error="boom")
    assert failed.cut(2).finish == "horizon" and failed.cut(2).error is None and failed.cut(2).turns == 2
    assert failed.cut(4).finish == "horizon"  # four turns answered before the failure at the fifth
    assert failed.cut(5) is failed and failed.cut(9) is failed
    early = Trajectory("babyai", 3, 0, 0, [], turns=2, turn_rewards=[0.0], finish="error", error="boom")
    assert early.cut(1).finish == "horizon" and early.cut(2) is early


@pytest.mark.parametrize("name, tasks", [("babyai", [0, 30, 40, 80, 100]), ("textcraft", [49, 135, 156, 181])])
def test_an_episode_cut_to_a_lower_cap_is_the_episode_played_under_it(name, tasks):
    """Why one play under the largest cap scores every lower one: nothing an episode sees depends on its cap, so the
    first h turns of a longer episode are an episode under cap h. With the deterministic experts: the same turns,
    reward, success and finish as playing under cap h."""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))  # (tasks whose expert plays take 1 to 8 turns)

    def played(horizon):
        environments = [envs.make(name) for _ in tasks]
        try:
            return rollout(ExpertEngine(fmt, environments), fmt, environments, tasks, list(range(len(tasks))),
                           horizon=horizon, max_new_tokens=256, max_tokens=16384)
        finally:
            for env in environments:
                env.close()

    longest = played(8)
    assert max(t.turns for t in longest) >= 3 and any(t.success for t in longest)
    for horizon in (1, 2, 3):
        for cut, direct in zip([t.cut(horizon) for t in longest], played(horizon)):
            assert (cut.turns, cut.reward, cut.success, cut.finish) == (direct.turns, direct.reward, direct.success,
                                                                        direct.finish)
            assert cut.turn_rewards[:cut.turns] == direct.turn_rewards


class Script(RoundEngine):
    """Turn k's reply is REPLIES[k] in every episode: a valid action, one the env refuses, one cut off inside its
    reasoning (malformed: the env never sees it), a valid one."""

    REPLIES = ["Action: check available actions", "Action: fly away", "<think>still thinking",
               "Action: check available actions"]

    def __init__(self, fmt):
        super().__init__()
        self.fmt = fmt

    def generate(self, batch, limits):
        replies = [(self.fmt.encode(self.REPLIES[traj.turns]) + [self.fmt.end_of_turn])[:limit]
                   for traj, limit in zip(batch, limits)]
        return [Sample(ids, [0.0] * len(ids)) for ids in replies]


def test_a_cut_episode_counts_only_its_own_invalid_and_malformed_turns():
    """A horizon sweep reported a malformed share of 1.0 at a cap whose turns were all well formed: the cut kept the
    whole episode's counts."""
    fmt = chat_format(load_tokenizer("tiny-agent"), LayoutArgs(reasoning_tags=("<think>", "</think>")))

    def played(horizon):
        env = envs.make("babyai")
        try:
            return rollout(Script(fmt), fmt, [env], [0], [0], horizon=horizon, max_new_tokens=64, max_tokens=4096)[0]
        finally:
            env.close()

    whole = played(4)
    assert (whole.turns, whole.invalid_actions, whole.malformed) == (4, 2, 1)
    for horizon, invalid, malformed in [(1, 0, 0), (2, 1, 0), (3, 2, 1)]:
        cut, direct = whole.cut(horizon), played(horizon)
        assert (cut.turns, cut.invalid_actions, cut.malformed) == (horizon, invalid, malformed)
        assert (direct.turns, direct.invalid_actions, direct.malformed) == (horizon, invalid, malformed)


@pytest.mark.slow
def test_results_record_what_was_run_and_reflect_reports_every_attempt(tmp_path, capsys):
    results, written = run_eval(tmp_path, "reflect", "--limit", "6", "--k", "2", "--horizon", "2", "--agent", "reflect",
                                "--attempts", "2", "--seed", "3")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for key, value in {"model": "tiny-agent", "env": "babyai", "split": "test", "k": 2, "horizon": 2, "agent": "reflect",
                       "attempts": 2, "seed": 3, "engine": "hf"}.items():
        assert written[key] == value, key
    assert written["code"].removesuffix("+dirty") == head
    attempts = written["by_attempt"]
    assert [row["attempt"] for row in attempts] == [1, 2]
    assert attempts[0]["success"] <= attempts[1]["success"] == pytest.approx(written["success"])
    assert sum(len(v) for v in written["per_task"].values()) == 12  # each episode once: its final attempt
    records = [json.loads(line) for line in (tmp_path / "reflect.jsonl").read_text().splitlines()]
    retried = [r for r in records if r.get("attempt") == 2]
    assert retried and all(r["final"] for r in retried)
    assert all(r["reflection"] for r in records if r.get("final") is False)
    assert "after attempt 2" in capsys.readouterr().out


def test_several_envs_play_in_turn_on_one_engine_and_print_one_table(tmp_path, capsys):
    """--env babyai textcraft: each env's results as one env's (its own file), a table with a row each and their
    macro average; a checkpoint of a run on several envs plays them all unless --env says which."""
    results = eval_script.main(eval_script.tyro.cli(eval_script.Args, args=[
        "--engine", "hf", "--env", "babyai", "textcraft", "--limit", "2", "--horizon", "1", "--out", str(tmp_path / "r")]))
    assert set(results["envs"]) == {"babyai", "textcraft"}
    for env in ("babyai", "textcraft"):
        written = json.loads((tmp_path / f"r_{env}.json").read_text())
        assert written["env"] == env and written["tasks"] == 2 and written["success"] == results["envs"][env]["success"]
    assert results["macro"]["avg@k"] == pytest.approx(
        (results["envs"]["babyai"]["avg@k"] + results["envs"]["textcraft"]["avg@k"]) / 2)
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[-3:]] == ["babyai", "textcraft", "macro"]
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"env": ["textcraft", "babyai"]}))
    assert eval_script.eval_envs(build(eval_script.Args, model=str(run / "checkpoints" / "step_1"))) == \
        ("textcraft", "babyai")
    assert eval_script.eval_envs(build(eval_script.Args, model="tiny-agent", env=("all",))) == tuple(envs.ENVS)
    with pytest.raises(SystemExit, match="unknown env 'nope'"):
        eval_script.eval_envs(build(eval_script.Args, env=("babyai", "nope")))


def result(env, tasks):
    """A minimal eval result: per_task {task: [[reward, success], ...]} and its summaries."""
    episodes = [e for v in tasks.values() for e in v]
    return {"model": "m", "env": env, "k": 2, "avg@k": sum(e[0] for e in episodes) / len(episodes),
            "success": sum(e[1] for e in episodes) / len(episodes), "categories": {},
            "per_task": {str(t): v for t, v in tasks.items()}}


def test_compare_pairs_tasks_per_category_with_intervals(tmp_path, capsys):
    # BabyAI tasks 0-3 (GoTo) and 16-19 (Pickup): B solves every other GoTo task that A failed, and one Pickup less
    a = {t: [[0.0, 0.0], [0.0, 0.0]] for t in (0, 1, 2, 3)} | {t: [[0.9, 1.0], [0.9, 1.0]] for t in (16, 17, 18, 19)}
    b = {0: [[0.9, 1.0], [0.9, 1.0]], 1: [[0.0, 0.0]] * 2, 2: [[0.9, 1.0], [0.9, 1.0]], 3: [[0.0, 0.0]] * 2,
         16: [[0.0, 0.0]] * 2, 17: [[0.9, 1.0]] * 2, 18: [[0.9, 1.0]] * 2, 19: [[0.9, 1.0]] * 2}
    (tmp_path / "a.json").write_text(json.dumps(result("babyai", a)))
    (tmp_path / "b.json").write_text(json.dumps(result("babyai", b) | {"model": "n"}))
    assert {envs.category("babyai", t) for t in (0, 1, 2, 3)} == {"GoTo"}
    assert {envs.category("babyai", t) for t in (16, 17, 18, 19)} == {"Pickup"}
    out = eval_script.main(build(eval_script.Args, compare=(str(tmp_path / "a.json"), str(tmp_path / "b.json"))))
    rows = {row["category"]: row for row in out["categories"]}
    assert out["settings_differ"] == {"model": ("m", "n")}
    goto = rows["GoTo"]["success"]  # differences 1, 0, 1, 0: mean 0.5, sample variance 1/3
    half = 1.96 * math.sqrt(1 / 3 / 4)
    assert (goto["gain"], goto["low"], goto["high"], goto["tasks"]) == pytest.approx((0.5, 0.5 - half, 0.5 + half, 4))
    assert rows["Pickup"]["success"]["gain"] == pytest.approx(-0.25)
    assert rows["overall"]["avg"]["gain"] == pytest.approx((0.9 + 0.9 - 0.9) / 8) and rows["overall"]["tasks"] == 8
    printed = capsys.readouterr().out
    assert "GoTo" in printed and "+0.500" in printed and "model: A m  B n" in printed


def test_compare_reads_results_without_per_task_scores_and_refuses_bad_input(tmp_path, capsys):
    old = {"model": "m", "env": "babyai", "k": 1, "avg@k": 0.2, "success": 0.25, "categories": {"GoTo": {"avg@k": 0.1}}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(result("babyai", {0: [[0.9, 1.0]]})))
    out = eval_script.main(build(eval_script.Args, compare=(str(tmp_path / "old.json"), str(tmp_path / "new.json"))))
    assert out["categories"][0]["tasks"] == 0 and out["categories"][0]["avg"]["before"] == 0.2
    assert "no intervals" in capsys.readouterr().out
    one = eval_script.compare(str(tmp_path / "new.json"), str(tmp_path / "new.json"))
    assert one["categories"][0]["success"]["low"] is None and "(one task)" in capsys.readouterr().out
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not an eval result"):
        eval_script.compare(str(tmp_path / "old.json"), str(tmp_path / "list.json"))
    (tmp_path / "text.json").write_text(json.dumps(result("textcraft", {0: [[1.0, 1.0]]})))
    (tmp_path / "torn.json").write_text('{"avg@k": 0.')
    for pair, message in [(("old.json", "missing.json"), "cannot read"), (("old.json", "torn.json"), "cannot read"),
                          (("old.json", "text.json"), "different envs")]:
        with pytest.raises(SystemExit, match=message):
            eval_script.main(build(eval_script.Args, compare=tuple(str(tmp_path / p) for p in pair)))


@pytest.mark.parametrize("flags, message", [
    (["--max-turns", "3", "0"], "at least 1"),
    (["--agent", "reflect", "--attempts", "0"], "at least 1"),
])
def test_bad_sweep_or_agent_flags_stop_with_a_message(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        run_eval(tmp_path, "bad", "--limit", "1", *flags)


def test_make_agent_names_the_formats():
    assert make_agent("reflect", 4).attempts == 4 and make_agent("plan", 4).attempts == 1


def test_every_summary_says_how_episodes_ended_and_warns_when_the_budget_ended_most(tmp_path, capsys):
    """A budget smaller than the episodes need (BabyAI's first prompt is ~720 tokens) ends them on max_tokens after a
    turn or two; the summary says so, with a warning, and the result keeps the shares."""
    results, written = run_eval(tmp_path, "budget", "--limit", "3", "--max-tokens", "800")
    out = capsys.readouterr().out
    assert results["finish"]["max_tokens"] == written["finish"]["max_tokens"] == 1.0
    assert "ended: done 0%, horizon 0%, max_tokens 100%, error 0%" in out
    assert "warning: most episodes ran out of their 800-token budget" in out
    results, _ = run_eval(tmp_path, "roomy", "--limit", "3", "--horizon", "2")
    out = capsys.readouterr().out
    assert f"horizon {results['finish']['horizon']:.0%}" in out and "warning" not in out
    assert sum(results["finish"].values()) == pytest.approx(1.0)


def test_progress_counts_turns_before_episodes_end():
    """play()'s progress callback hears of every turn (eval.py's bar shows them), not only of ended episodes: long
    episodes (upstream's protocol: up to 30 turns of 512 tokens) would show nothing for minutes."""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    environments = [envs.make("babyai") for _ in range(3)]
    calls = []
    progress = Progress(None, "eval", 3, 6)
    played = rollout(ExpertEngine(fmt, environments), fmt, environments, [3, 40, 81], [0, 1, 2], horizon=6,
                     max_new_tokens=64, max_tokens=3072,
                     progress=lambda trajectories: (progress(trajectories), calls.append(progress.counts())))
    assert calls[-1].ended == 3 and calls[-1].turns == sum(t.turns for t in played) > 3
    assert calls[-1].tokens == sum(sum(t.loss_mask) for t in played) > 0
    assert calls[0].turns == 3  # every episode's first turn, heard with the first call
    assert sorted(map(id, progress.finished)) == sorted(map(id, played))


def windowed(tmp_path, window: int) -> Path:
    """The embedded model's directory with a context window of `window` tokens (max_position_embeddings)."""
    model = Path(shutil.copytree(EMBEDDED["tiny-agent"], tmp_path / f"window-{window}"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": window}))
    return model


def test_every_protocols_budget_is_cut_to_the_models_context_window(tmp_path, capsys):
    """Upstream's 32k budget, a --max-tokens and a run's own budget past the model's window are cut to the window,
    with one line (train.py's, rl/model.context_limit); a budget within it stays; a model behind an API keeps it (its
    server's window holds it)."""
    model = windowed(tmp_path, 2048)
    def resolve(args):
        return eval_script.resolve_settings(args, eval_script.eval_envs(args)[0])
    assert resolve(build(eval_script.Args, model=str(model)))["max_tokens"] == 2048
    assert (f"--protocol agentgym's --max-tokens 32768 is more than {model}'s context window: trajectories end at 2048 "
            "tokens") in capsys.readouterr().out
    flagged = resolve(build(eval_script.Args, model=str(model), max_tokens=4096))
    assert flagged["max_tokens"] == 2048 and flagged["overrides"] == ["max_tokens"]
    assert "--max-tokens 4096 is more than" in capsys.readouterr().out
    assert resolve(build(eval_script.Args, model=str(model), max_tokens=1000))["max_tokens"] == 1000
    assert capsys.readouterr().out == ""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"  # a run trained with a budget past its model's window
    shutil.copytree(model, checkpoint)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"env": "babyai", "max_turns": 2, "max_new_tokens": 16,
                                                              "max_tokens": 4096}))
    run = resolve(build(eval_script.Args, model=str(checkpoint)))
    assert (run["protocol"], run["max_tokens"]) == ("run", 2048)
    assert "--protocol run's --max-tokens 4096 is more than" in capsys.readouterr().out
    assert resolve(build(eval_script.Args, model="openai:some-model"))["max_tokens"] == 32768


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")])])
def test_episodes_end_at_the_models_context_window_on_either_engine(tmp_path, capsys, engine):
    """A model whose window (1,000 tokens) is below the tiny protocol's 3,072: its episodes end there, as out of
    room, on HF (which would run past the trained positions) and on vLLM (which refused to start: a context above the
    model's window)."""
    model = windowed(tmp_path, 1000)
    args = eval_script.tyro.cli(eval_script.Args, args=["--model", str(model), "--protocol", "tiny", "--engine", engine,
                                                         "--limit", "2", "--out", str(tmp_path / engine)])
    results = eval_script.main(args)
    assert results["max_tokens"] == 1000 and results["finish"]["max_tokens"] == 1.0
    episodes = [json.loads(line) for line in (tmp_path / f"{engine}.jsonl").read_text().splitlines()]
    assert all(0 < episode["tokens"] <= 1000 for episode in episodes)
    assert "trajectories end at 1000 tokens" in capsys.readouterr().out
