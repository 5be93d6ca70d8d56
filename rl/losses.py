"""Loss terms, per token, and how they are aggregated.

Every term function takes [B, T] tensors and returns [B, T] terms; `aggregate` masks them to the
action tokens and reduces them to a scalar. Signs: everything here is to be minimised.

The policy loss of a token is its clipped surrogate times one importance weight (`importance_weights`), for
whatever separates the policy that sampled it from pi_old, the trainer's before the update: ratio =
exp(trainer_old - engine), the trainer's log-prob over the engine's. A stale token (--max-staleness, lag >= 1):
decoupled PPO's pi_prox / pi_behav truncated at --is-cap, which holds the engine's own gap too. A lag-0 token (every
token of the synchronous loop), by --mismatch: none 1; tis min(ratio, --mismatch-cap) (token TIS); mis its
sequence's ratio, the product of its tokens', and 0 above the cap (sequence MIS); icepop the ratio inside
--mismatch-band, 0 outside it (IcePop); geo-rs 1, or 0 for a sequence whose geometric-mean ratio is outside the band
(verl's geometric rejection sampling). Upstream (AgentGym-RL's verl fork) has none of it.

`policy_objective` composes one micro-batch's policy loss from these terms, by an `Objective` (train.py's flag group
of the loss): --policy-loss's surrogate (ppo: the clipped ratio a token; gspo: a sequence's, on each token's own
log-prob, GSPO-token of Zheng et al., 2025; cispo: the clipped, detached ratio on the log-prob, MiniMax-M1), its
clips, the importance weights, the aggregation over the mini-batch's counts, the entropy bonus and the KL to the
reference. A loss variant is a function here, a value of `PolicyLoss` and its branch in `policy_objective`
(tests/test_losses.py checks each against its paper's formula on hand-computed tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
Mismatch = Literal["none", "tis", "mis", "icepop", "geo-rs"]
MISMATCH_CAP = 2.0  # --mismatch-cap's default: the C of TIS (Yao et al., 2025) and of sequence MIS (Liu, Li et al.)
ICEPOP_BAND = (0.5, 5.0)  # --mismatch-band's default under icepop: Ring-1T's [alpha, beta] (Ling Team, 2025)
GEO_BAND = (0.999, 1.001)  # its default under geo-rs: verl's geometric rejection preset (typical 1.0002 to 1.001)


def policy_loss(logprobs, old_logprobs, advantages, clip_low: float = 0.2, clip_high: float | None = None,
                dual_clip: float | None = None, mask=None, sequences=None):
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = exp(logp - old logp).

    clip_high > clip_low is DAPO's clip-higher (more room for raising unlikely tokens); default
    clip_high = clip_low. dual_clip = c > 1 bounds the loss of a negative advantage at -A c, however
    large the ratio (Ye et al., 2020). `sequences` [B, T] (with the action `mask`), when given, makes the ratio a
    sequence's (GSPO-token, Zheng et al., 2025, eqs. 13-14): r = sg(s) pi(y_t) / sg(pi(y_t)), s = exp of the mean
    log-ratio over the sequence's action tokens. Its value, and so its clip, is the sequence's s on every token; its
    gradient is s grad log pi(y_t), each token's own, so that each token's advantage reaches its own log-prob (GSPO's
    sequence form, the gradient through s, gives every token the sequence's mean advantage: 0 for turns of +1, -1).
    With one advantage a sequence the two have one gradient. Returns (loss terms, 1.0 where a clip was active).
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = logprobs - old_logprobs
    if sequences is not None:
        log_ratio = sequence_mean(log_ratio, mask, sequences).detach() + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        active = active | dual
    return loss, active.float()


def cispo_loss(logprobs, old_logprobs, advantages, clip_low: float = 0.2, clip_high: float | None = None):
    """CISPO's (MiniMax-M1, 2025): -A sg(clip(r, 1 - clip_low, 1 + clip_high)) log pi, r = exp(logp - old logp).
    The ratio is clipped and detached, a weight on the REINFORCE term, so a token outside the band still has its
    gradient (-A clip(r) grad log pi), where PPO's clip drops it. At r = 1 the gradient is PPO's. Returns (loss
    terms, 1.0 where the weight was clipped)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-20, 20))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -advantages * weight * logprobs, (weight != ratio).float()


def sequence_geomean(weights, mask, sequences):
    """[B, T] -> [B, T]: the geometric mean of each sequence's weights over its action tokens, on each of them (0 when
    any is 0: a masked token masks its sequence); 1 off the action tokens."""
    zero = sequence_mean((weights <= 0).float(), mask, sequences) > 0
    mean = torch.exp(sequence_mean(torch.log(weights.clamp(min=1e-30)), mask, sequences))
    return torch.where(mask > 0, torch.where(zero, torch.zeros_like(mean), mean), torch.ones_like(mean))


def sequence_mean(x, mask, sequences):
    """[B, T] -> [B, T]: the mean of x over the action tokens (mask > 0) of each token's sequence (`sequences`: its
    id), on every token of it; 0 on the tokens of no action."""
    ids, which = torch.where(mask > 0, sequences, -1).flatten().unique(return_inverse=True)
    sums = x.new_zeros(len(ids)).index_add(0, which, (x * mask).flatten())
    counts = mask.new_zeros(len(ids), dtype=x.dtype).index_add(0, which, (mask > 0).flatten().to(x.dtype))
    return (sums / counts.clamp(min=1))[which].view_as(x) * (mask > 0)


class Weights(NamedTuple):
    """importance_weights' answer: the weights and which tokens each bound touched, [B, T] each."""

    weights: torch.Tensor
    stale_truncated: torch.Tensor  # lag >= 1, above --is-cap
    truncated: torch.Tensor  # lag 0, above --mismatch-cap (tis)
    masked: torch.Tensor  # lag 0, in a sequence whose ratio, the product of its tokens', is above the cap (mis)
    masked_tokens: torch.Tensor  # lag 0, outside icepop's band themselves (icepop)
    rejected: torch.Tensor  # lag 0, in a sequence whose geometric-mean ratio is outside geo-rs's band (geo-rs)


def importance_weights(trainer, engine, mask, lag=None, sequences=None, mismatch: Mismatch = "none",
                       cap: float = MISMATCH_CAP, band: tuple[float, float] | None = None,
                       is_cap: float = 2.0) -> Weights:
    """The one importance weight of every action token, for the gap between the policy that sampled it (the
    engine's `engine` log-probs) and the one whose clipped ratio the loss takes (the trainer's `trainer` log-probs
    before the update, pi_old). ratio = exp(trainer - engine) = pi_old / pi_engine. [B, T] each; `lag` [B, T]: the
    updates between the weights that sampled the token and pi_old's (None: all 0, the synchronous loop);
    `sequences` [B, T]: the sequence each token is in (rl/batch.py's `sequence`; None: a row is one).

    - lag >= 1 (--max-staleness): decoupled PPO (Hilton et al., 2022; AReaL, Fu et al., 2025): pi_old is the
      proximal policy and the weight pi_prox / pi_behav, truncated at `is_cap` (TIS's truncation, Yao et al., 2025),
      whatever `mismatch` says: the engine's log-prob is the behaviour policy's, so this ratio already holds the
      engine-trainer gap of the stale token beside its staleness, and correcting that again would count it twice.
    - lag 0 (every token of the synchronous loop): the same weights sampled and are scored, and what is left is the
      engine-trainer mismatch (a bf16 engine, other kernels), weighed by `mismatch`:
      none, 1 (the loss is the on-policy one);
      tis, min(ratio, cap) a token (token-level truncated importance sampling);
      mis, a sequence's own importance weight, the product of its lag-0 tokens' ratios, on each of them, and 0 when
      it is above `cap` (sequence-level masked importance sampling, Liu, Li et al., 2025, "When Speed Kills
      Stability"; verl's rollout correction: sequence IS with sequence rejection above the threshold);
      icepop, a token's ratio inside `band` (default [0.5, 5]) and 0 outside it (IcePop, Ring-1T, Ling Team, 2025:
      M(k) = k within [alpha, beta], else 0);
      geo-rs, 1, and 0 for the tokens of a sequence whose geometric-mean ratio, exp(mean log-ratio over its lag-0
      tokens), is outside `band` (default [0.999, 1.001]): verl's geometric rejection sampling, a rejection and no
      weight. The geometric mean is a per-token figure whatever the length, so its band is tight: per-token gaps
      average out of it (400 tokens, half of them 2.2x off and the rest exact, have a geometric mean of 1.48).
      `band` is the band of the mode in use; the other band-mode's metrics take its default.

    Returns the weights [B, T] (1 off the action tokens) and, as 1.0/0.0 [B, T]: stale tokens the is_cap truncated,
    and the lag-0 tokens that tis truncates, mis masks, icepop masks and geo-rs rejects, whatever `mismatch` is, so
    that a run logs what each correction does or would do."""
    action = mask > 0
    stale = action & (lag > 0) if lag is not None else torch.zeros_like(action)
    fresh = action & ~stale
    log_ratio = (trainer - engine).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    sequences = torch.arange(len(mask), device=mask.device)[:, None].expand_as(mask) if sequences is None else sequences
    ids, which = torch.where(fresh, sequences, -1).flatten().unique(return_inverse=True)  # (-1: not a lag-0 token)
    tokens = mask.new_zeros(len(ids), dtype=torch.float).index_add(0, which, fresh.flatten().float())
    sums = log_ratio.new_zeros(len(ids)).index_add(0, which, (log_ratio * fresh).flatten())
    sequence_log = sums[which].view_as(mask)  # the log of the product of each sequence's lag-0 ratios, on its tokens
    geomean = torch.exp(sums / tokens.clamp(min=1))[which].view_as(mask)
    icepop_low, icepop_high = band if band is not None and mismatch == "icepop" else ICEPOP_BAND
    geo_low, geo_high = band if band is not None and mismatch == "geo-rs" else GEO_BAND
    masked = (sequence_log > math.log(cap)) & fresh
    masked_tokens = ((ratio < icepop_low) | (ratio > icepop_high)) & fresh
    rejected = ((geomean < geo_low) | (geomean > geo_high)) & fresh
    zero = torch.zeros_like(ratio)
    fresh_weight = {"none": torch.ones_like(ratio), "tis": ratio.clamp(max=cap),
                    "mis": torch.where(masked, zero, torch.exp(sequence_log.clamp(max=math.log(cap)))),
                    "icepop": torch.where(masked_tokens, zero, ratio), "geo-rs": (~rejected).float()}[mismatch]
    weights = torch.where(stale, ratio.clamp(max=is_cap), torch.where(fresh, fresh_weight, torch.ones_like(ratio)))
    return Weights(weights, (stale & (ratio > is_cap)).float(), (fresh & (ratio > cap)).float(), masked.float(),
                   masked_tokens.float(), rejected.float())


def value_loss(values, old_values, returns, clip: float | None = 0.5):
    """Clipped value loss: 0.5 max((V - R)^2, (V_clipped - R)^2) with V_clipped = V_old + clip(V - V_old, +-clip).
    Returns (loss terms, 1.0 where the clipped branch was the larger)."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def kl(logprobs, ref_logprobs, estimator: KLEstimator = "k3"):
    """Per-token estimators of KL(policy || reference) from tokens sampled from the policy (Schulman,
    "Approximating KL divergence"): k1 = logp - ref (unbiased, any sign); k2 = (logp - ref)^2 / 2
    (upstream's `mse`); k3 = exp(d) - d - 1 with d = ref - logp (unbiased, non-negative, low variance;
    upstream's `low_var_kl`, clamped to [-10, 10] as there). d is clamped to [-20, 20] first: exp of a
    large d is inf, and its gradient (0 * inf) would be NaN even at a masked position."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (torch.exp(d) - d - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def aggregate(terms, mask, mode: Aggregation = "token-mean", tokens: float | None = None,
              sequences: float | None = None, segments=None, weights=None, norm_tokens: int = 0):
    """Reduce [B, T] terms over the action tokens to one scalar.

    token-mean: sum over all action tokens / their number (every token weighs the same);
    seq-mean-token-mean: the mean over sequences of each sequence's token mean (every trajectory
    weighs the same); seq-mean-token-sum: the mean over sequences of each sequence's token sum (no length
    normalisation); seq-mean-token-sum-norm: the same over a constant, `norm_tokens` (Dr. GRPO, Liu et al., 2025:
    each sequence's token sum over the generation budget, so that neither a sequence's length nor the batch's token
    count scales its tokens; seq-mean-token-sum is it times that constant, which the gradient clip and Adam's epsilon
    do not ignore). When a mini-batch is split into micro-batches, pass the whole
    mini-batch's `tokens` or `sequences` (those with an action token) so that the gradient is the
    same however it is split, and over processes (train.py passes the mini-batch's counts over all
    processes divided by their number, since data-parallel training averages their gradients: a
    fraction when there are fewer than processes). A count of 0 means nothing to average: the sum is 0.
    `segments` [B, T], when given, says which sequence each token belongs to (rows that pack several
    trajectories, rl/batch.py); otherwise a row is a sequence. `weights` [B, T], when given (an episode in several
    rows: --reasoning drop), are 1 / its sequence's action tokens, for seq-mean-token-mean to sum instead of dividing
    within the micro-batch, which may hold only some of the sequence's tokens.
    """
    mask = mask.float()
    if mode == "token-mean":
        count = mask.sum() if tokens is None else tokens
        return (terms * mask).sum() / (float(count) or 1.0)
    if segments is None:
        per_sequence, lengths = (terms * mask).sum(1), mask.sum(1)
    else:  # sums over each segment's action tokens (every token takes part, so that the graph always
        # reaches the terms: a micro-batch without action tokens still has a gradient, of zeros)
        ids, which = torch.where(mask > 0, segments, -1).flatten().unique(return_inverse=True)
        masked = (terms * mask).flatten()  # (in the wider of the two dtypes)
        per_sequence = masked.new_zeros(len(ids)).index_add(0, which, masked)
        lengths = mask.new_zeros(len(ids)).index_add(0, which, mask.flatten())
    if mode == "seq-mean-token-mean" and weights is not None:
        per_sequence = (terms * mask * weights).sum()  # (each sequence's part of its mean; summed over sequences)
    elif mode == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_sequence = per_sequence / float(norm_tokens or 1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    count = (lengths > 0).sum() if sequences is None else sequences
    return per_sequence.sum() / (float(count) or 1.0)


class Counts(NamedTuple):
    """What a mini-batch's losses are divided by (rl/batch.minibatch_counts): its action tokens and its sequences
    with any, over all processes, divided by their number."""

    tokens: float
    sequences: float


PolicyLoss = Literal["ppo", "gspo", "cispo"]


@dataclass(frozen=True)
class Objective:
    """The policy loss's settings: train.py's flags of these names (a flag group, rl/flags.py), with their checks. A
    loss variant is a field here and its branch in `policy_objective`."""

    policy_loss: PolicyLoss = "ppo"
    """ppo: the clipped ratio a token; gspo: one ratio a sequence, the geometric mean of its tokens', with each
    token's own gradient (GSPO-token, Zheng et al., 2025; take clips near 3e-4 and 4e-4, the paper's, as a sequence's
    ratio stays near 1); cispo: the ratio clipped
    and detached, times the log-prob, so that every token keeps its gradient (MiniMax-M1; its band is [1 - clip,
    1 + clip-high], the paper sets no lower bound: --clip 1) (docs/algorithms.md, "Policy losses")"""
    clip: float = 0.2
    """PPO ratio clip (the lower one when --clip-high is given)"""
    clip_high: float | None = None
    """upper ratio clip, e.g. 0.28 (DAPO's clip-higher); default: --clip"""
    dual_clip: float | None = None
    """bound the loss of negative advantages at -A * c (dual clip, c > 1, e.g. 3; ppo and gspo)"""
    loss_agg: Aggregation = "seq-mean-token-mean"
    """how per-token losses become one number: seq-mean-token-mean (every trajectory weighs the same, what upstream
    effectively optimises), token-mean (every token), seq-mean-token-sum (no length normalisation), and
    seq-mean-token-sum-norm (Dr. GRPO: each trajectory's token sum over a constant, --loss-norm-tokens)"""
    loss_norm_tokens: int = 0
    """seq-mean-token-sum-norm: the constant a trajectory's token sum is divided by; 0: --max-tokens (the largest of
    the envs')"""
    kl_coef: float = 0.001
    """weight of KL(policy || initial policy); 0 drops the reference model"""
    kl_estimator: KLEstimator = "k3"
    """k1 (log-ratio), k2 (squared, upstream's mse) or k3 (upstream's low_var_kl)"""
    kl_in_reward: bool = False
    """subtract the KL from the reward (per token) instead of adding it to the loss"""
    entropy_coef: float = 0.001
    """weight of the entropy bonus (subtracted from the loss)"""
    is_cap: float = 2.0
    """--max-staleness: truncate a stale token's importance weight pi_prox / pi_behav at this (TIS's 2)"""
    mismatch: Mismatch = "none"
    """the engine-trainer gap of the tokens sampled by the weights being updated (a bf16 engine, other kernels):
    none, weight 1; tis, each token min(pi_trainer / pi_engine, --mismatch-cap); mis, each sequence its own ratio
    (the product of its tokens'), 0 above --mismatch-cap; icepop, each token its ratio inside --mismatch-band, 0
    outside; geo-rs, a sequence whose geometric-mean ratio is outside --mismatch-band left out (verl's geometric
    rejection sampling) (docs/engines.md, "Engine-trainer mismatch")"""
    mismatch_cap: float | None = None
    """--mismatch tis and mis: C, the cap of a token's weight (tis) or of a sequence's (mis); default: 2"""
    mismatch_band: str | None = None
    """--mismatch icepop and geo-rs: LO:HI, the band a token's ratio (icepop) or a sequence's geometric-mean ratio
    (geo-rs) must be in; default: by the mode (icepop the paper's 0.5:5, geo-rs verl's 0.999:1.001)"""

    def check(self, rollouts: bool, staleness: bool) -> None:
        """The settings that cannot work, as one sentence: `rollouts` False for a program that learns from files,
        `staleness` whether --max-staleness is given."""
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise SystemExit("--dual-clip must be larger than 1")
        if self.dual_clip is not None and self.policy_loss == "cispo":
            raise SystemExit("--dual-clip bounds the clipped surrogate of ppo and gspo; cispo's weight is clipped itself")
        if not 0 < self.clip <= 1 or (self.clip_high is not None and self.clip_high <= 0):
            raise SystemExit("--clip takes a share in (0, 1], --clip-high one above 0")
        if self.loss_norm_tokens < 0 or self.loss_norm_tokens and self.loss_agg != "seq-mean-token-sum-norm":
            raise SystemExit("--loss-norm-tokens is the constant of --loss-agg seq-mean-token-sum-norm (Dr. GRPO), 1 "
                             "or more: give that aggregation with it")
        if self.is_cap != Objective.is_cap and not staleness:
            raise SystemExit("--is-cap truncates the importance weights of stale tokens, which only --max-staleness makes: "
                             "give --max-staleness too, or leave --is-cap out")
        if self.is_cap < 1:
            raise SystemExit(f"--is-cap {self.is_cap:g} would weigh every stale token below 1: give --is-cap 1 or more")
        if self.mismatch_cap is not None and self.mismatch not in ("tis", "mis"):
            raise SystemExit("--mismatch-cap bounds --mismatch tis's and mis's weights: give one of them with it "
                             "(icepop's and geo-rs's bounds are --mismatch-band)")
        if self.mismatch_cap is not None and self.mismatch_cap <= 1:
            raise SystemExit(f"--mismatch-cap {self.mismatch_cap:g} must be above 1: tis truncates the weights at C, "
                             "mis masks the sequences above it")
        if self.mismatch_band is not None and self.mismatch not in ("icepop", "geo-rs"):
            raise SystemExit("--mismatch-band is the band of --mismatch icepop and geo-rs: give one of them with it "
                             "(tis's and mis's bound is --mismatch-cap)")
        self.band()
        if not rollouts and (self.mismatch != "none" or self.policy_loss != "ppo"):
            raise SystemExit("--mismatch and --policy-loss weigh the tokens of RL's rollouts; sft, dpo and agentevol "
                             "learn from trajectory files")

    def norm_tokens(self, max_tokens: int) -> Objective:
        """This objective with seq-mean-token-sum-norm's constant: --loss-norm-tokens, else `max_tokens`."""
        return replace(self, loss_norm_tokens=self.loss_norm_tokens or max_tokens)

    def band(self) -> tuple[float, float] | None:
        """--mismatch-band LO:HI as (LO, HI), None when not given (the mode's default); a SystemExit for a band that
        is not one around 1."""
        if self.mismatch_band is None:
            return None
        try:
            low, high = (float(bound) for bound in self.mismatch_band.split(":"))
        except ValueError:
            raise SystemExit(f"--mismatch-band {self.mismatch_band}: give LO:HI, e.g. 0.5:5") from None
        if not 0 <= low < 1 < high:
            raise SystemExit(f"--mismatch-band {self.mismatch_band}: LO in [0, 1) and HI above 1, so that a ratio "
                             "of 1 is in it")
        return low, high


class PolicyTerms(NamedTuple):
    """policy_objective's per-token terms, [R, W] each, for the metrics (rl/metrics.policy_sums)."""

    logprobs: torch.Tensor
    old: torch.Tensor  # pi_old's log-probs
    policy: torch.Tensor  # the clipped surrogate times the importance weight
    clipped: torch.Tensor  # 1.0 where a clip was active
    entropy: torch.Tensor
    divergence: torch.Tensor  # KL to the reference (0 without one)
    weighed: Weights  # each token's own (under gspo the loss takes their geometric mean a sequence)


def policy_objective(logprobs, entropy, micro, counts: Counts,
                     objective: Objective) -> tuple[torch.Tensor, PolicyTerms]:
    """The policy's loss on one micro-batch (rl/batch.MicroBatch; logprobs, entropy [R, W] from the forward pass):
    --policy-loss's surrogate on pi_old's ratio (the micro-batch's old log-probs, or with one update per rollout the
    current ones, detached), times the importance weight of each token (`importance_weights`; under gspo one weight a
    sequence, the geometric mean of its tokens', as its ratio's value is), minus the entropy bonus, plus the KL to the
    reference (when the micro-batch has reference log-probs and the KL is not in the reward), each aggregated over the
    whole mini-batch (`counts`). Returns the loss and its terms."""
    mask = micro.loss_mask
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    rows = torch.arange(len(mask), device=mask.device)[:, None].expand_as(mask)
    sequences = micro.sequence if micro.sequence is not None else rows
    if objective.policy_loss == "cispo":
        pg, clipped = cispo_loss(logprobs, old, micro.advantages, objective.clip, objective.clip_high)
    else:
        pg, clipped = policy_loss(logprobs, old, micro.advantages, objective.clip, objective.clip_high,
                                  objective.dual_clip, mask, sequences if objective.policy_loss == "gspo" else None)
    # (one weight a token for the sampler's gap: --max-staleness's decoupled PPO around the proximal policy, --mismatch)
    weighed = importance_weights(old, micro.sampler_logprobs, mask, micro.lag, micro.sequence, objective.mismatch,
                                 objective.mismatch_cap or MISMATCH_CAP, objective.band(), objective.is_cap)
    weights = sequence_geomean(weighed.weights, mask, sequences) if objective.policy_loss == "gspo" else weighed.weights
    pg = pg * weights

    def mean(terms):  # over the whole mini-batch
        return aggregate(terms, mask, objective.loss_agg, counts.tokens, counts.sequences, micro.segments,
                         micro.weights, objective.loss_norm_tokens)

    loss = mean(pg) - objective.entropy_coef * mean(entropy)
    divergence = torch.zeros_like(logprobs)
    if micro.ref_logprobs is not None:
        divergence = kl(logprobs, micro.ref_logprobs, objective.kl_estimator)
        if not objective.kl_in_reward:
            loss = loss + objective.kl_coef * mean(divergence)
    return loss, PolicyTerms(logprobs, old, pg, clipped, entropy, divergence, weighed)
