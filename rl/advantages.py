"""Rewards -> advantages, for multi-turn trajectories.

    adv, returns = advantages("gigpo", AdvantageInputs(scores=..., groups=..., ok=..., mask=..., anchors=..., turn=...),
                              step_weight=0.5)   # train.py's --algo names it, its flags (EstimatorArgs) set the rest

Shapes: trajectory-level estimators (GRPO, RLOO) take one score per trajectory, [B]; token-level
estimators (REINFORCE++, GAE) take padded [B, T] tensors and a loss mask that is 1 on action tokens
(the assistant's tokens and their end-of-turn token) and 0 on everything else (prompt, env
observations, chat scaffolding, padding).

The multi-turn rules, which upstream gets wrong (its reward sits on the final observation's last
token, which the mask then zeroes; its GAE bootstraps from values of observation tokens):
- the outcome reward goes on the trajectory's last action token (`place_reward`);
- token-level estimators run over the action-token subsequence: observation tokens are transparent,
  they neither discount nor receive anything, and the value that an action token bootstraps from is
  the value of the next action token, in this turn or the next one.

PPO's GAE runs over tokens (`gae_unit` "token") or over turns ("turn": `turn_gae`, each assistant turn one
timestep, its value the critic's at the turn's first action token). Turn-level credit needs a baseline that the
turn's own action cannot move: a per-turn-index baseline (MT-GRPO's, verl RFC #7244) sums one term per turn the
episode went on for, which the policy chose, and is biased wherever the policy controls when an episode ends
(tests/test_advantages.py enumerates such an MDP); the critic's value of the state before the turn is not.

GiGPO (`gigpo`, arXiv 2505.10978) adds turn-level credit to GRPO: where several episodes of a task pass
through the same env state (the same `anchor`: envs.Env.state_key), the turns taken from that state are compared
with each other by their discounted returns (`step_advantages`); a turn's tokens get the episode's GRPO advantage
plus omega times its turn's.

Adding an estimator: a function of AdvantageInputs and its hyperparameters -> (advantages [B, T], returns or None)
and its entry in ESTIMATORS, which says what it needs (grouped, a critic, anchor states) and declares the flags it
reads, each with its default and meaning (Flag). --algo's choices, train.py's flags (EstimatorArgs, made from the
entries), their check, the critic and the memory plan read the entry. One that compares the samples of a task (like
GRPO, RLOO) is a function (returns [E], groups [E]) -> advantages [E] passed to AdvantageInputs.per_episode
(docs/algorithms.md: "Add an advantage estimator"; tests/test_advantages.py follows the recipe for a grouped one with
a flag of its own, a token-level and a critic-based one).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Sequence

import torch
import tyro

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over processes (identity on one process)


def place_reward(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome scores [B] -> token rewards [B, T], each score on its row's last action token.
    A row without action tokens (an episode that failed before its first turn) gets nothing."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_action = mask.bool().any(1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), positions, -1).max(1).values  # index of the last mask-1 token
    rows = has_action.nonzero().squeeze(1)
    rewards[rows, last[rows]] = scores[rows].float()
    return rewards


def grpo(scores: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO: (s - mean of its group) / (std of its group + eps), std unbiased (n - 1), as upstream.
    scores, groups: [B]. scale=False skips the division (Dr. GRPO)."""
    return _within_groups(scores, groups, lambda s: (s - s.mean()) / (s.std() + eps) if scale else s - s.mean())


def rloo(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO: s minus the mean of the other members of its group, i.e. (s - mean) * n / (n - 1)."""
    return _within_groups(scores, groups, lambda s: s - (s.sum() - s) / (len(s) - 1))


def _within_groups(scores, groups, advantage) -> torch.Tensor:
    """advantage(scores of one group) for every group of two or more whose scores differ. A group of one has nothing
    to compare with and gets advantage 0 (upstream gives it its raw score, as if the baseline were 0); a group whose
    scores tie gets 0 exactly (a float mean of equal scores need not be their value: 16 scores of 0.1 gave GRPO
    advantages of -0.0074, that rounding over a std of 1e-8)."""
    advantages = torch.zeros_like(scores, dtype=torch.float32)
    for g in groups.unique():
        members = groups == g
        own = scores[members].float()
        if len(own) >= 2 and bool((own != own[0]).any()):
            advantages[members] = advantage(own)
    return advantages


def step_advantages(outcomes: list[float], groups: list[int], ok: list[bool], anchors: list[list], gamma: float,
                    scale: bool = True, eps: float = 1e-6,
                    penalties: list[list[float]] | None = None) -> list[list[float]]:
    """GiGPO's step-level advantage of every turn, [episode][turn] (the paper's A^S, its eq. 7-8).

    anchors[k][t]: the env's state key before turn t of episode k (None: unknown). The anchor group of a turn is
    every turn, of any episode of the same task group, taken from the same state (at whatever turn). A turn's return
    is the discounted sum of its episode's later rewards; the only reward is the outcome, on the last turn (an env's
    per-step reward is the running score, not an increment: the outcome is its last), less each turn's own KL penalty
    under --kl-in-reward (penalties[k][t]; one paid before turn t is history, not in its return), so
    R_t = gamma^(T - 1 - t) * outcome - sum over t' >= t of gamma^(t' - t) * penalty_t'. Within an anchor group:
    (R - mean) / (std + eps) (std unbiased, as GRPO's), or R - mean without `scale` (the paper's mean_norm mode).
    A turn alone in its anchor group, without a state key or of an episode whose env failed (not ok) gets 0, and so
    does a turn whose anchor group's returns all tie (exactly, as _within_groups)."""
    returns, members = {}, collections.defaultdict(list)
    for k, states in enumerate(anchors):
        if not ok[k]:
            continue
        paid = penalties[k] if penalties is not None else [0.0] * len(states)
        for t, state in enumerate(states):
            returns[k, t] = (gamma ** (len(states) - 1 - t) * outcomes[k]
                             - sum(gamma ** (u - t) * paid[u] for u in range(t, len(states))))
            if state is not None:
                members[groups[k], state].append((k, t))
    out = [[0.0] * len(states) for states in anchors]
    for turns in members.values():
        r = torch.tensor([returns[turn] for turn in turns], dtype=torch.float64)
        if len(turns) < 2 or bool((r == r[0]).all()):
            continue
        centred = r - r.mean()
        for (k, t), a in zip(turns, (centred / (r.std() + eps) if scale else centred).tolist()):
            out[k][t] = a
    return out


def strata(row_envs: list[str], names: Sequence[str]) -> torch.Tensor | None:
    """[B, S] one-hot: each row's env among the run's `names` (S of them), masked_whiten's strata; None for one env
    (the whole batch is one)."""
    if len(names) < 2:
        return None
    return torch.nn.functional.one_hot(torch.tensor([names.index(env) for env in row_envs], dtype=torch.long),
                                       len(names))


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast trajectory advantages [B] onto their action tokens: [B, T]."""
    return advantages[:, None] * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None, eps: float = 1e-8,
                  strata: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the action tokens (unbiased var, as upstream); 0 elsewhere.
    `reduce` sums the statistics over processes, so that a distributed batch is whitened as one. `strata` [B, S]
    (one-hot: each row's stratum, the run's env with several) whitens each stratum's rows by their own statistics
    (AgentRL's task normalisation), all of them reduced in one call."""
    mask = mask.float()
    wide, wide_mask = x.double(), mask.double()
    if strata is None:  # (one stratum: the whole batch)
        stats = torch.stack([(wide * wide_mask).sum(), (wide * wide * wide_mask).sum(), wide_mask.sum()])
    else:
        strata = strata.double()
        stats = torch.stack([strata.T @ (wide * wide_mask).sum(1), strata.T @ (wide * wide * wide_mask).sum(1),
                             strata.T @ wide_mask.sum(1)])  # [3, S]
    if reduce is not None:
        stats = reduce(stats)
    out = torch.zeros_like(x)
    for s, (total, squares, count) in enumerate([stats.tolist()] if strata is None else stats.T.tolist()):
        rows = slice(None) if strata is None else strata[:, s] > 0
        if count >= 1:
            mean = total / count
            var = max(squares - count * mean * mean, 0.0) / max(count - 1, 1)
            out[rows] = (x[rows] - mean) / (var + eps) ** 0.5 * mask[rows]
    return out


def reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, whiten: bool = True,
                 reduce: Reduce | None = None, strata: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++: the discounted return at every action token, counted over action tokens only,
    then whitened over the batch's action tokens (each stratum's apart: masked_whiten). rewards, mask: [B, T] ->
    advantages [B, T]."""
    mask = mask.float()
    returns = torch.zeros_like(rewards, dtype=torch.float32)
    future = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        acting = mask[:, t] > 0
        future = torch.where(acting, rewards[:, t] + gamma * future, future)  # observations: passed through
        returns[:, t] = future * mask[:, t]
    return masked_whiten(returns, mask, reduce, strata=strata) if whiten else returns


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
        whiten: bool = True, reduce: Reduce | None = None, strata: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action-token subsequence.

    For action tokens a_1 .. a_K of a trajectory (K over all turns): delta_k = r_k + gamma V(a_{k+1}) - V(a_k),
    with V(a_{K+1}) = 0, and A_k = delta_k + gamma lam A_{k+1}. values[t] is the critic's value of the
    state before token t. Returns (advantages, returns = A + V before whitening), both 0 off the mask.
    """
    mask = mask.float()
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    next_value = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        acting = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(acting, values[:, t].float(), next_value)  # observations: passed through
        next_advantage = torch.where(acting, advantage, next_advantage)
        advantages[:, t] = advantage * mask[:, t]
    returns = (advantages + values) * mask
    return (masked_whiten(advantages, mask, reduce, strata=strata) if whiten else advantages), returns


def turn_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn: torch.Tensor, gamma: float = 1.0,
             lam: float = 1.0, whiten: bool = True, reduce: Reduce | None = None, strata: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns: each assistant turn of an episode (a row) is one timestep. `gae` itself runs on [B, K]
    turn tensors and its result is spread back onto the turns' action tokens.

    Turn k's reward r_k is the sum of its tokens' rewards (the outcome on the last turn; the KL penalty summed over
    the turn), its value V_k the critic's at its first action token: values[t] is the value of the state before
    token t (rl/logprobs.token_values), so that is V(s_k), the history the turn acts from. A later token's value
    has read part of the turn's own action, and as a baseline would make the turn's advantage depend on that action
    (with an exact critic it is Q(s_k, a_k), and the expected gradient 0). delta_k = r_k + gamma V_{k+1} - V_k
    (V after the last turn = 0), A_k = delta_k + gamma lam A_{k+1}: gamma discounts per turn, not per token. Every
    action token of turn k gets A_k, and its return is A_k + V_k, so the critic learns the turn's return at all of
    its tokens (only the first's is read). rewards, values, mask, turn ([B, T]; turn: the episode's turn of each
    action token, -1 elsewhere) -> (advantages, returns), 0 off the mask; whitened over the action tokens as `gae`.
    """
    acting = mask > 0
    if (acting & (turn < 0)).any():
        raise ValueError("turn-level GAE needs the turn of every action token (rl/batch.py's turns)")
    width = int(turn[acting].max()) + 1 if acting.any() else 0
    index = torch.where(acting, turn, width)  # (tokens of no turn: an extra column, which no turn is in)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(index)
    first = torch.full((mask.shape[0], width + 1), mask.shape[1], device=mask.device).scatter_reduce(
        1, index, torch.where(acting, positions, mask.shape[1]), "amin")  # each turn's first action token (T: none)
    present = first < mask.shape[1]
    turn_rewards = torch.zeros(first.shape, dtype=torch.float32, device=mask.device).scatter_add_(
        1, index, (rewards * mask).float())
    turn_values = values.float().gather(1, first.clamp(max=mask.shape[1] - 1)) * present
    turn_advantages, turn_returns = gae(turn_rewards, turn_values, present, gamma, lam, whiten=False)
    advantages, returns = turn_advantages.gather(1, index) * mask, turn_returns.gather(1, index) * mask
    return (masked_whiten(advantages, mask, reduce, strata=strata) if whiten else advantages), returns


# ----------------------------------------------------------------------------------------------
# The estimators by their --algo names: each takes the step's AdvantageInputs and the flags its entry declares


@dataclass(kw_only=True)
class AdvantageInputs:
    """What an estimator may use, for the step's B rows of T tokens, each given by name. A row is a trajectory, or
    under --reasoning drop one turn of an episode (`episodes`: the episode each row is of; each of its rows has the
    episode's score, group and ok). Hyperparameters are not here: they are the estimators' flags (Estimator.flags)."""

    scores: torch.Tensor  # [B] outcome rewards
    groups: torch.Tensor  # [B] which task's group
    ok: torch.Tensor  # [B] False where the env failed (no outcome: its mask is 0, and it stays out of the statistics)
    mask: torch.Tensor  # [B, T] 1 on action tokens
    penalty: torch.Tensor | None = None  # [B, T] the KL penalty taken from the reward (--kl-in-reward); None: 0
    episodes: torch.Tensor | None = None  # [B]; None: a row each
    values: torch.Tensor | None = None  # [B, T] the critic's (ppo)
    anchors: list[list] | None = None  # per episode: the env's state key before each of its turns (gigpo)
    turn: torch.Tensor | None = None  # [B, T] the episode's turn of each action token, -1 elsewhere (gigpo, turn_gae)
    reduce: Reduce | None = None  # sums over processes, so that whitening is over the whole batch
    strata: torch.Tensor | None = None  # [B, S] one-hot, each row's env where a run has several (--whiten-per-env)

    def __post_init__(self):
        self.penalty = torch.zeros_like(self.mask) if self.penalty is None else self.penalty
        self.episodes = torch.arange(len(self.scores)) if self.episodes is None else self.episodes

    def first_rows(self) -> torch.Tensor:
        """[E]: each episode's first row (its score, group and ok)."""
        episodes = self.episodes
        return torch.full((int(episodes.max()) + 1 if len(episodes) else 0,), len(episodes)).scatter_reduce(
            0, episodes, torch.arange(len(episodes)), "amin")

    def per_episode(self, within: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[B, T]: `within` (the returns [E] and groups [E] of the episodes whose env did not fail -> their
        advantages [E]) on every action token of each episode's rows. An episode's return is its outcome minus its
        KL penalty summed over all its rows."""
        episodes, first = self.episodes, self.first_rows()
        totals = self.scores[first] - torch.zeros(len(first)).index_add(0, episodes, self.penalty.sum(1).float())
        advantages = torch.zeros(len(first))
        ok = self.ok[first]
        if ok.any():
            advantages[ok] = within(totals[ok], self.groups[first][ok])
        return per_token(advantages[episodes], self.mask)

    def rewards(self) -> torch.Tensor:
        """[B, T]: each outcome on its row's last action token, less the KL penalty."""
        return place_reward(self.scores, self.mask) - self.penalty


Advantages = tuple[torch.Tensor, torch.Tensor | None]  # per-token advantages [B, T], and the critic's returns or None


@dataclass(frozen=True)
class Flag:
    """A hyperparameter that an estimator reads: train.py's flag of its name (step_weight: --step-weight), with the
    estimator's default and what it means to it. Estimators may share a flag (--gamma), each with its own default and
    meaning; --help says them all (EstimatorArgs)."""

    default: Any
    help: str
    type: Any = None  # the flag's type where it is not its default's (a Literal's choices)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what train.py must give it."""

    fn: Callable[..., Advantages]  # (AdvantageInputs, a keyword argument for each of `flags`) -> advantages
    grouped: bool = False  # compares the samples of a task: needs --n 2 or more; an episode may be several rows
    critic: bool = False  # needs a critic's values (train.py builds and trains one)
    anchors: bool = False  # needs the episodes' anchor states and tokens' turns (rl/batch.py's Batch)
    flags: dict[str, Flag] = field(default_factory=dict)  # the flags it reads, by name; any other is refused with it


def grpo_advantages(x: AdvantageInputs, grpo_scale: bool) -> Advantages:
    """GRPO's (--no-grpo-scale: Dr. GRPO's) episode advantage on its action tokens."""
    return x.per_episode(functools.partial(grpo, scale=grpo_scale)), None


def rloo_advantages(x: AdvantageInputs) -> Advantages:
    """RLOO's episode advantage on its action tokens."""
    return x.per_episode(rloo), None


def gigpo_advantages(x: AdvantageInputs, grpo_scale: bool, gamma: float, step_weight: float) -> Advantages:
    """GiGPO: GRPO's episode advantage plus step_weight (omega) x step_advantages discounted by gamma, by the
    episodes' `anchors` and each action token's `turn`; grpo_scale off is the paper's mean_norm mode, at both
    levels."""
    if x.anchors is None or x.turn is None:
        raise ValueError("gigpo needs the episodes' anchor states and each action token's turn (rl/batch.py's Batch)")
    if not any(key is not None for keys in x.anchors for key in keys):
        warnings.warn("--algo gigpo: the env gave no state keys (envs.Env.state_key; an upstream env server sends "
                      "none), so no turn has an anchor group and GiGPO trains as GRPO")
    episodes, turn, penalty, first = x.episodes, x.turn, x.penalty, x.first_rows()
    # each turn's own KL penalty [episode, turn] (its return holds the later turns' only)
    width = max(map(len, x.anchors), default=0)
    on = (turn >= 0) & (turn < width)
    paid = torch.zeros(len(first), width, dtype=torch.float64).index_put_(
        (episodes[:, None].expand_as(turn)[on], turn[on]), penalty[on].double(), accumulate=True)
    steps = step_advantages(x.scores[first].tolist(), x.groups[first].tolist(), x.ok[first].tolist(), x.anchors,
                            gamma, grpo_scale, penalties=paid.tolist())
    table = torch.zeros(len(steps), max(map(len, steps), default=0) + 1)  # (a last column of 0: tokens of no turn)
    for k, row in enumerate(steps):
        table[k, :len(row)] = torch.tensor(row)
    on_turn = table[episodes[:, None], torch.where((turn >= 0) & (turn < table.shape[1]), turn, table.shape[1] - 1)]
    return x.per_episode(functools.partial(grpo, scale=grpo_scale)) + step_weight * on_turn * x.mask, None


def reinforce_pp_advantages(x: AdvantageInputs, gamma: float, whiten_per_env: bool) -> Advantages:
    """REINFORCE++'s whitened discounted returns."""
    return reinforce_pp(x.rewards(), x.mask, gamma, reduce=x.reduce, strata=x.strata if whiten_per_env else None), None


def gae_advantages(x: AdvantageInputs, gamma: float, lam: float, gae_unit: Literal["token", "turn"],
                   whiten_per_env: bool) -> Advantages:
    """PPO's: GAE on the critic's values, over action tokens or (gae_unit "turn") over turns, and the returns the
    critic learns."""
    strata = x.strata if whiten_per_env else None
    if gae_unit == "token":
        return gae(x.rewards(), x.values, x.mask, gamma, lam, reduce=x.reduce, strata=strata)
    if x.turn is None:
        raise ValueError("turn-level GAE needs each action token's turn (rl/batch.py's Batch)")
    return turn_gae(x.rewards(), x.values, x.mask, x.turn, gamma, lam, reduce=x.reduce, strata=strata)


GRPO_SCALE = Flag(True, "divide by the group's std; --no-grpo-scale is Dr. GRPO")
WHITEN_PER_ENV = Flag(True, "with several envs whiten within each env (AgentRL's task normalisation), off: over the "
                            "batch")

# --algo's estimators. A new one is a function and its entry here, its flags too (tests/test_advantages.py).
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo_advantages, grouped=True, flags={"grpo_scale": GRPO_SCALE}),
    "rloo": Estimator(rloo_advantages, grouped=True),
    "gigpo": Estimator(gigpo_advantages, grouped=True, anchors=True, flags={
        "grpo_scale": Flag(True, "at both levels, --no-grpo-scale centres only (the paper's mean_norm)"),
        "gamma": Flag(0.95, "the paper's discount per turn of a turn's return"),
        "step_weight": Flag(1.0, "omega, the weight of the turn-level advantage added to the episode's (the "
                                 "paper's)")}),
    "reinforce_pp": Estimator(reinforce_pp_advantages, flags={
        "gamma": Flag(1.0, "upstream's discount per action token"), "whiten_per_env": WHITEN_PER_ENV}),
    "ppo": Estimator(gae_advantages, critic=True, flags={
        "gamma": Flag(1.0, "upstream's discount per action token, or per turn under --gae-unit turn"),
        "lam": Flag(1.0, "GAE's lambda"),
        "gae_unit": Flag("token", "GAE's timestep, an action token or an assistant turn (the critic's value before the "
                                  "turn: rl/advantages.turn_gae)", Literal["token", "turn"]),
        "whiten_per_env": WHITEN_PER_ENV}),
}


def flag_group(estimators: dict[str, Estimator]) -> type:
    """The estimators' flags as a flag group (rl/flags.py) for train.py: a field for each name their entries declare,
    its default theirs where they agree, else None (each estimator's own: `advantages`), and its --help what it is to
    each of them."""
    declared: dict[str, dict[str, Flag]] = collections.defaultdict(dict)  # flag -> {algo: its Flag}
    for algo, estimator in estimators.items():
        for name, flag in estimator.flags.items():
            declared[name][algo] = flag
    specs = []
    for name, own in declared.items():
        first = next(iter(own.values()))
        agree = all(flag.default == first.default for flag in own.values())
        meanings = collections.defaultdict(list)  # (one meaning, said once for the estimators that share it)
        for algo, flag in own.items():
            meanings[flag.help if agree else f"{flag.help} (default {flag.default})"].append(algo)
        kind = first.type or type(first.default)
        specs.append((name, Annotated[kind if agree else kind | None, tyro.conf.arg(help="; ".join(
            f"{', '.join(algos)}: {meaning}" for meaning, algos in meanings.items()))],
            field(default=first.default if agree else None)))
    return dataclasses.make_dataclass("EstimatorArgs", specs, namespace={"__module__": __name__})


# train.py's flags of the estimators: --grpo-scale, --gamma, --step-weight, ... (flat names: config.json as before)
EstimatorArgs = flag_group(ESTIMATORS)


def is_grouped(algo: str) -> bool:
    """Whether --algo compares the samples of a task (it needs --n 2 or more, and gives every row of an episode the
    episode's advantage)."""
    return algo in ESTIMATORS and ESTIMATORS[algo].grouped


def needs_critic(algo: str) -> bool:
    """Whether --algo trains a critic."""
    return algo in ESTIMATORS and ESTIMATORS[algo].critic


def names(has: Callable[[Estimator], bool], conjunction: str = "and") -> str:
    """The names of the estimators that `has` holds for, as a phrase: "a, b and c"."""
    chosen = [name for name, estimator in ESTIMATORS.items() if has(estimator)]
    return f" {conjunction} ".join([", ".join(chosen[:-1]), chosen[-1]] if len(chosen) > 1 else chosen)


def advantages(algo: str, inputs: AdvantageInputs, **flags) -> Advantages:
    """The step's per-token advantages [B, T] by the estimator `algo` (ESTIMATORS), and the returns for a critic (None
    without one). `flags`: estimators' flags by name (train.py gives all of EstimatorArgs); the estimator takes those
    its entry declares, each at its own default where not given or None."""
    if algo not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {algo!r}; choose one of: {', '.join(ESTIMATORS)}")
    unknown = set(flags) - {name for estimator in ESTIMATORS.values() for name in estimator.flags}
    if unknown:
        raise ValueError(f"no advantage estimator reads {', '.join(sorted(unknown))}")
    estimator = ESTIMATORS[algo]
    if not estimator.grouped and len(inputs.episodes.unique()) < len(inputs.episodes):
        raise ValueError(f"{algo} runs over an episode's action tokens in one row; --reasoning drop trains a row per turn")
    return estimator.fn(inputs, **{name: flag.default if flags.get(name) is None else flags[name]
                                   for name, flag in estimator.flags.items()})
