"""DPO on whole trajectories: preference pairs of episodes of the same task, and the DPO loss on the
summed log-probs of their assistant tokens against the frozen reference model.

    pairs = make_pairs(records, margin=0.5)          # from rollout logs, eval outputs or AgentTraj files
    pairs = expert_pairs(expert, experience, margin)  # AgentGym's make_dpo_dataset: expert vs. the model's own
    loss, chosen_reward, rejected_reward = dpo_loss(policy_c, policy_r, ref_c, ref_r, beta=0.1)
    loss, sums, finite = dpo_terms(models, micro, beta, offloaded, accelerator)  # train.py: a micro-batch of pairs

A pair is (chosen, rejected): two records (rl/data.py) of one item_id whose rewards differ by at
least `margin`. Within a task the best episode is paired with the worst, the second best with the
second worst, and so on while the gap holds, so that no episode is used twice and a task with many
samples does not outweigh the others quadratically. Besides AgentGym's expert-versus-experience pairs
(`expert_pairs`), pairs are also made within a task of one file (our rollout logs and eval outputs).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl.logprobs import token_logprobs
from rl.model import reference
from rl.optimizer import Sums


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-log sigmoid(beta * (log-ratio of chosen - log-ratio of rejected)), per pair; all inputs [P]: the
    summed log-probs of each trajectory's assistant tokens. Returns the loss [P] and the implicit rewards
    beta * log(pi / ref) of the chosen and rejected trajectories [P] (their difference is the margin)."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen_reward - rejected_reward), chosen_reward.detach(), rejected_reward.detach()


@dataclass
class DPOSums(Sums):
    """A DPO pass's statistics, summed over its pairs (and processes)."""

    loss: float = 0.0
    pairs: float = 0.0
    correct: float = 0.0  # pairs whose chosen episode's implicit reward is above the rejected one's
    margin: float = 0.0
    chosen: float = 0.0
    rejected: float = 0.0

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The mean loss, accuracy, margin and implicit rewards per pair (`prefix` val_: on the held-out tasks)."""
        pairs = max(self.pairs, 1.0)
        return {f"dpo/{prefix}{name}": getattr(self, key) / pairs for name, key in
                (("loss", "loss"), ("accuracy", "correct"), ("margin", "margin"), ("chosen_reward", "chosen"),
                 ("rejected_reward", "rejected"))}


def dpo_terms(models, micro, beta: float, offloaded: bool,
              accelerator) -> tuple[torch.Tensor, DPOSums, bool]:
    """One micro-batch of train.py's DPO (rl/batch.MicroBatch), its chosen rows first and then their rejected ones
    in the same order ([2P, T]; `models`: rl/model.py's Models, `offloaded`: the reference kept in CPU memory): the
    DPO loss summed over its pairs, on summed assistant-token log-probs against the frozen reference, its
    statistics, and whether they are finite."""
    inputs = (micro.input_ids, micro.attention_mask, micro.loss_mask)
    with accelerator.autocast():
        logprobs, _ = token_logprobs(models.policy, *inputs, position_ids=micro.position_ids)
    with torch.no_grad(), accelerator.autocast(), reference(models, accelerator, offloaded) as reference_model:
        ref_logprobs, _ = token_logprobs(reference_model, *inputs)
    mask = micro.loss_mask
    summed, ref_summed = (logprobs * mask).sum(1), (ref_logprobs.float() * mask).sum(1)
    half = summed.shape[0] // 2
    loss, chosen, rejected = dpo_loss(summed[:half], summed[half:], ref_summed[:half], ref_summed[half:], beta)
    sums = DPOSums(loss=float(loss.detach().sum()), pairs=float(half), correct=float((chosen > rejected).sum()),
                   margin=float((chosen - rejected).sum()), chosen=float(chosen.sum()), rejected=float(rejected.sum()))
    return loss.sum(), sums, math.isfinite(sums.loss)


def make_pairs(records: list[dict], margin: float) -> list[tuple[dict, dict]]:
    """Disjoint (chosen, rejected) pairs within each task: best with worst while the rewards differ by at
    least `margin`. Records without a reward are left out."""
    by_task = defaultdict(list)
    for record in records:
        if record.get("reward") is not None:
            by_task[record["item_id"]].append(record)
    pairs = []
    for episodes in by_task.values():
        episodes = sorted(episodes, key=lambda r: r["reward"], reverse=True)
        for chosen, rejected in zip(episodes[:len(episodes) // 2], reversed(episodes[len(episodes) // 2:])):
            if chosen["reward"] - rejected["reward"] < margin:
                break
            pairs.append((chosen, rejected))
    return pairs


def expert_pairs(expert: list[dict], experience: list[dict], margin: float) -> list[tuple[dict, dict]]:
    """AgentGym's make_dpo_dataset: for each task in both, its expert episode (chosen) against each of the
    model's own episodes (rejected) that scored at least `margin` less. An expert record without a reward
    (AgentTraj-L has none) counts as solved: 1."""
    best = {}
    for record in expert:
        reward = record["reward"] if record.get("reward") is not None else 1.0
        if record["item_id"] not in best or reward > best[record["item_id"]][0]:
            best[record["item_id"]] = (reward, record)
    return [(best[r["item_id"]][1], r) for r in experience
            if r["item_id"] in best and r.get("reward") is not None and best[r["item_id"]][0] - r["reward"] >= margin]
