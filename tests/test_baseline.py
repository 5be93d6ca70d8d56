"""scripts/baseline.py: a model's evals on both engines side by side. On results already written (it reads them instead
of running eval.py again), its table has a row per env and engine, and its comparison counts the episodes whose
actions differ, turn by turn, and the tasks whose results differ."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import baseline  # noqa: E402


def written(out: Path, name: str, episodes: list[tuple[str, list[str], float]]) -> None:
    """An eval's <out>/<name>.json and .jsonl, as eval.py writes them, for (task, actions, reward) episodes."""
    per_task = {}
    for task, _, reward in episodes:
        per_task.setdefault(task, []).append([reward, float(reward > 0)])
    results = {"tasks": len(per_task), "avg@k": sum(r for *_, r in episodes) / len(episodes), "turns": 2.0,
               "invalid_action_rate": 0.25, "finish": {"done": 0.5, "horizon": 0.5, "max_tokens": 0.0, "error": 0.0},
               "seconds": 12.0, "per_task": per_task}
    (out / f"{name}.json").write_text(json.dumps(results))
    (out / f"{name}.jsonl").write_text("".join(json.dumps({"item_id": task, "env_actions": actions}) + "\n"
                                               for task, actions, _ in episodes))


def test_the_table_and_the_engines_agreement_come_from_the_written_results(tmp_path, capsys):
    same = [("babyai_1", ["go to the door", "open door"], 1.0), ("babyai_2", ["turn left", "turn left"], 0.0)]
    written(tmp_path, "babyai-vllm", same)
    written(tmp_path, "babyai-hf", same)
    written(tmp_path, "textcraft-vllm", [("textcraft_3", ["get 1 oak log"], 0.0), ("textcraft_4", ["inventory"], 0.0)])
    written(tmp_path, "textcraft-hf", [("textcraft_3", ["get 1 oak log"], 0.0), ("textcraft_4", ["craft 4 planks"], 1.0)])
    summary = baseline.main(["--envs", "babyai", "textcraft", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| babyai | vllm | 2 | 0.500 | 2.0 | 25% | done 50%, horizon 50% | 12 s |" in out
    assert summary["babyai"]["same"] == "2/2 episodes, 2/2 tasks"
    assert summary["textcraft"]["same"] == "1/2 episodes, 1/2 tasks"
    assert "textcraft: vllm and hf played the same actions in 1/2 episodes, 1/2 tasks" in out
    assert json.loads((tmp_path / "baseline.json").read_text())["textcraft"]["same"] == "1/2 episodes, 1/2 tasks"
