"""Advantage estimators against numbers worked out by hand, on multi-turn masks: action tokens
(mask 1) in several turns, separated by observation tokens (mask 0) that must stay transparent; and
the recipe for adding one (docs/algorithms.md), followed."""

import dataclasses
import functools
import importlib
import inspect
import json
import math
import sys

import pytest
import torch

from rl import advantages as adv_lib
from rl.advantages import (ESTIMATORS, AdvantageInputs, Estimator, EstimatorArgs, Flag, _within_groups, advantages,
                           flag_group, gae, grpo, masked_whiten, place_reward, per_token, reinforce_pp, rloo, turn_gae)

# Two turns of one trajectory: [prompt, act, act, obs, obs, act(last), obs]
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 0]], dtype=torch.float32)


def test_grpo_hand_example():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # group 1: rewards 0.9, 0.3  -> mean 0.6, unbiased std sqrt(0.18) = 0.42426
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    a = grpo(scores, groups)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(0.18)
    expected = [0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6), -0.5 / (s0 + 1e-6), 0.5 / (s0 + 1e-6), 0.3 / (s1 + 1e-6), -0.3 / (s1 + 1e-6)]
    assert a.tolist() == pytest.approx(expected, rel=1e-6)
    assert a.tolist()[:2] == pytest.approx([0.866024, -0.866024], rel=1e-5)


def test_grpo_groups_are_independent_of_order_and_unscaled_variant():
    scores = torch.tensor([0.3, 1.0, 0.9, 0.0])
    groups = torch.tensor([1, 0, 1, 0])
    a = grpo(scores, groups, scale=False)  # Dr. GRPO: centred only
    assert a.tolist() == pytest.approx([-0.3, 0.5, 0.3, -0.5])


@pytest.mark.parametrize("estimator", [grpo, rloo])
def test_equal_rewards_and_lone_samples_give_zero(estimator):
    a = estimator(torch.tensor([1.0, 1.0, 1.0, 0.7]), torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(a).all()
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", [grpo, rloo])
def test_a_group_that_tied_gets_exactly_zero_however_its_mean_rounds(estimator):
    """16 scores of 0.1: their float32 mean is not 0.1, and GRPO divided that rounding (7e-9) by a std of 8e-9, an
    advantage of -0.0074 each for a group without signal (--dynamic-sampling replays a group whose advantages are 0)."""
    assert estimator(torch.full((16,), 0.1), torch.zeros(16, dtype=torch.long)).tolist() == [0.0] * 16


def test_rloo_hand_example():
    # group 0: 1 - (0 + 0 + 1)/3 = 2/3, 0 - 2/3 = -2/3; group 1: 0.9 - 0.3 = 0.6, 0.3 - 0.9 = -0.6
    a = rloo(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.3]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert a.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.6, -0.6])
    # the same as (s - mean) * n / (n - 1)
    assert a[:4].tolist() == pytest.approx([(s - 0.5) * 4 / 3 for s in (1, 0, 0, 1)])


def test_advantage_lands_on_action_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    out = per_token(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 2, 2, 0, 0, 2], [0, -1, -1, 0, 0, 0, 0]]


def test_reward_goes_on_the_last_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 0],   # two turns, then the final observation
                         [0, 1, 0, 0, 0, 0, 0, 0, 0],   # one turn
                         [0, 0, 0, 0, 0, 0, 0, 0, 0]],  # no turn at all (reset failed)
                        dtype=torch.float32)
    rewards = place_reward(torch.tensor([1.0, 0.5, 0.7]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 0, 1, 0, 0], [0, 0.5, 0, 0, 0, 0, 0, 0, 0], [0] * 9]


def test_reinforce_pp_discounts_over_action_tokens_only():
    rewards = place_reward(torch.tensor([1.0]), MASK)
    returns = reinforce_pp(rewards, MASK, gamma=0.5, whiten=False)
    # action tokens 1, 2, 5: returns 0.25, 0.5, 1; the two observation tokens between 2 and 5 do not discount
    assert returns.tolist() == [[0, 0.25, 0.5, 0, 0, 1.0, 0]]
    whitened = reinforce_pp(rewards, MASK, gamma=0.5)
    mean, std = 7 / 12, math.sqrt(((0.25 - 7 / 12) ** 2 + (0.5 - 7 / 12) ** 2 + (1 - 7 / 12) ** 2) / 2)
    expected = [(x - mean) / math.sqrt(std**2 + 1e-8) for x in (0.25, 0.5, 1.0)]
    assert whitened[0, [1, 2, 5]].tolist() == pytest.approx(expected, rel=1e-5)
    assert whitened[0, [0, 3, 4, 6]].tolist() == [0, 0, 0, 0]


def test_reinforce_pp_whitens_over_the_whole_batch():
    mask = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    rewards = place_reward(torch.tensor([1.0, 0.0]), mask)
    out = reinforce_pp(rewards, mask, gamma=1.0)
    # returns over the five action tokens: 1, 1, 0, 0, 0 -> mean 0.4, unbiased std sqrt(0.3)
    hi, lo = 0.6 / math.sqrt(0.3 + 1e-8), -0.4 / math.sqrt(0.3 + 1e-8)
    torch.testing.assert_close(out, torch.tensor([[hi, 0, hi, 0], [0, lo, lo, lo]]))


def test_equal_rewards_give_zero_and_no_nan_for_token_estimators():
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 0, 1, 1]], dtype=torch.float32)
    for score in (0.0, 1.0):
        rewards = place_reward(torch.tensor([score, score]), mask)
        out = reinforce_pp(rewards, mask, gamma=1.0)
        advantages, returns = gae(rewards, torch.zeros_like(mask), mask)
        for x in (out, advantages, returns):
            assert torch.isfinite(x).all()
        assert out.abs().max() == 0 and advantages.abs().max() == 0
        assert returns.tolist() == (score * mask).tolist()


def test_gae_with_unit_gamma_lambda_and_zero_critic_is_the_outcome_on_every_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 1, 0],
                         [0, 0, 1, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.3])
    advantages, returns = gae(place_reward(scores, mask), torch.zeros_like(mask), mask, gamma=1.0, lam=1.0, whiten=False)
    assert advantages.tolist() == (scores[:, None] * mask).tolist()
    assert returns.tolist() == (scores[:, None] * mask).tolist()


def test_gae_bootstraps_from_the_next_action_token_never_an_observation():
    # V before each action token: 0.2, 0.4, 0.5; observation tokens carry a large value that must not be used
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 9.0, 0.5, 9.0]])
    rewards = place_reward(torch.tensor([1.0]), MASK)
    advantages, returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8, whiten=False)
    # t5: delta = 1 - 0.5 = 0.5                        A = 0.5
    # t2: delta = 0.9 * 0.5 - 0.4 = 0.05               A = 0.05 + 0.72 * 0.5 = 0.41
    # t1: delta = 0.9 * 0.4 - 0.2 = 0.16               A = 0.16 + 0.72 * 0.41 = 0.4552
    assert advantages.tolist()[0] == pytest.approx([0, 0.4552, 0.41, 0, 0, 0.5, 0])
    assert returns.tolist()[0] == pytest.approx([0, 0.6552, 0.81, 0, 0, 1.0, 0])
    whitened, same_returns = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    torch.testing.assert_close(whitened, masked_whiten(advantages, MASK))
    assert same_returns.tolist() == returns.tolist()


def test_whitening_statistics_can_be_summed_over_processes():
    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    together = masked_whiten(x, mask)
    # process 0 holds row 0, process 1 row 1; `reduce` adds the other process's statistics
    stats = [torch.stack([(x[i] * mask[i]).sum(), (x[i] ** 2 * mask[i]).sum(), mask[i].sum()]).double() for i in (0, 1)]
    apart = [masked_whiten(x[i:i + 1], mask[i:i + 1], reduce=lambda s, i=i: s + stats[1 - i]) for i in (0, 1)]
    torch.testing.assert_close(torch.cat(apart), together)


# Two episodes, observation tokens between turns (and a final one). Row 0: turns 0 (tokens 1-2), 1 (5-7), 2 (9);
# row 1: turns 0 (token 2), 1 (4-5). A turn's value is the critic's at its first action token; the 7s (later tokens
# of a turn) and 9s (observations) must not be read.
TURN_MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0],
                          [0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
TURNS = torch.tensor([[-1, 0, 0, -1, -1, 1, 1, 1, -1, 2, -1],
                      [-1, -1, 0, -1, 1, 1, -1, -1, -1, -1, -1]])
TURN_VALUES = torch.tensor([[9.0, 0.2, 7.0, 9.0, 9.0, 0.5, 7.0, 7.0, 9.0, 0.6, 9.0],
                            [9.0, 9.0, 0.3, 9.0, 0.4, 7.0, 9.0, 9.0, 9.0, 9.0, 9.0]])
# KL penalty: row 0 pays 0.1 in turn 0 and 0.2 in turn 1 (0.15 + 0.05), so r = -0.1, -0.2, 1.0; row 1 r = 0, 0.5
TURN_PENALTY = torch.zeros(2, 11).index_put_((torch.tensor([0, 0, 0]), torch.tensor([2, 6, 7])),
                                             torch.tensor([0.1, 0.15, 0.05]))


@pytest.mark.parametrize("gamma, lam, per_turn, turn_returns", [
    # gamma 1, lambda 1: A_k = the turns' rewards from k on less V_k
    #   row 0: A2 = 1 - 0.6 = 0.4, A1 = 0.8 - 0.5 = 0.3, A0 = 0.7 - 0.2 = 0.5; row 1: A1 = 0.5 - 0.4, A0 = 0.5 - 0.3
    (1.0, 1.0, [[0.5, 0.3, 0.4], [0.2, 0.1]], [[0.7, 0.8, 1.0], [0.5, 0.5]]),
    # gamma 0.9, lambda 0.8 (gamma lambda = 0.72), a discount per turn:
    #   row 0: delta2 = 1 - 0.6 = 0.4                    A2 = 0.4
    #          delta1 = -0.2 + 0.9 * 0.6 - 0.5 = -0.16   A1 = -0.16 + 0.72 * 0.4 = 0.128
    #          delta0 = -0.1 + 0.9 * 0.5 - 0.2 = 0.15    A0 = 0.15 + 0.72 * 0.128 = 0.24216
    #   row 1: delta1 = 0.5 - 0.4 = 0.1                  A1 = 0.1
    #          delta0 = 0.9 * 0.4 - 0.3 = 0.06           A0 = 0.06 + 0.72 * 0.1 = 0.132
    (0.9, 0.8, [[0.24216, 0.128, 0.4], [0.132, 0.1]], [[0.44216, 0.628, 1.0], [0.432, 0.5]]),
])
def test_turn_gae_hand_example(gamma, lam, per_turn, turn_returns):
    """Every action token of a turn gets its turn's advantage, and the return A_k + V_k; observations get 0."""
    x = AdvantageInputs(scores=torch.tensor([1.0, 0.5]), groups=torch.tensor([0, 1]), ok=torch.ones(2).bool(),
                        mask=TURN_MASK, penalty=TURN_PENALTY, values=TURN_VALUES, turn=TURNS)
    adv, returns = turn_gae(x.rewards(), x.values, x.mask, x.turn, gamma, lam, whiten=False)

    def on_tokens(per_row):  # (each turn's number on its action tokens, 0 elsewhere)
        return torch.tensor([[row[k] if k >= 0 else 0.0 for k in turns] for row, turns in zip(per_row, TURNS.tolist())])

    torch.testing.assert_close(adv, on_tokens(per_turn))
    torch.testing.assert_close(returns, on_tokens(turn_returns))
    # --algo ppo: the same, whitened over the action tokens as token-level GAE's; a token GAE is not this
    whitened, same_returns = advantages("ppo", x, gamma=gamma, lam=lam, gae_unit="turn")
    torch.testing.assert_close(whitened, masked_whiten(adv, TURN_MASK))
    torch.testing.assert_close(same_returns, returns)
    token_level, _ = advantages("ppo", x, gamma=gamma, lam=lam)
    assert not torch.allclose(token_level, whitened)


def test_turn_gae_is_token_gae_when_every_turn_is_one_token():
    mask = torch.tensor([[0, 1, 0, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.float32)
    turn = torch.tensor([[-1, 0, -1, 1, -1, -1, 2, -1], [0, -1, -1, 1, -1, -1, -1, -1]])
    values = torch.tensor([[5.0, 0.1, 5.0, 0.7, 5.0, 5.0, 0.4, 5.0], [0.3, 5.0, 5.0, -0.2, 5.0, 5.0, 5.0, 5.0]])
    rewards = place_reward(torch.tensor([1.0, -0.5]), mask) - 0.05 * mask
    for whiten in (False, True):
        by_turn = turn_gae(rewards, values, mask, turn, 0.9, 0.7, whiten=whiten)
        by_token = gae(rewards, values, mask, 0.9, 0.7, whiten=whiten)
        for a, b in zip(by_turn, by_token):
            torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------------------------
# Turn-level credit when the policy controls the horizon (verl RFC #7244): at each of at most HORIZON turns the
# policy stops (the episode ends after this turn) or continues, pi(continue at turn k) = sigmoid(theta_k); every
# turn costs TURN_COST (placed as a KL penalty on its tokens, which the code sums within the turn), and the outcome
# is OUTCOMES[(turns, stopped)]. The state before turn k is just k (every episode there continued k times).

HORIZON, TURN_COST, TOKENS_PER_TURN = 3, 0.1, 3
OUTCOMES = {(1, True): 0.2, (2, True): 1.0, (3, True): 0.3, (3, False): 0.6}
THETA = [0.4, -0.3, 0.2]


def episodes_of_the_mdp() -> list[list[bool]]:
    """Every episode, as its actions (True: continue): stop at turn 0, 1, 2, or continue to the end."""
    return [[True] * k + [False] for k in range(HORIZON)] + [[True] * HORIZON]


def outcome_of(actions: list[bool]) -> float:
    return OUTCOMES[len(actions), not actions[-1]]


def log_pi(theta: torch.Tensor, actions: list[bool]) -> torch.Tensor:
    """[turns]: log pi(a_k | turn k) of each action of the episode."""
    logits = theta[:len(actions)]
    return torch.nn.functional.logsigmoid(torch.where(torch.tensor(actions), logits, -logits))


def exact_values(theta: torch.Tensor) -> tuple[list[float], list[dict[bool, float]]]:
    """V(k) and Q(k, a) of the turn-level MDP: the expected sum of rewards from turn k on (the costs included)."""
    p = torch.sigmoid(theta).tolist()
    v, q = [0.0] * HORIZON, [{} for _ in range(HORIZON)]
    for k in reversed(range(HORIZON)):
        q[k][False] = -TURN_COST + OUTCOMES[k + 1, True]
        q[k][True] = -TURN_COST + (v[k + 1] if k + 1 < HORIZON else OUTCOMES[HORIZON, False])
        v[k] = p[k] * q[k][True] + (1 - p[k]) * q[k][False]
    return v, q


def mdp_batch(theta: torch.Tensor, read: str = "first") -> AdvantageInputs:
    """The MDP's episodes as the trainer's token tensors, a row each: a prompt token, then per turn TOKENS_PER_TURN
    action tokens and an observation token. The action is decided at a turn's first token, so the exact critic's
    value before it is V(k) and before its later tokens Q(k, a_k); read="last" puts Q(k, a_k) on the first token too,
    which is what reading the value at the turn's last action token would see."""
    v, q = exact_values(theta)
    episodes = episodes_of_the_mdp()
    width = 1 + (TOKENS_PER_TURN + 1) * HORIZON
    mask, turn, values, penalty = (torch.zeros(len(episodes), width) for _ in range(4))
    turn -= 1
    for row, actions in enumerate(episodes):
        for k, action in enumerate(actions):
            start = 1 + (TOKENS_PER_TURN + 1) * k
            tokens = slice(start, start + TOKENS_PER_TURN)
            mask[row, tokens], turn[row, tokens] = 1, k
            values[row, tokens] = q[k][action]
            values[row, start] = v[k] if read == "first" else q[k][action]
            penalty[row, tokens] = TURN_COST / TOKENS_PER_TURN
    scores = torch.tensor([outcome_of(actions) for actions in episodes])
    one_group, all_ok = torch.zeros(len(episodes), dtype=torch.long), torch.ones(len(episodes), dtype=torch.bool)
    return AdvantageInputs(scores=scores, groups=one_group, ok=all_ok, mask=mask, penalty=penalty, values=values,
                           turn=turn.long())


def true_gradient(theta: torch.Tensor) -> torch.Tensor:
    """dJ/dtheta of J = E[outcome - TURN_COST * turns], by enumerating the episodes."""
    theta = theta.detach().requires_grad_()
    episodes = episodes_of_the_mdp()
    objective = sum(log_pi(theta, a).sum().exp() * (outcome_of(a) - TURN_COST * len(a)) for a in episodes)
    return torch.autograd.grad(objective, theta)[0]


def expected_gradient(theta: torch.Tensor, per_turn_advantages: list[list[float]]) -> torch.Tensor:
    """E[sum_k A_k grad log pi(a_k)], exactly: each episode's term weighed by its probability."""
    theta = theta.detach().requires_grad_()
    surrogate = sum(log_pi(theta, a).sum().exp().detach() * (torch.tensor(adv, dtype=theta.dtype) * log_pi(theta, a))
                    .sum() for a, adv in zip(episodes_of_the_mdp(), per_turn_advantages))
    return torch.autograd.grad(surrogate, theta)[0]


def turn_gae_advantages(x: AdvantageInputs) -> list[list[float]]:
    """Each episode's per-turn advantages from the code's turn-level GAE (unwhitened: whitening is a per-batch
    affine map, not part of the estimator's expectation), read at each turn's first token; a turn's tokens agree."""
    adv, _ = turn_gae(x.rewards(), x.values, x.mask, x.turn, 1.0, 1.0, whiten=False)
    per_turn = []
    for row, actions in enumerate(episodes_of_the_mdp()):
        on = [adv[row][x.turn[row] == k] for k in range(len(actions))]
        assert all(torch.allclose(tokens, tokens[0].expand_as(tokens)) for tokens in on)
        per_turn.append([float(tokens[0]) for tokens in on])
    return per_turn


def per_turn_index_advantages(theta: torch.Tensor) -> list[list[float]]:
    """MT-GRPO's per-turn-index baseline in its expectation limit: turn k's advantage is the sum over j >= k, up to
    the episode's own last turn, of r_j - b_j, b_j the mean reward at turn j over the episodes that have a turn j
    (weighed by their probability: an infinite group)."""
    episodes = episodes_of_the_mdp()
    probability = [float(log_pi(theta, a).sum().exp()) for a in episodes]
    rewards = [[-TURN_COST] * (len(a) - 1) + [outcome_of(a) - TURN_COST] for a in episodes]
    baseline = []
    for j in range(HORIZON):
        having = [(p, r[j]) for p, r in zip(probability, rewards) if len(r) > j]
        baseline.append(sum(p * r for p, r in having) / sum(p for p, _ in having))
    return [[sum(r[j] - baseline[j] for j in range(k, len(r))) for k in range(len(r))] for r in rewards]


def test_turn_gae_is_unbiased_where_a_per_turn_index_baseline_is_not():
    """With the policy choosing when to stop, turn-level GAE (lambda 1, the exact critic, through the code's token
    tensors) has exactly the true policy gradient as its expectation; the per-turn-index baseline does not, since
    how many baseline terms a turn's advantage has depends on the episode's own stopping turn. Reading a turn's value
    at its last action token instead (an action-dependent baseline, Q(k, a_k)) gives an expected gradient of 0.
    Numbers (theta = 0.4, -0.3, 0.2):
        true           [ 0.1033, -0.0929, 0.0189]
        turn GAE       the same, to 1e-8
        per-turn index [-0.0481, -0.1464, 0.0189]  (the wrong sign at turn 0; right only at the last turn, whose
                                                    episodes all end at the horizon)
        last token     [ 0.0000,  0.0000, 0.0000]"""
    theta = torch.tensor(THETA, dtype=torch.float64)
    true = true_gradient(theta)
    by_turn = expected_gradient(theta, turn_gae_advantages(mdp_batch(theta)))
    by_index = expected_gradient(theta, per_turn_index_advantages(theta))
    at_last_token = expected_gradient(theta, turn_gae_advantages(mdp_batch(theta, read="last")))
    print(f"true {true.tolist()}\nturn GAE {by_turn.tolist()}\nper-turn index {by_index.tolist()}\n"
          f"last token {at_last_token.tolist()}")
    torch.testing.assert_close(by_turn, true, atol=1e-6, rtol=0)
    assert (by_index - true).abs().max() > 0.05
    assert (at_last_token - true).abs().max() > 0.05


def quantile_baseline(scores: torch.Tensor, groups: torch.Tensor, q: float) -> torch.Tensor:
    """A test estimator, step 1 of docs/algorithms.md's "Add an advantage estimator": each sample's score minus the
    q-quantile of the other samples of its task (q 0.5: their median)."""
    def within(s):
        return s - torch.stack([torch.cat([s[:i], s[i + 1:]]).quantile(q) for i in range(len(s))])

    return _within_groups(scores, groups, within)


def test_each_estimator_reads_the_flags_its_entry_declares():
    """An entry's flags are its function's keyword arguments, and train.py's flags are theirs (EstimatorArgs): a
    flag the estimators share says in --help what it is to each, with each one's default where they differ."""
    for name, estimator in ESTIMATORS.items():
        assert set(inspect.signature(estimator.fn).parameters) - {"x"} == set(estimator.flags), name
    helps = {f.name: f.type.__metadata__[0].help for f in dataclasses.fields(EstimatorArgs)}
    assert set(helps) == {name for estimator in ESTIMATORS.values() for name in estimator.flags}
    assert "gigpo: the paper's discount per turn of a turn's return (default 0.95)" in helps["gamma"]
    assert EstimatorArgs().gamma is None and EstimatorArgs().step_weight == 1.0  # (None: each estimator's default)
    with pytest.raises(ValueError, match="no advantage estimator reads gama"):
        advantages("grpo", AdvantageInputs(scores=torch.ones(2), groups=torch.zeros(2), ok=torch.ones(2).bool(),
                                           mask=torch.ones(2, 3)), gama=0.9)


def test_a_new_grouped_estimator_with_a_flag_is_one_function_and_its_entry(monkeypatch, tmp_path):
    """The recipe followed: a function (the baseline above, for AdvantageInputs.per_episode, at its flag's value) and
    its entry in ESTIMATORS, which declares the flag. train.py, imported anew as a run imports it, then takes `--algo
    quantile --baseline-quantile 0.25` on its command line, refuses the flag with another --algo and the estimator
    with a group of one, trains a step with it, keeps the flag in config.json, and logs each trajectory's advantage
    as the estimator gives it at 0.25."""
    def quantile(x: AdvantageInputs, baseline_quantile: float):
        return x.per_episode(functools.partial(quantile_baseline, q=baseline_quantile)), None

    monkeypatch.setitem(ESTIMATORS, "quantile", Estimator(quantile, grouped=True, flags={
        "baseline_quantile": Flag(0.5, "the quantile of the task's other samples that is the baseline")}))
    monkeypatch.setattr(adv_lib, "EstimatorArgs", flag_group(ESTIMATORS))  # (what importing rl/advantages.py does)
    monkeypatch.delitem(sys.modules, "train")
    train = importlib.import_module("train")
    argv = ["--engine", "hf", "--steps", "1", "--tasks-per-step", "2", "--n", "3", "--horizon", "2",
            "--max-new-tokens", "16", "--eval-every", "0", "--out-dir", str(tmp_path), "--run-name", "quantile"]
    with pytest.raises(SystemExit, match="--baseline-quantile is read only by --algo quantile, not by --algo grpo"):
        train.check(train.parse_args(argv + ["--baseline-quantile", "0.25"]), world=1)
    args = train.parse_args(argv + ["--algo", "quantile", "--baseline-quantile", "0.25"])
    with pytest.raises(SystemExit, match="--n 2 or more"):
        train.check(dataclasses.replace(args, n=1), world=1)
    run_dir = train.main(args)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == "quantile" and config["baseline_quantile"] == 0.25
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(metrics["losses/policy"]) and metrics["losses/grad_norm"] > 0
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 6
    for group in {r["group"] for r in records}:
        members = [r for r in records if r["group"] == group]
        expected = quantile_baseline(torch.tensor([r["reward"] for r in members]), torch.zeros(len(members)), 0.25)
        assert [r["advantages"] for r in members] == pytest.approx(expected.tolist(), abs=1e-6)


def to_go(x: AdvantageInputs, gamma: float):
    """A token-level test estimator: the discounted return of every action token, unwhitened (plain REINFORCE)."""
    return reinforce_pp(x.rewards(), x.mask, gamma, whiten=False), None


def value_baseline(x: AdvantageInputs, gamma: float):
    """A critic-based test estimator: the return of every action token less the critic's value (no GAE)."""
    returns = reinforce_pp(x.rewards(), x.mask, gamma, whiten=False)
    return (returns - x.values) * x.mask, returns


@pytest.mark.slow
@pytest.mark.parametrize("name, estimator", [
    ("to_go", Estimator(to_go, flags={"gamma": Flag(0.5, "the discount per action token")})),
    ("value_baseline", Estimator(value_baseline, critic=True, flags={"gamma": Flag(1.0, "the discount")}))])
def test_a_new_token_level_or_critic_based_estimator_is_one_function_and_its_entry(name, estimator, monkeypatch,
                                                                                   tmp_path):
    """The same recipe for an estimator over tokens, and for one with a critic: its entry's `gamma` flag (train.py's
    --gamma, which others read too) is the discount, at its default in the run, and `critic` builds, trains and
    checkpoints a critic (rl/model.py), plans its memory and lets the critic's flags through; nothing else is
    edited."""
    import train
    from rl.memory import plan
    from rl.model import load_model
    from rl.records import decode_array

    monkeypatch.setitem(ESTIMATORS, name, estimator)
    args = train.parse_args(["--engine", "hf", "--steps", "1", "--tasks-per-step", "2", "--n", "1", "--horizon", "2",
                             "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", name])
    args = dataclasses.replace(args, algo=name)
    train.check(args, world=1)  # (a group of one is fine: it compares no samples)
    train.check(train.replace(args, gamma=0.9), world=1)
    if estimator.critic:
        train.check(dataclasses.replace(args, critic_warmup=2), world=1)
        with pytest.raises(SystemExit, match="two optimizers"):
            train.check(train.replace(args, mixed_precision="fp16"), world=1)  # (a ModelArgs flag)
    else:
        with pytest.raises(SystemExit, match="--critic-warmup"):
            train.check(dataclasses.replace(args, critic_warmup=2), world=1)
    settings = dict(algo=name, lora_rank=0, lora_targets=("all-linear",), processes=1, sharded=False, reference=True,
                    offload_reference=False, micro_tokens=4096, checkpointing=False, engine="hf", engine_share=0.3,
                    engine_sleeps=True, gpu_gib=80.0, batch=8, context=4096, logits_elements=2**26)
    held = plan(load_model("tiny-agent").config, **settings)["phases"]["update"]
    assert any("critic" in part for part in held) == estimator.critic, held
    run_dir = train.main(args)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(metrics["losses/policy"]) and metrics["losses/grad_norm"] > 0
    assert ("losses/value" in metrics and metrics["losses/critic_grad_norm"] > 0) == estimator.critic

    def at_tokens(value, n):  # (a record holds one number where all its action tokens' are equal)
        values = decode_array(value)
        return values * n if len(values) == 1 else values

    for record in (json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()):
        if record.get("error") is not None:
            continue
        n = record["action_tokens"]
        advantages = at_tokens(record["advantages"], n)
        if estimator.critic:  # the return less the value, at every action token
            returns, values = at_tokens(record["returns"], n), at_tokens(record["values"], n)
            assert advantages == pytest.approx([r - v for r, v in zip(returns, values)], abs=1e-5)
        else:  # the outcome discounted by 0.5 (the entry's default) per later action token
            assert advantages == pytest.approx([record["reward"] * 0.5 ** (n - 1 - k) for k in range(n)], abs=1e-6)
