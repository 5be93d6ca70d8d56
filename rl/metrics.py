"""A step's metrics (metrics.jsonl, wandb) and its printed line, from what its phases measured:

    rollout/   the step's episodes, over every process    finish/   how they ended, as shares
    losses/    the update's, per action token              critic/   PPO's values and returns
    perf/      time, throughput and peak memory            sync/     the engine's weight sync
    async/     --max-staleness: staleness, importance weights
    mismatch/  the engine's log-probs against the trainer's on lag-0 tokens (--mismatch)
    category/  reward and success per task category        charts/   learning rates, the step
    eval/      the test split (--eval-every)               sft/, dpo/, evol/: learning from trajectory files

The losses are this process's (its update's micro-batches, UpdateSums); the rollout statistics are over every
process's episodes (their log records).
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass

import torch

from rl.advantages import ESTIMATORS, step_advantages
from rl.losses import PolicyTerms, Weights, kl
from rl.memory import peak_gib, reset_peak
from rl.optimizer import Sums, largest
from rl.scores import FINISHES, endings, macro
from rl.trajectory import RolloutStats


@dataclass
class Costs:
    """A step's time and peak memory by phase, on this process (its perf/ metrics)."""

    rollout: RolloutStats  # the step's share of the rollout loop's (Rollouts.spent)
    rollout_peak_gib: float = 0.0  # GPU allocated, else resident set (rl/memory.py)
    update_s: float = 0.0  # the batch, old/reference log-probs, advantages, every optimizer step
    update_peak_gib: float = 0.0

    @contextlib.contextmanager
    def measure(self, phase: str):
        """A phase of the step, "rollout" or "update": its peak memory, and the update's seconds (the rollout times
        itself: RolloutStats)."""
        reset_peak()
        start = time.perf_counter()
        yield
        if phase == "rollout":
            self.rollout_peak_gib = peak_gib()
        else:
            self.update_s, self.update_peak_gib = time.perf_counter() - start, peak_gib()


@dataclass
class UpdateSums(Sums):
    """What an update's micro-batches add up to on this process, for the step's metrics: the policy's and the
    critic's statistics summed over their action tokens (step_metrics divides by `tokens`, `critic_tokens`)."""

    tokens: float = 0.0
    policy: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipfrac: float = 0.0
    ppo_kl: float = 0.0
    fresh_tokens: float = 0.0  # action tokens sampled by the weights being updated (lag 0; all without --max-staleness)
    logprob_diff: float = 0.0  # |sampler's - trainer's log-prob| over them: the engine check
    logprob_diff_max: float = largest()
    mismatch_kl: float = 0.0  # k3 estimate of KL(engine || trainer) over them, summed
    mismatch_truncated: float = 0.0  # of them, those above --mismatch-cap (tis truncates them)
    mismatch_masked: float = 0.0  # those in a sequence whose ratio is above --mismatch-cap (mis masks them)
    mismatch_masked_tokens: float = 0.0  # those outside icepop's band themselves (icepop masks them)
    mismatch_rejected: float = 0.0  # those in a sequence whose geometric mean is outside geo-rs's band (rejected)
    mismatch_ratio_max: float = largest()  # their largest pi_trainer / pi_engine
    critic_tokens: float = 0.0
    value: float = 0.0
    value_clipfrac: float = 0.0
    stale_tokens: float = 0.0  # --max-staleness: tokens sampled by older weights than those updated (lag >= 1)
    logprob_diff_stale: float = 0.0  # their |sampler's - trainer's log-prob|: staleness more than the engine
    is_weight: float = 0.0  # their importance weights (rl/losses.importance_weights), summed
    is_weight_max: float = largest()
    is_truncated: float = 0.0  # of them, those the cap truncated


def weight_sums(weighed: Weights, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
                lag: torch.Tensor | None) -> dict[str, float]:
    """UpdateSums' fields of the sampler-vs-trainer gap from one micro-batch (rl/losses.importance_weights' answer,
    the trainer's and the engine's log-probs, the loss mask, `lag`: None without --max-staleness), [B, T] each: at
    lag 0 the engine check and the mismatch, at lag >= 1 the staleness and its weights."""
    action = mask > 0
    stale = action & (lag > 0) if lag is not None else torch.zeros_like(action)
    fresh = action & ~stale
    diff = (engine - trainer).abs()
    sums = {"fresh_tokens": float(fresh.sum()), "logprob_diff": float(diff[fresh].sum()),
            "logprob_diff_max": float(diff[fresh].max()) if fresh.any() else 0.0,
            # (in fp64: at an fp32 engine's gap of 1e-7, exp(d) - d - 1 in fp32 is all rounding, and negative)
            "mismatch_kl": float(kl(engine.double(), trainer.double(), "k3")[fresh].sum()),
            "mismatch_truncated": float(weighed.truncated.sum()), "mismatch_masked": float(weighed.masked.sum()),
            "mismatch_masked_tokens": float(weighed.masked_tokens.sum()),
            "mismatch_rejected": float(weighed.rejected.sum()),
            "mismatch_ratio_max": float(torch.exp(trainer - engine)[fresh].max()) if fresh.any() else 0.0}
    if lag is None:
        return sums
    return sums | {"stale_tokens": float(stale.sum()), "logprob_diff_stale": float(diff[stale].sum()),
                   "is_weight": float(weighed.weights[stale].sum()),
                   "is_weight_max": float(weighed.weights[stale].max()) if stale.any() else 0.0,
                   "is_truncated": float(weighed.stale_truncated.sum())}


def policy_sums(terms: PolicyTerms, micro) -> UpdateSums:
    """UpdateSums of one micro-batch's policy loss (rl/losses.policy_objective's terms; `micro`: its
    rl/batch.MicroBatch)."""
    mask = micro.loss_mask
    with torch.no_grad():
        return UpdateSums(tokens=float(mask.sum()), policy=float((terms.policy * mask).sum()),
                          kl=float((terms.divergence * mask).sum()), entropy=float((terms.entropy * mask).sum()),
                          clipfrac=float((terms.clipped * mask).sum()),
                          ppo_kl=float(((terms.old - terms.logprobs) * mask).sum()),
                          **weight_sums(terms.weighed, terms.old, micro.sampler_logprobs, mask, micro.lag))


def async_metrics(batch, sums: UpdateSums, staleness: int) -> dict[str, float]:
    """--max-staleness's metrics (this process's): how many updates old the trained tokens were (mean, max, and
    the share at each lag 0..k), their importance weights over the stale ones (mean, max, share truncated), and the
    stale tokens' mean |sampler - trainer| log-prob (rollout/logprob_diff is the lag-0 tokens')."""
    mask = batch.full.loss_mask > 0
    lag = (batch.full.lag if batch.full.lag is not None else torch.zeros_like(batch.full.loss_mask))[mask]
    tokens = max(int(mask.sum()), 1)
    stale = max(sums.stale_tokens, 1.0)
    return {
        "async/staleness_mean": float(lag.sum()) / tokens,
        "async/staleness_max": float(lag.max()) if len(lag) else 0.0,
        **{f"async/lag_{k}_share": float((lag == k).sum()) / tokens for k in range(staleness + 1)},
        "async/is_weight_mean": sums.is_weight / stale if sums.stale_tokens else 1.0,
        "async/is_weight_max": sums.is_weight_max if sums.stale_tokens else 1.0,
        "async/is_truncated_share": sums.is_truncated / stale,
        "async/logprob_diff_stale": sums.logprob_diff_stale / stale,  # (rollout/logprob_diff: the lag-0 tokens')
    }


def step_metrics(records: list[dict], sampled: list[tuple[int, float]], costs: Costs, sums: UpdateSums,
                 grad_norms: dict[str, list[float]], batch, advantages: torch.Tensor, returns: torch.Tensor | None,
                 models, horizon: int, engine_metrics: dict, why: str | None = None,
                 staleness: int | None = None, estimator_args=None) -> dict:
    """The step's metrics: trajectory statistics over every process's episodes (`records`), losses per
    action token from this process's update (none for a model that did not train this step). `batch`: the step's
    rl/batch.py Batch, `models`: rl/model.py's Models; `sampled`: each process's tokens sampled and engine seconds;
    `why`: --horizon auto's reason for this step's cap; `staleness`: --max-staleness (its async/ metrics);
    `estimator_args`: train.py's EstimatorArgs, whose gigpo --gamma rollout/step_advantage_share is measured at."""
    rewards = [r["reward"] for r in records]
    success = [r["success"] for r in records]
    turns = [r["turns"] for r in records]
    finishes = [r["finish"] for r in records]
    tokens = [r["tokens"] for r in records]
    action_tokens = [r["action_tokens"] for r in records]
    trained_tokens = max(float(batch.full.loss_mask.sum()), 1)
    played = costs.rollout
    generated, generating = sum(tokens for tokens, _ in sampled), max(seconds for _, seconds in sampled)

    def mean(values):
        return sum(values) / max(len(values), 1)

    calls = sorted(played.env_call_s)
    metrics = {
        "rollout/reward": mean(rewards),
        "rollout/success": mean(success),
        "rollout/turns": mean(turns),
        "rollout/errors": finishes.count("error"),
        "rollout/trajectories": len(records),  # tasks x --n, and under --agent reflect every retried attempt
        # how episodes ended, as shares: the env said done, the horizon cap, out of tokens (budget or context), env failure
        **{f"finish/{name}": finishes.count(finish) / len(finishes) for finish, name in FINISHES.items()},
        "rollout/invalid_action_rate": sum(r["invalid_actions"] for r in records) / max(sum(turns), 1),
        # of those, the replies with no action to take (no or a bad tool call, cut inside the reasoning)
        "rollout/malformed_rate": sum(r.get("malformed", 0) for r in records) / max(sum(turns), 1),
        "rollout/obs_cut": obs_cut(records),  # the share of observations --max-obs-tokens cut
        **context_metrics(records),
        "rollout/zero_variance_groups": zero_variance_share(records),  # groups with no GRPO signal
        # --dynamic-sampling: such groups played again on new tasks this step (this process's), and the rounds that did
        "rollout/dynamic_groups": played.redrawn_groups, "rollout/dynamic_rounds": played.redraw_rounds,
        **anchor_metrics(records, getattr(estimator_args, "gamma", None)),  # GiGPO's turn groups (any --algo)
        **category_metrics(records),
        **env_metrics(records),
        "losses/nonfinite_updates": sums.nonfinite_updates,  # optimizer steps skipped for NaN or inf
        "rollout/tokens": mean(tokens),
        "rollout/action_tokens": mean(action_tokens),
        "rollout/horizon": horizon,
        "rollout/advantage_mean": float(advantages.sum()) / trained_tokens,
        "rollout/advantage_abs": float(advantages.abs().sum()) / trained_tokens,
        # the tokens the engines generated during the step over the seconds they spent on it (the longest process's);
        # none when they generated nothing: under --max-staleness k a step's set, and the ones after it, may have been
        # played during earlier steps (the last k steps often are)
        **({"perf/tokens_per_s": generated / max(generating, 1e-9)} if generated else {}),
        "perf/rollout_s": played.rollout_s,
        "perf/generate_s": played.generate_s,
        # the share of the rollout's wall time in which the engine waited for envs with nothing to generate
        "perf/env_wait_share": played.idle_s / max(played.rollout_s, 1e-9),
        "perf/env_call_s": played.env_s / max(played.env_calls, 1),  # mean seconds of a reset or step
        "perf/env_call_p95_s": calls[min(len(calls) - 1, int(0.95 * len(calls)))] if calls else 0.0,
        "perf/update_s": costs.update_s,
        "perf/update_tokens_per_s": batch.tokens / max(costs.update_s, 1e-9),
        "perf/update_padding_share": 1 - batch.tokens / max(batch.positions, 1),  # pad positions of its micro-batches
        "perf/rollout_peak_gib": costs.rollout_peak_gib,
        "perf/update_peak_gib": costs.update_peak_gib,
        **({"perf/prefix_hit_rate": engine_metrics["prefix_hit_rate"]} if "prefix_hit_rate" in engine_metrics else {}),
        **{key: value for key, value in engine_metrics.items() if key.startswith("sync/")},
        **({"rollout/server_lost_turns": engine_metrics["server_lost_turns"]} if "server_lost_turns" in engine_metrics
           else {}),  # turns a rollout server failed (it died or stalled; rl/engines/remote.py)
        "charts/lr": models.scheduler.get_last_lr()[0],
    }
    per_token, per_critic_token = max(sums.tokens, 1.0), max(sums.critic_tokens, 1.0)
    per_fresh = max(sums.fresh_tokens, 1.0)
    if "policy" in grad_norms:
        metrics |= {
            "rollout/logprob_diff": sums.logprob_diff / per_fresh,  # (lag-0 tokens: the engine check)
            "rollout/logprob_diff_max": sums.logprob_diff_max,
            "mismatch/kl": sums.mismatch_kl / per_fresh,
            "mismatch/truncated": sums.mismatch_truncated / per_fresh,
            "mismatch/masked": sums.mismatch_masked / per_fresh,
            "mismatch/masked_tokens": sums.mismatch_masked_tokens / per_fresh,
            "mismatch/rejected": sums.mismatch_rejected / per_fresh,
            "mismatch/ratio_max": sums.mismatch_ratio_max,
            "losses/policy": sums.policy / per_token,
            "losses/kl": sums.kl / per_token,
            "losses/entropy": sums.entropy / per_token,
            "losses/clipfrac": sums.clipfrac / per_token,
            "losses/ppo_kl": sums.ppo_kl / per_token,
            "losses/grad_norm": mean(grad_norms["policy"]),
        }
    if "critic" in grad_norms:
        metrics |= {
            "losses/value": sums.value / per_critic_token,
            "losses/value_clipfrac": sums.value_clipfrac / per_critic_token,
            "losses/critic_grad_norm": mean(grad_norms["critic"]),
            "critic/value": float(batch.full.old_values.sum()) / trained_tokens,
            "critic/return": float(returns.sum()) / trained_tokens,
            "charts/critic_lr": models.critic_scheduler.get_last_lr()[0],
        }
    metrics |= {"rollout/horizon_reason": why} if why else {}
    return metrics | (async_metrics(batch, sums, staleness) if staleness is not None else {})


def timing(step: int, started: float, generate_s: float) -> dict[str, float]:
    """A step's wall seconds since `started` (time.perf_counter), the share of them the engine did not generate,
    and the step's number."""
    step_s = time.perf_counter() - started
    return {"perf/step_s": step_s, "perf/engine_idle_share": 1 - generate_s / step_s, "charts/step": step}


def zero_variance_share(records: list[dict]) -> float:
    """The share of task groups (n episodes of one task) whose rewards are all equal: GRPO gives them no advantage."""
    groups = collections.defaultdict(list)
    for r in records:
        if r["finish"] != "error":
            groups[(r["item_id"], r["group"])].append(r["reward"])
    return sum(len(set(rewards)) == 1 for rewards in groups.values()) / max(len(groups), 1)


def anchor_metrics(records: list[dict], gamma: float | None = None) -> dict[str, float]:
    """GiGPO's anchor groups among the step's episodes (rl/advantages.step_advantages; logged under any --algo): the
    turns of a task group taken from the same env state, each sampled turn counted once (--group-start fork: a group's
    shared first turns are in every one of its episodes, and are the one turn each that the policy sampled). How many
    groups, their mean size in turns, the share of turns in a group of two or more (rollout/anchored_share), and the
    share of turns whose step advantage is not 0 (rollout/step_advantage_share: at gigpo's `gamma`, without
    --kl-in-reward's penalty; a shared turn's copies summed, as the update sums their gradients, so that a turn
    compared only with its own copies counts as none): the turns GiGPO's step term trains."""
    healthy = [r for r in records if r["finish"] != "error"]
    group_of: dict[tuple, int] = {}
    groups = [group_of.setdefault((r["item_id"], r["group"]), len(group_of)) for r in healthy]
    anchors = [r.get("states", [None] * r["turns"])[:r["turns"]] for r in healthy]
    gamma = ESTIMATORS["gigpo"].flags["gamma"].default if gamma is None else gamma
    steps = step_advantages([r["reward"] for r in healthy], groups, [True] * len(healthy), anchors, gamma)
    advantage, state = collections.defaultdict(float), {}  # each sampled turn's, a shared one's keyed by its group
    for k, r in enumerate(healthy):
        for t, key in enumerate(anchors[k]):
            turn = ("shared", groups[k], t) if t < r.get("prefix_turns", 0) else ("own", k, t)
            advantage[turn] += steps[k][t]
            state[turn] = (groups[k], key)
    sizes = collections.Counter(at for at in state.values() if at[1] is not None)
    turns = max(len(state), 1)
    return {"rollout/anchor_groups": len(sizes), "rollout/anchor_size": sum(sizes.values()) / max(len(sizes), 1),
            "rollout/anchored_share": sum(n for n in sizes.values() if n >= 2) / turns,
            "rollout/step_advantage_share": sum(abs(a) > 1e-9 for a in advantage.values()) / turns}


def context_metrics(records: list[dict]) -> dict[str, float]:
    """What a turn's prompt held (rl/context.py): the sequences an episode trained as (rollout/segments), the prompt
    tokens a turn was sampled after, mean and max over the step's turns (flat under --context window, growing under
    full)."""
    prompts = [n for r in records for n in r.get("prompt_tokens", [])]
    return {"rollout/segments": sum(r.get("segments", 1) for r in records) / max(len(records), 1),
            "rollout/prompt_tokens": sum(prompts) / max(len(prompts), 1),
            "rollout/prompt_tokens_max": max(prompts, default=0)}


def obs_cut(records: list[dict]) -> float:
    """The share of the episodes' observations (their first ones too) that --max-obs-tokens cut."""
    return sum(r.get("obs_cut", 0) for r in records) / max(sum(r.get("observations", 0) for r in records), 1)


def env_metrics(records: list[dict]) -> dict[str, float]:
    """With several envs in a step, each one's episodes as the rollout/ and finish/ totals sum up all of them
    (rollout/<env>/reward, success, turns, invalid_action_rate, obs_cut, tokens, action_tokens, errors,
    finish/<name>) and the cap they played under (horizon); nothing for one env."""
    by_env = collections.defaultdict(list)
    for r in records:
        by_env[r["item_id"].rpartition("_")[0]].append(r)
    if len(by_env) < 2:
        return {}
    metrics = {}
    for name, rs in sorted(by_env.items()):
        turns = sum(r["turns"] for r in rs)
        metrics |= {f"rollout/{name}/{key}": sum(float(r[key]) for r in rs) / len(rs)
                    for key in ("reward", "success", "turns", "tokens", "action_tokens")}
        metrics |= {f"rollout/{name}/invalid_action_rate": sum(r["invalid_actions"] for r in rs) / max(turns, 1),
                    f"rollout/{name}/obs_cut": obs_cut(rs),
                    f"rollout/{name}/errors": sum(r["finish"] == "error" for r in rs),
                    f"rollout/{name}/horizon": max(r["horizon"] for r in rs)}  # (its cap: --horizon auto's, per env)
        metrics |= {f"rollout/{name}/finish/{label}": sum(r["finish"] == finish for r in rs) / len(rs)
                    for finish, label in FINISHES.items()}
    return metrics


def category_metrics(records: list[dict]) -> dict[str, float]:
    """Reward and success per task category (category/<name>/reward, .../success)."""
    by_category = collections.defaultdict(list)
    for r in records:
        by_category[r.get("category")].append(r)
    return {f"category/{name}/{key}": sum(float(r[key]) for r in rs) / len(rs)
            for name, rs in by_category.items() if name is not None for key in ("reward", "success")}


EVAL_KEYS = ("avg@k", "pass@k", "success", "turns", "errors", "invalid_action_rate", "malformed")


def eval_metrics(results: dict[str, dict], horizon: int, max_tokens: int) -> dict[str, float]:
    """An evaluation's metrics (eval/) from rl/scores.py's score of each env's episodes (`results`, by env): Avg@k,
    Pass@k, success, turns and errors, Avg@k per category, how its episodes ended, and the limits they played
    under. With several envs each env's are under eval/<env>/, and eval/ holds their macro average (every env
    weighs the same, whatever its number of test tasks; Avg@k as a share of each env's best score: rl/scores.py's macro;
    errors summed)."""
    def of(result: dict, prefix: str) -> dict[str, float]:
        metrics = {f"{prefix}/{key}": result[key] for key in EVAL_KEYS}
        metrics |= {f"{prefix}/{name}/avg@k": c["avg@k"] for name, c in result["categories"].items()}
        return metrics | {f"{prefix}/finish/{name}": share for name, share in result["finish"].items()}

    if len(results) == 1:
        metrics = of(next(iter(results.values())), "eval")
    else:
        metrics = {key: value for name, result in results.items() for key, value in of(result, f"eval/{name}").items()}
        metrics |= {f"eval/{key}": (sum if key == "errors" else _mean)([r[key] for r in results.values()])
                    for key in EVAL_KEYS} | {f"eval/{key}": value for key, value in macro(results).items()}
        metrics |= {f"eval/finish/{name}": _mean([r["finish"][name] for r in results.values()])
                    for name in FINISHES.values()}
    return metrics | {"eval/horizon": horizon, "eval/max_tokens": max_tokens}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ----------------------------------------------------------------------------------------------
# The printed lines


def _by_env(metrics: dict, prefix: str, key: str) -> str:
    """With several envs, each one's `prefix`/<env>/`key` as " (babyai 0.50, textcraft 0.12)"; else nothing."""
    values = {name[len(prefix) + 1:-len(key) - 1]: value for name, value in metrics.items()
              if name.startswith(f"{prefix}/") and name.endswith(f"/{key}") and name.count("/") > 1}
    return f" ({', '.join(f'{name} {value:.2f}' for name, value in values.items())})" if values else ""


def rl_line(step: int, metrics: dict) -> str:
    """The printed line of an RL step."""
    return (
        f"step {step:>4} | reward {metrics['rollout/reward']:.3f} | success {metrics['rollout/success']:.2f}"
        + _by_env(metrics, "rollout", "success") + " | "
        f"turns {metrics['rollout/turns']:.1f}/{metrics['rollout/horizon']} | "
        f"invalid actions {metrics['rollout/invalid_action_rate']:.0%} | "
        + (f"tokens/s {metrics['perf/tokens_per_s']:.0f} | " if "perf/tokens_per_s" in metrics else "")
        + (f"kl {metrics['losses/kl']:.4f} | entropy {metrics['losses/entropy']:.3f} | "
           f"grad {metrics['losses/grad_norm']:.3f} | " if "losses/kl" in metrics
           else "update skipped: NaN/inf | " if metrics["losses/nonfinite_updates"] else "critic warm-up | ")
        + (f"value loss {metrics['losses/value']:.4f} | " if "losses/value" in metrics else "")
        + (f"test success {metrics['eval/success']:.3f}{_by_env(metrics, 'eval', 'success')} | "
           if "eval/success" in metrics else "")
        + (f"prefix hits {metrics['perf/prefix_hit_rate']:.2f} | " if "perf/prefix_hit_rate" in metrics else "")
        + f"env wait {metrics['perf/env_wait_share']:.0%} | "
        + (f"logp diff {metrics['rollout/logprob_diff']:.0e} | " if "rollout/logprob_diff" in metrics else "")
        + (f"sync {metrics['sync/seconds']:.2f}s, probe {metrics['sync/probe_diff']:.0e} | "
           if "sync/probe_diff" in metrics else f"sync {metrics['sync/seconds']:.2f}s | " if "sync/seconds" in metrics else "")
        + f"{metrics['perf/step_s']:.1f}s"
    )


def offline_line(step: int, metrics: dict) -> str:
    """The printed line of an sft or dpo step."""
    kind = "dpo" if "dpo/loss" in metrics else "sft"
    return (f"step {step:>4} | {kind} loss {metrics[f'{kind}/loss']:.4f} | "
            + (f"accuracy {metrics['dpo/accuracy']:.2f} | margin {metrics['dpo/margin']:.3f} | " if kind == "dpo" else "")
            + (f"val loss {metrics[f'{kind}/val_loss']:.4f} | " if f"{kind}/val_loss" in metrics else "")
            + (f"test success {metrics['eval/success']:.3f}{_by_env(metrics, 'eval', 'success')} | "
           if "eval/success" in metrics else "")
            + (f"grad {metrics['losses/grad_norm']:.3f} | " if "losses/grad_norm" in metrics else "update skipped: NaN/inf | ")
            + f"{metrics['perf/step_s']:.1f}s")


def evol_line(iteration: int, metrics: dict) -> str:
    """The printed line of an agentevol iteration."""
    return (f"iteration {iteration} | explored {metrics['evol/explored']}, kept {metrics['evol/buffer']} "
            f"(success {metrics['evol/explore_success']:.3f}) | {metrics['evol/conversations']} conversations, "
            f"{metrics['sft/steps']} steps, loss {metrics['sft/loss']:.4f}"
            + (f", val loss {metrics['sft/val_loss']:.4f}" if "sft/val_loss" in metrics else "")
            + f" | test success {metrics['eval/success']:.3f}, avg@1 {metrics['eval/avg@k']:.3f} | "
            f"{metrics['perf/step_s']:.0f}s")


def eval_line(step: int, metrics: dict) -> str:
    """The printed line of an evaluation outside a training step."""
    return (f"eval {step:>4} | test success {metrics['eval/success']:.3f}{_by_env(metrics, 'eval', 'success')} | "
            f"avg@k {metrics['eval/avg@k']:.3f} | "
            f"pass@k {metrics['eval/pass@k']:.3f} | turns {metrics['eval/turns']:.1f}/{metrics['eval/horizon']} | "
            f"invalid actions {metrics['eval/invalid_action_rate']:.0%} | "
            + endings({name: metrics[f"eval/finish/{name}"] for name in FINISHES.values()}, metrics["eval/max_tokens"]))
