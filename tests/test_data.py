"""rl/data.py and scripts/make_expert_data.py: AgentGym's AgentTraj records, read (JSON or JSON lines,
unknown fields tolerated, malformed ones refused by name) and laid out as exactly the tokens and loss
mask of an RL rollout of the same episode."""

import json
import sys
from pathlib import Path

import pytest

import envs
from rl.data import DataError, encode, read_trajectories, to_record
from rl.model import load_tokenizer
from rollout import ChatFormat, ExpertEngine, rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_expert_data  # noqa: E402

# Written by hand in AgentGym's AgentTraj format (as its babyai_train.json files), plus a field of its own
HAND_WRITTEN = {
    "item_id": "babyai_3",
    "conversations": [
        {"from": "human", "loss": None, "value": "You are an exploration master ..."},
        {"from": "gpt", "loss": False, "value": "OK. I'll follow your instructions and try my best to solve the task."},
        {"from": "human", "loss": None, "value": "Your goal: go to the red ball\nIn front of you ..."},
        {"from": "gpt", "loss": True, "value": "Thought:\nThe ball is ahead.\n\nAction:\nmove forward"},
        {"from": "human", "loss": None, "value": "In front of you ..."},
        {"from": "gpt", "loss": False, "value": "Thought:\nA detour.\n\nAction:\nturn left"},
        {"from": "human", "loss": None, "value": "The task is completed."},
    ],
    "source": "AgentTraj-L",
}


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(load_tokenizer("tiny-agent"))


def test_a_hand_written_record_reads_and_masks_only_trained_agent_turns(tmp_path, fmt):
    path = tmp_path / "babyai_train.json"
    path.write_text(json.dumps([HAND_WRITTEN]))
    (record,) = read_trajectories(path)
    ids, mask = encode(fmt, record)
    assert len(ids) == len(mask)
    turns = HAND_WRITTEN["conversations"]
    trained = fmt.encode(turns[3]["value"]) + [fmt.end_of_turn]
    assert fmt.tokenizer.decode([i for i, m in zip(ids, mask) if m]) == fmt.tokenizer.decode(trained)
    assert "A detour" in fmt.tokenizer.decode(ids) and "task is completed" not in fmt.tokenizer.decode(ids)
    assert read_trajectories(_jsonl(tmp_path, [HAND_WRITTEN])) == [HAND_WRITTEN]  # JSON lines too


def _jsonl(tmp_path, records):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("item_id"), r'record 1: needs "item_id"'),
    (lambda r: r.update(item_id="babyai_x"), r"record 1 \(babyai_x\): item_id 'babyai_x' does not end in a task number"),
    (lambda r: r["conversations"].pop(1), r'record 1 \(babyai_3\): conversations\[1\] must be a "gpt" turn'),
    (lambda r: r["conversations"][3].update(value=None), r'conversations\[3\] needs a string "value"'),
    (lambda r: r["conversations"][3].update(loss="yes"), r'"loss" is true, false or null'),
    (lambda r: r.update(reward="high"), r'"reward" is a number'),
])
def test_a_malformed_record_is_refused_naming_it(tmp_path, change, message):
    bad = json.loads(json.dumps(HAND_WRITTEN))
    change(bad)
    with pytest.raises(DataError, match=message):
        read_trajectories(_jsonl(tmp_path, [HAND_WRITTEN, bad]))
    with pytest.raises(DataError, match="does not exist"):
        read_trajectories(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name", ["babyai", "textcraft"])
def test_an_expert_rollout_and_its_record_give_identical_tokens_and_mask(fmt, name):
    environments = [envs.make(name) for _ in range(2)]
    task_ids = envs.splits(name)["train"][:2]
    played = rollout(ExpertEngine(fmt, environments), fmt, environments, task_ids, [0, 1], horizon=8,
                     max_new_tokens=256, max_tokens=16384)
    assert sum(t.turns for t in played) >= 2
    for trajectory in played:
        ids, mask = encode(fmt, to_record(trajectory))
        assert ids == trajectory.token_ids and mask == trajectory.loss_mask


def test_make_expert_data_writes_solved_episodes(tmp_path, fmt, capsys):
    out = tmp_path / "babyai.jsonl"
    summary = make_expert_data.main(["--env", "babyai", "--limit", "6", "--out", str(out)])
    records = read_trajectories(out)
    assert len(records) == summary["episodes"] >= 1 and summary["episodes"] + sum(summary["skipped"].values()) == 6
    assert all(r["reward"] > 0 and r["item_id"].startswith("babyai_") for r in records)
    assert records[0]["conversations"][1] == {"from": "gpt", "loss": False, "value": envs.make("babyai").ack}
    assert f"wrote {summary['episodes']} expert episodes" in capsys.readouterr().out


def test_make_expert_data_names_a_task_file_not_the_split(tmp_path, capsys, monkeypatch):
    """--tasks FILE: the summary line and the default output are named after the file, so that a custom task list
    never writes over (or is taken for) the train split's expert data."""
    ids = tmp_path / "hard_goals.json"
    envs.save_task_ids(ids, "babyai", envs.splits("babyai")["train"][:2])
    monkeypatch.chdir(tmp_path)
    summary = make_expert_data.main(["--env", "babyai", "--tasks", str(ids)])
    assert summary["out"] == "data/babyai_hard_goals_expert.jsonl" and (tmp_path / summary["out"]).is_file()
    assert capsys.readouterr().out.startswith("babyai hard_goals: wrote")
