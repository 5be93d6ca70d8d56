"""train.py --algo sft, dpo and agentevol on the embedded model, offline: SFT lowers the loss on expert
data and makes the greedy policy say the expert's actions more often; its checkpoint chains into eval.py
and GRPO; DPO moves the chosen episodes above the rejected ones; one AgentEvol iteration grows its
buffer of successes without losing test success; bad input stops with a message."""

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import envs
import eval as eval_script
from rl.flags import build
import train
from rl.data import encode, read_trajectories
from rl.engines.hf import HFEngine
from rl.model import load_model, load_tokenizer
from rl.batch import pack
from rl.sft import sft_loss
from rollout import ChatFormat, play

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_expert_data  # noqa: E402

TIMING = ("perf/", "charts/step")


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(load_tokenizer("tiny-agent"))


@pytest.fixture(scope="module")
def expert(tmp_path_factory):
    """The BabyAI oracle's solved episodes of 120 train tasks at the tiny preset's horizon (the short ones:
    the tests' time goes mostly to attention over long sequences)."""
    out = tmp_path_factory.mktemp("data") / "babyai_expert.jsonl"
    make_expert_data.main(["--env", "babyai", "--limit", "120", "--horizon", "6", "--max-tokens", "1536",
                           "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    """A few of the oracle's episodes, enough for the checks that stop a run before it trains."""
    out = tmp_path_factory.mktemp("few") / "babyai_expert.jsonl"
    make_expert_data.main(["--env", "babyai", "--limit", "8", "--horizon", "6", "--max-tokens", "1536", "--out", str(out)])
    return out


def run(tmp_path, name, *flags, engine="hf"):
    args = train.parse_args(["--out-dir", str(tmp_path), "--run-name", name, "--engine", engine, *flags])
    run_dir = train.main(args)
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def action_match(model_dir, fmt, records) -> float:
    """Share of the expert's trained turns whose action the model's greedy reply repeats, each turn
    played from the expert's own history (teacher forcing, one turn at a time)."""
    prompts, expected = [], []
    for record in records:
        turns = record["conversations"]
        for k in range(3, len(turns)):
            if turns[k]["from"] == "gpt" and turns[k]["loss"] is not False:
                ids, _ = encode(fmt, {**record, "conversations": turns[:k + 1]})
                prompts.append(types.SimpleNamespace(token_ids=ids[:-(len(fmt.encode(turns[k]["value"])) + 1)]))
                expected.append(envs.react_action(turns[k]["value"]))
    engine = HFEngine(load_model(str(model_dir)).eval(), fmt, temperature=0.0)
    replies = engine.generate(prompts, [48] * len(prompts))
    return sum(envs.react_action(fmt.text(r.token_ids)) == e for r, e in zip(replies, expected)) / len(expected)


def nll(model_dir, fmt, records) -> float:
    with torch.no_grad():
        return float(sft_loss(load_model(str(model_dir)).eval(), pack([encode(fmt, r) for r in records], 3072, fmt.pad_id)))


@pytest.mark.slow
def test_sft_learns_the_expert_and_its_checkpoint_chains_into_eval_and_grpo(tmp_path, expert, fmt):
    run_dir, metrics = run(tmp_path, "sft", "--algo", "sft", "--data", str(expert), "--epochs", "2",
                           "--batch-size", "8", "--eval-every", "4", "--eval-tasks", "2")
    checkpoint = sorted((run_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))[-1]
    steps = metrics[-1]["charts/step"]
    assert checkpoint.name == f"step_{steps}" and [m["charts/step"] for m in metrics] == list(range(1, steps + 1))
    assert all(math.isfinite(m["sft/loss"]) and m["sft/tokens"] > 0 for m in metrics)
    # the validation loss at every --eval-every step and at the end, the test split played then too
    assert [m["charts/step"] for m in metrics if "sft/val_loss" in m] == [s for s in range(1, steps + 1)
                                                                         if s % 4 == 0 or s == steps]
    assert all(0 <= m["eval/success"] <= 1 for m in metrics if "sft/val_loss" in m)
    evaluated = [json.loads(line) for line in (run_dir / "evaluations.jsonl").read_text().splitlines()]
    assert len(evaluated) == 2 * train.PRESETS["tiny"].eval_k * len([m for m in metrics if "eval/success" in m])
    assert (run_dir / "rollouts.jsonl").read_text() == ""  # SFT samples nothing to train on

    train_records = read_trajectories(expert)[:24]
    before, after = nll("tiny-agent", fmt, train_records), nll(checkpoint, fmt, train_records)
    assert after < 0.95 * before, (before, after)
    matched_before, matched_after = action_match("tiny-agent", fmt, train_records), action_match(checkpoint, fmt, train_records)
    assert matched_after > matched_before, (matched_before, matched_after)

    # the checkpoint is a model: eval.py plays it under the run's limits, GRPO starts from it with the tiny preset
    results = eval_script.main(build(eval_script.Args, model=str(checkpoint), limit=4, engine="hf", out=str(tmp_path / "ev")))
    assert results["protocol"] == "run" and results["horizon"] == 6 and results["tasks"] == 4
    grpo = train.parse_args(["--model", str(checkpoint), "--steps", "1", "--tasks-per-step", "2", "--n", "2",
                             "--horizon", "2", "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", "grpo"])
    assert grpo.preset == "tiny" and grpo.model_args.lr == train.PRESETS["tiny"].model_args.lr
    assert (train.main(grpo) / "checkpoints" / "step_1" / "model.safetensors").is_file()


@pytest.mark.slow
def test_dpo_raises_the_chosen_episodes_over_the_rejected(tmp_path, expert, fmt):
    """AgentGym's pairs: the oracle's episode of a task (chosen) against the embedded model's own
    (rejected), which mostly fails."""
    records = read_trajectories(expert)[:24]
    task_ids = [int(r["item_id"].rpartition("_")[2]) for r in records]
    environments = [envs.make("babyai") for _ in task_ids]
    engine = HFEngine(load_model("tiny-agent").eval(), fmt, temperature=1.0, seed=0)
    own = play(engine, fmt, environments, task_ids, horizon=6, max_new_tokens=48, max_tokens=3072)
    experience = tmp_path / "experience.jsonl"
    experience.write_text("".join(json.dumps(t.log_record()) + "\n" for t in own))
    assert sum(r["reward"] - t.reward >= 0.5 for r, t in zip(records, own)) >= 8  # enough pairs

    _, metrics = run(tmp_path, "dpo", "--algo", "dpo", "--data", str(expert), "--experience", str(experience),
                     "--batch-size", "4", "--steps", "4", "--validation", "0")
    assert metrics[0]["dpo/margin"] == pytest.approx(0, abs=1e-4)  # the policy is its reference at step 1
    assert metrics[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert metrics[-1]["dpo/margin"] > 0.05 and metrics[-1]["dpo/accuracy"] > 0.5
    assert metrics[-1]["dpo/loss"] < math.log(2)
    assert all(m["dpo/chosen_reward"] - m["dpo/rejected_reward"] == pytest.approx(m["dpo/margin"]) for m in metrics)


@pytest.mark.slow
def test_pairs_from_a_run_log_within_tasks(tmp_path):
    """--data without --experience: pairs within each task of a rollout log, by reward."""
    log = tmp_path / "rollouts.jsonl"
    fmt_messages = lambda action: [  # noqa: E731
        {"role": "user", "content": "Play."}, {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "Your goal: go to the ball."},
        {"role": "assistant", "content": f"Thought:\nGo.\n\nAction:\n{action}"}]
    lines = [{"item_id": f"babyai_{i}", "reward": reward, "messages": fmt_messages(action), "error": None}
             for i in range(8) for reward, action in ((0.9, "move forward"), (0.0, "turn left"))]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _, metrics = run(tmp_path, "dpo-log", "--algo", "dpo", "--data", str(log), "--batch-size", "4", "--steps", "4",
                     "--validation", "0.25")
    assert len(metrics) == 4 and metrics[-1]["dpo/margin"] > metrics[0]["dpo/margin"]
    assert "dpo/val_accuracy" in metrics[-1]  # 2 of the 8 tasks held out


@pytest.mark.slow
def test_sft_resumes_exactly(tmp_path, expert):
    flags = ("--algo", "sft", "--data", str(expert), "--batch-size", "4", "--save-every", "2")
    _, whole = run(tmp_path, "whole", *flags, "--steps", "4")
    run(tmp_path, "parts", *flags, "--steps", "2")
    _, parts = run(tmp_path, "parts", *flags, "--steps", "4", "--resume", "auto")
    # (the first part's last step also measured the validation loss, as every run's last step does)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(TIMING) and "val_" not in k}  # noqa: E731
    assert [strip(m) for m in parts] == [strip(m) for m in whole]


@pytest.mark.slow
def test_one_agentevol_iteration_grows_its_buffer_and_keeps_test_success(tmp_path, expert):
    # explored: the GoTo tasks the oracle solved within the horizon, which the embedded model solves 1 time in 5
    solved = [int(r["item_id"].rpartition("_")[2]) for r in read_trajectories(expert)]
    goto = [i for i in solved if envs.category("babyai", i) == "GoTo"][:20]
    envs.save_task_ids(tmp_path / "goto.json", "babyai", goto)
    run_dir, metrics = run(tmp_path, "evol", "--algo", "agentevol", "--data", str(expert), "--iterations", "1",
                           "--train-tasks", str(tmp_path / "goto.json"), "--n", "3", "--eval-tasks", "24",
                           "--epochs", "1", "--batch-size", "8", engine="auto")  # (vLLM where installed: 10x faster)
    assert [m["evol/iteration"] for m in metrics] == [0, 1]
    assert metrics[0]["evol/buffer"] == 0 and metrics[1]["evol/explored"] == 3 * len(goto)
    assert metrics[1]["evol/buffer"] > 0
    assert metrics[1]["evol/conversations"] == metrics[0]["evol/conversations"] + metrics[1]["evol/buffer"]
    explored = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(explored) == 3 * len(goto) and sum(r["success"] for r in explored) == metrics[1]["evol/buffer"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0", "step_1"]

    test = str(envs.DATA_DIR / "babyai_tiny_test.json")  # the tiny preset's test tasks, which agentevol played
    base = eval_script.main(build(eval_script.Args, model="tiny-agent", tasks=test, limit=24, out=str(tmp_path / "base")))
    p = max(base["success"], 0.1)
    noise = 2 * math.sqrt(2 * p * (1 - p) / 24)  # two standard errors of a difference of two 24-task means
    assert metrics[1]["eval/success"] >= base["success"] - noise, (base["success"], metrics[1]["eval/success"])


@pytest.mark.parametrize("flags, message", [
    (["--algo", "sft"], "give --data"),
    (["--algo", "sft", "--data", "missing.jsonl"], "does not exist"),
    (["--algo", "sft", "--data", "{expert}", "--experience", "{expert}"], "use it with --algo dpo"),
    (["--algo", "grpo", "--data", "{expert}"], "learns from its own rollouts"),
    (["--algo", "sft", "--data", "{expert}", "--env", "textcraft"], "--env babyai"),
    (["--algo", "sft", "--data", "{bad}"], "record 1 \\(babyai_7\\)"),
    (["--algo", "sft", "--data", "{expert}", "--batch-size", "1000"], "fewer than --batch-size 1000"),
    (["--algo", "agentevol", "--data", "{expert}", "--resume", "auto"], "does not continue an agentevol run"),
    (["--algo", "agentevol", "--data", "{expert}", "--horizon", "2", "4"], "one turn cap"),
])
def test_bad_input_stops_with_a_message(tmp_path, few, flags, message):
    bad = tmp_path / "bad.jsonl"
    good = read_trajectories(few)[0]
    bad.write_text(json.dumps(good) + "\n" + json.dumps({"item_id": "babyai_7", "conversations": "none"}) + "\n")
    flags = [f.format(expert=few, bad=bad) for f in flags]
    with pytest.raises(SystemExit, match=message):
        run(tmp_path, "bad", *flags)
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.slow
def test_agentevol_syncs_each_iterations_weights_once(tmp_path, few, monkeypatch):
    """Each iteration's weights reach the engine once, before its test split; the next iteration explores with them
    as they are (tests/test_train.py's counted_loads)."""
    from test_train import counted_loads

    loads = counted_loads(monkeypatch)
    run(tmp_path, "evol", "--algo", "agentevol", "--data", str(few), "--iterations", "1", "--explore-tasks", "1",
        "--n", "1", "--eval-tasks", "1", "--epochs", "1", "--batch-size", "1")
    assert len(loads) == 2  # (iterations 0 and 1)
