"""scripts/compare.py on finished runs (their logs written here, so no train.py runs): the held-out gains paired by
task, each configuration against the first, env steps, and the env steps each run took to reach the baseline's final
held-out success."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import compare  # noqa: E402


def fake_run(out: Path, name: str, turns: list[float], held_out: dict[int, list[float]], envs=("babyai",)) -> None:
    """A finished run: a step of 10 episodes of `turns[i]` turns each, and evaluations of 4 tasks (one episode each),
    of `envs` in turn."""
    run = out / name
    run.mkdir(parents=True)
    rows = [{"charts/step": 0, "eval/success": sum(held_out[0]) / 4}]
    rows += [{"charts/step": i, "rollout/trajectories": 10, "rollout/turns": t, "rollout/success": 0.5,
              "rollout/invalid_action_rate": 0.1 * i, "rollout/anchored_share": 0.8, "perf/rollout_s": 2.0,
              "perf/update_s": 1.0} for i, t in enumerate(turns, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluations = [{"step": step, "item_id": f"{envs[task % len(envs)]}_{task}", "success": bool(s)}
                   for step, successes in held_out.items() for task, s in enumerate(successes)]
    (run / "evaluations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evaluations))
    (out / f"{name}.json").write_text(json.dumps({"run_dir": str(run), "wall_s": 60.0, "command": "train.py"}))


def test_a_comparison_of_finished_runs(tmp_path, capsys):
    # baseline: 4 steps of 3 turns; held-out 0/4 -> 2/4 at its end (step 4), 120 env steps
    for seed in (1, 2):
        fake_run(tmp_path, f"base-seed{seed}", [3, 3, 3, 3], {0: [0, 0, 0, 0], 2: [1, 0, 0, 0], 4: [1, 1, 0, 0]})
    # faster: reaches 2/4 at step 2 (seed 1: 40 env steps) or never (seed 2)
    fake_run(tmp_path, "fast-seed1", [2, 2, 2, 2], {0: [0, 0, 0, 0], 2: [1, 1, 0, 0], 4: [1, 1, 1, 0]})
    fake_run(tmp_path, "fast-seed2", [2, 2, 2, 2], {0: [0, 0, 0, 0], 2: [0, 0, 0, 0], 4: [1, 0, 0, 0]})
    summary = compare.main(["--out", str(tmp_path), "--seeds", "1", "2", "--baseline", "base",
                            "--run", "base", "", "--run", "fast", "--algo gigpo"])
    base, fast = summary["configs"]["base"], summary["configs"]["fast"]
    assert summary["target"] == {"success": 0.5, "env_steps": 120.0}
    assert base["gain"]["before"] == 0.0 and base["gain"]["after"] == 0.5 and base["gain"]["gain"] == pytest.approx(0.5)
    assert base["seed_gains"] == [0.5, 0.5] and base["env_steps"] == 120.0 and base["train_s"] == 12.0
    # fast's last evaluation pooled by task: task 0 (1 + 1) / 2, task 1 (1 + 0) / 2, task 2 (1 + 0) / 2, task 3 0
    assert fast["gain"]["after"] == pytest.approx(0.5) and fast["against_first"]["gain"] == pytest.approx(0.0)
    assert fast["to_target"] == [40.0, None] and fast["to_target_share"] == [pytest.approx(1 / 3), None]
    assert base["to_target"] == [120.0, 120.0]
    assert fast["invalid_first"] == pytest.approx(0.2) and fast["invalid_last"] == pytest.approx(0.3)
    printed = capsys.readouterr().out
    assert "| fast | 0.000 -> 0.500 |" in printed and "not reached" in printed
    assert (tmp_path / "compare.png").is_file() and json.loads((tmp_path / "compare.json").read_text())["seeds"] == [1, 2]


def test_a_generalist_against_its_specialist_per_env(tmp_path, capsys):
    """Runs on two envs (tasks 0, 2 BabyAI; 1, 3 TextCraft) against BabyAI-only runs: each env's gain, and the
    generalist's BabyAI tasks against the specialist's."""
    for seed in (1, 2):
        fake_run(tmp_path, f"babyai-seed{seed}", [3, 3], {0: [0, 0, 0, 0], 2: [1, 0, 1, 0]})
        fake_run(tmp_path, f"both-seed{seed}", [3, 3], {0: [0, 0, 0, 0], 2: [1, 1, 0, 0]}, envs=("babyai", "textcraft"))
    summary = compare.main(["--out", str(tmp_path), "--seeds", "1", "2", "--run", "babyai", "", "--run", "both",
                            "--env babyai textcraft"])
    specialist, generalist = summary["configs"]["babyai"]["envs"], summary["configs"]["both"]["envs"]
    assert list(specialist) == ["babyai"] and specialist["babyai"]["gain"]["after"] == 0.5  # (tasks 0-3 all babyai)
    assert generalist["babyai"]["gain"]["after"] == 0.5 and generalist["textcraft"]["gain"]["after"] == 0.5
    # the generalist's BabyAI tasks 0 and 2 (1 and 0) against the specialist's same tasks (1 and 1)
    assert generalist["babyai"]["against_first"]["gain"] == pytest.approx(-0.5)
    assert "textcraft" in generalist and "against_first" not in generalist["textcraft"]
    assert "| both | textcraft | 2 | 0.000 -> 0.500 |" in capsys.readouterr().out


def test_bad_comparisons_stop_with_a_sentence(tmp_path):
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", str(tmp_path), "--run", "a", "", "--run", "a", "--algo rloo"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", str(tmp_path), "--run", "a", "", "--baseline", "b"])
    fake_run(tmp_path, "once-seed1", [3], {0: [0, 0, 0, 0]})
    with pytest.raises(SystemExit, match="--eval-every"):
        compare.main(["--out", str(tmp_path), "--seeds", "1", "--run", "once", ""])


def test_gains_on_task_sets_apart(tmp_path, capsys):
    """--task-sets: the evaluated tasks split into named sets (trained goals beside the same goals renamed, say), each
    set's gain paired by task and each seed's; a file that is not a task id file is one sentence."""
    for seed, late in ((1, [1, 1, 0, 0]), (2, [1, 0, 0, 0])):
        fake_run(tmp_path, f"a-seed{seed}", [3, 3], {0: [0, 0, 0, 0], 2: late})
    (tmp_path / "trained.json").write_text(json.dumps([{"item_id": "babyai_0"}, {"item_id": "babyai_1"}]))
    (tmp_path / "renamed.json").write_text(json.dumps([{"item_id": "babyai_2"}, {"item_id": "babyai_3"},
                                                       {"item_id": "babyai_99"}]))
    summary = compare.main(["--out", str(tmp_path), "--seeds", "1", "2", "--run", "a", "",
                            "--task-sets", f"trained={tmp_path / 'trained.json'}", f"renamed={tmp_path / 'renamed.json'}"])
    sets = summary["configs"]["a"]["sets"]
    # trained: task 0 (1 + 1) / 2, task 1 (1 + 0) / 2 -> 0.75; renamed: tasks 2, 3 never (task 99 not played)
    assert sets["trained"]["gain"] == pytest.approx(0.75) and sets["trained"]["tasks"] == 2
    assert sets["renamed"]["gain"] == 0.0 and sets["renamed"]["tasks"] == 2
    assert summary["configs"]["a"]["set_seed_gains"] == {"trained": [1.0, 0.5], "renamed": [0.0, 0.0]}
    assert "| a | trained | 2 | 0.000 -> 0.750 |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", str(tmp_path), "--run", "a", "", "--task-sets", f"x={tmp_path / 'bad.json'}"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", str(tmp_path), "--run", "a", "", "--task-sets", "nofile"])
