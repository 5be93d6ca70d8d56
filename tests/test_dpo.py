"""rl/dpo.py: pairs of episodes of one task by reward, AgentGym's expert-vs-experience pairs, and the DPO
loss, whose gradient raises the chosen action's log-prob and lowers the rejected one's."""

import json

import pytest
import torch

from rl.data import encode, read_trajectories
from rl.dpo import dpo_loss, expert_pairs, make_pairs
from rl.logprobs import token_logprobs
from rl.model import load_model, load_tokenizer
from rollout import ChatFormat


def record(item_id, reward, action="move forward"):
    return {"item_id": item_id, "reward": reward, "conversations": [
        {"from": "human", "loss": None, "value": "Play BabyAI."},
        {"from": "gpt", "loss": False, "value": "OK."},
        {"from": "human", "loss": None, "value": "Your goal: go to the red ball. It is right in front of you."},
        {"from": "gpt", "loss": True, "value": f"Thought:\nGo.\n\nAction:\n{action}"}]}


def test_pairs_within_a_task_are_disjoint_and_keep_the_margin():
    records = [record("babyai_1", r) for r in (1.0, 0.9, 0.2, 0.0)] + [record("babyai_2", r) for r in (0.5, 0.4)]
    pairs = make_pairs(records, margin=0.5)
    assert [(c["reward"], r["reward"]) for c, r in pairs] == [(1.0, 0.0), (0.9, 0.2)]  # babyai_2: gap too small
    expert = [{**record("babyai_1", None), "reward": None}, record("babyai_3", 1.0)]
    experience = [record("babyai_1", 0.0), record("babyai_1", 0.8), record("babyai_2", 0.0)]
    assert [(c["item_id"], r["reward"]) for c, r in expert_pairs(expert, experience, margin=0.5)] == [("babyai_1", 0.0)]


def test_rollout_log_lines_read_as_records(tmp_path):
    line = {"item_id": "babyai_4", "reward": 0.5, "success": True, "error": None, "messages": [
        {"role": "user", "content": "Play."}, {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "obs"}, {"role": "assistant", "content": "Action: turn left"},
        {"role": "user", "content": "done"}]}
    failed = {**line, "error": "reset failed: ConnectionError", "messages": line["messages"][:2]}
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(failed) + "\n")
    (loaded,) = read_trajectories(tmp_path / "rollouts.jsonl")  # the env failure has no outcome: left out
    assert loaded["reward"] == 0.5 and [t["from"] for t in loaded["conversations"]] == ["human", "gpt"] * 2 + ["human"]
    assert loaded["conversations"][3]["loss"] is True and loaded["conversations"][1]["loss"] is False


def test_dpo_loss_by_hand():
    zero = torch.zeros(1)
    loss, chosen, rejected = dpo_loss(zero, zero, zero, zero, beta=0.1)
    assert torch.allclose(loss, torch.log(torch.tensor(2.0)))  # policy = reference: no preference yet
    loss, chosen, rejected = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]),
                                      torch.tensor([-2.0]), beta=0.5)
    assert chosen.item() == 0.5 and rejected.item() == -0.5
    assert torch.allclose(loss, -torch.nn.functional.logsigmoid(torch.tensor([1.0])))


def test_a_dpo_step_raises_the_chosen_action_over_the_rejected_one():
    """The gradient pushes the chosen trajectory's log-prob up and the rejected one's down; after one step
    the chosen action (the tokens where the two replies part) is likelier, the rejected one less likely,
    and the loss lower. (The shared tokens before that may move either way: DPO does not hold them.)"""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    policy, ref = load_model("tiny-agent"), load_model("tiny-agent").eval()
    pair = [encode(fmt, record("babyai_1", 1.0, "move forward")), encode(fmt, record("babyai_1", 0.0, "turn left"))]
    part = next(k for k, (a, b) in enumerate(zip(pair[0][0], pair[1][0])) if a != b)

    def scored(model):  # per trajectory: summed log-prob of its assistant tokens, and of its own action's
        totals, actions = [], []
        for ids, mask in pair:
            mask = torch.tensor([mask], dtype=torch.float32)
            logprobs, _ = token_logprobs(model, torch.tensor([ids]), torch.ones_like(mask, dtype=torch.long), mask)
            totals.append((logprobs * mask).sum())
            actions.append((logprobs * mask)[0, part:].sum())
        return totals, actions

    with torch.no_grad():
        (ref_chosen, ref_rejected), ref_actions = scored(ref)
    (policy_chosen, policy_rejected), _ = scored(policy)
    policy_chosen.retain_grad(), policy_rejected.retain_grad()
    loss, _, _ = dpo_loss(policy_chosen[None], policy_rejected[None], ref_chosen[None], ref_rejected[None], beta=0.5)
    loss.sum().backward()
    assert policy_chosen.grad < 0 < policy_rejected.grad  # descent raises chosen, lowers rejected
    torch.optim.SGD(policy.parameters(), lr=0.01).step()
    with torch.no_grad():
        (after_chosen, after_rejected), after_actions = scored(policy)
    assert after_actions[0] > ref_actions[0] and after_actions[1] < ref_actions[1]
    assert dpo_loss(after_chosen[None], after_rejected[None], ref_chosen[None], ref_rejected[None], 0.5)[0] < loss
