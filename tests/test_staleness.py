"""The staleness rule (rl/staleness.py) and the one rollout loop that plays by it (rollout.Rollouts): no trained token
lags more than k updates, the sets under way never share an env, and at k = 0 the next set opens only once the step
is over (after its metrics: the synchronous loop, --horizon auto's cap included), at k >= 1 as soon as its block is
free."""

import pytest

import envs
from rl import staleness
from rl.engines.expert import ExpertEngine
from rl.limits import Limits
from rl.model import load_tokenizer
from rollout import ChatFormat, Rollouts, Tasks

BABYAI = {"babyai": Limits((6,), 1, 64, 16384)}  # (its episodes' token budgets: Rollouts takes each env's)


def test_no_token_lags_more_than_k_and_the_sets_under_way_share_no_envs():
    for k in range(4):
        for j in range(1, 12):
            # set j's turns are sampled from its first version on, and it trains at update j (weights: version j - 1)
            versions = range(max(staleness.first_version(j, k), 0), j)
            assert {staleness.lag(j, v) for v in versions} <= set(range(k + 1))
            under_way = range(max(j - k, 1), j + 1)
            assert len({staleness.block(i, k) for i in under_way}) == len(under_way) <= staleness.blocks(k)


def test_a_set_opens_when_its_block_is_free_and_at_k_0_after_the_step_before():
    assert staleness.opens(3, 0, under_way=False, version=2) and not staleness.opens(3, 0, under_way=False, version=1)
    assert staleness.opens(5, 2, under_way=False, version=1) and not staleness.opens(5, 2, under_way=True, version=4)
    assert [staleness.known_before(j, 0) for j in (1, 2, 5)] == [0, 1, 4]
    assert [staleness.known_before(j, 2) for j in (1, 4, 5)] == [-3, 0, 1]


@pytest.mark.slow  # (about 5 s: two short expert rollouts at each k)
def test_the_loop_opens_the_next_set_as_the_rule_says():
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    train = envs.splits("babyai")["train"]
    for k, opened_by in ((0, "resume"), (1, "update")):
        opened = []

        def tasks_of(j: int) -> Tasks:
            opened.append(j)
            return Tasks(train[2 * j:2 * j + 2], [0, 1], {"babyai": 3})

        environments = [envs.make("babyai") for _ in range(2 * staleness.blocks(k))]
        rollouts = Rollouts(ExpertEngine(fmt, environments), fmt, environments, tasks_of, staleness=k, first=1, last=3,
                            limits=BABYAI)
        try:
            played = rollouts.take(1)
            assert [t.task_id for t in played] == train[2:4] and all(not t.live for t in played)
            assert opened == list(range(1, k + 2))  # at k = 1 set 2 is under way beside set 1
            rollouts.before_update()
            rollouts.before_sync()
            assert opened == ([1] if opened_by == "resume" else [1, 2, 3])  # (k = 1: set 1's block came free)
            rollouts.resume(1)
            assert opened == list(range(1, k + 3))
            assert [t.task_id for t in rollouts.take(2)] == train[4:6]
        finally:
            rollouts.close()


@pytest.mark.slow  # (about 3 s: two short expert rollouts)
def test_a_staleness_variant_is_an_edit_of_rl_staleness_alone(monkeypatch):
    """A variant of the rule, written as rl/staleness.py would hold it, and nothing else changed: at k >= 1 too, a set
    opens only once the engine has its first version (its envs no longer reset during the update before). The loop
    follows it: at k = 1 set 3 (first version 1) waits for version 1 instead of opening when set 1's block comes free."""
    monkeypatch.setattr(staleness, "opens", lambda j, k, under_way, version: not under_way
                        and version >= staleness.first_version(j, k))
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    train = envs.splits("babyai")["train"]
    opened = []

    def tasks_of(j: int) -> Tasks:
        opened.append(j)
        return Tasks(train[2 * j:2 * j + 2], [0, 1], {"babyai": 3})

    environments = [envs.make("babyai") for _ in range(2 * staleness.blocks(1))]
    rollouts = Rollouts(ExpertEngine(fmt, environments), fmt, environments, tasks_of, staleness=1, first=1, last=3,
                        limits=BABYAI)
    try:
        assert [t.task_id for t in rollouts.take(1)] == train[2:4]
        rollouts.before_update()
        rollouts.before_sync()
        assert opened == [1, 2]  # (the rule as shipped: [1, 2, 3], set 1's block free)
        rollouts.resume(1)
        assert opened == [1, 2, 3]
        assert [t.task_id for t in rollouts.take(2)] == train[4:6]
    finally:
        rollouts.close()


@pytest.mark.slow  # (about 3 s: short expert rollouts)
def test_a_later_set_replays_its_groups_as_soon_as_it_completes():
    """--dynamic-sampling at k = 1: set 2, under way beside set 1 and done first (a 1-turn cap against 6), starts its
    replays while set 1 still plays, not when the trainer takes it; each step's metrics count its own set's replays."""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    train = envs.splits("babyai")["train"]
    asked = []

    def tasks_of(j: int) -> Tasks:
        return Tasks(train[2 * j:2 * j + 2], [0, 0], {"babyai": 6 if j == 1 else 1})

    def redraw(j: int, played: list) -> dict[int, int]:
        asked.append(j)
        return {0: train[50], 1: train[51]} if asked.count(j) == 1 and j == 2 else {}

    environments = [envs.make("babyai") for _ in range(2 * staleness.blocks(1))]
    rollouts = Rollouts(ExpertEngine(fmt, environments), fmt, environments, tasks_of, staleness=1, first=1, last=2,
                        limits=BABYAI, redraw=redraw)
    try:
        assert max(t.turns for t in rollouts.take(1)) > 1  # (set 1 outlasted set 2's episodes and their replays)
        assert asked[:2] == [2, 2] and (rollouts.clock.redraw_rounds, rollouts.clock.redrawn_groups) == (0, 0)
        rollouts.before_update()
        rollouts.before_sync()
        rollouts.resume(1)
        assert [t.task_id for t in rollouts.take(2)] == train[50:52]
        assert asked.count(2) == 2 and (rollouts.clock.redraw_rounds, rollouts.clock.redrawn_groups) == (1, 1)
    finally:
        rollouts.close()
