"""scripts/reach.py: a model's expert episodes scored teacher-forced. Its figures are the model's own log-probs of the
expert's action tokens (checked against a plain forward pass), --pick writes exactly the tasks within the band as a
task file train.py reads, and a bad band is one sentence."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import reach  # noqa: E402

import envs  # noqa: E402


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    out = tmp_path_factory.mktemp("reach")
    figures = reach.main(["--model", "tiny-agent", "--env", "babyai", "--tasks", "train", "--limit", "4",
                          "--batch-size", "2", "--band", "0:1", "--out", str(out / "episodes.jsonl"),
                          "--pick", str(out / "picked.json")])
    return figures, [json.loads(line) for line in open(out / "episodes.jsonl")], out


@pytest.mark.slow
def test_an_episodes_probability_is_the_models_own(scored):
    from rl.agent import LayoutArgs, chat_format, make_agent
    from rl.model import load_model, load_tokenizer
    from rollout import ExpertEngine, play

    _, rows, _ = scored
    fmt = chat_format(load_tokenizer("tiny-agent"), LayoutArgs("react"))
    env = envs.make("babyai")
    first, = play(ExpertEngine(fmt, [env]), fmt, [env], [rows[0]["task_id"]], horizon=30, max_new_tokens=4096,
                  max_tokens=16384, agent=make_agent("react"))
    model = load_model("tiny-agent").eval()
    with torch.no_grad():
        logits = model(torch.tensor([first.token_ids])).logits[0].log_softmax(-1)
    ids, mask = first.token_ids, first.loss_mask
    by_hand = sum(float(logits[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])
    assert rows[0]["tokens"] == sum(mask) > 0
    assert rows[0]["logprob"] == pytest.approx(by_hand, abs=1e-3)
    assert rows[0]["probability"] == pytest.approx(math.exp(by_hand), rel=1e-3)


@pytest.mark.slow
def test_the_sets_figures_and_the_picked_task_file(scored):
    figures, rows, out = scored
    s = figures["train"]
    assert s["tasks"] == 4 and s["scored"] == len(rows) >= 3  # (the expert solves BabyAI's train tasks)
    assert s["loss_per_token"] == pytest.approx(-sum(r["logprob"] for r in rows) / sum(r["tokens"] for r in rows))
    assert s["in_reach"] == 1.0 and all(0 < r["probability"] <= 1 for r in rows)
    picked = envs.load_task_ids(out / "picked.json", "babyai")
    assert picked == sorted(r["task_id"] for r in rows)


@pytest.mark.slow
def test_a_pick_of_some_tasks_of_some_categories(tmp_path):
    reach.main(["--model", "tiny-agent", "--env", "babyai", "--tasks", "test", "--limit", "6", "--categories",
                "GoTo", "Pickup", "--batch-size", "2", "--band", "0:1", "--pick", str(tmp_path / "two.json"),
                "--pick-count", "2"])
    picked = envs.load_task_ids(tmp_path / "two.json", "babyai")
    assert len(picked) == 2 and {envs.category("babyai", i) for i in picked} <= {"GoTo", "Pickup"}


def test_a_band_outside_the_probabilities_is_one_sentence(capsys):
    with pytest.raises(SystemExit):
        reach.parse_args(["--env", "babyai", "--band", "0.8:0.2"])
    assert "give 0 <= LO < HI <= 1" in capsys.readouterr().err
