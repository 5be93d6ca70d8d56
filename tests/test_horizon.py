"""ScalingInter-RL's horizon schedule: stage boundaries, fixed caps, and resuming."""

import pytest

from rl.horizon import describe, horizon


def test_stepwise_stage_boundaries():
    caps = (10, 20, 30)
    assert [horizon(s, caps, 100) for s in (1, 100, 101, 200, 201, 300, 10_000)] == [10, 10, 20, 20, 30, 30, 30]


def test_fixed_horizon_is_one_cap():
    assert {horizon(s, (15,), 100) for s in range(1, 1000)} == {15}


def test_a_resumed_run_continues_exactly_where_it_stopped():
    caps, every = (6, 13, 20), 100
    uninterrupted = [horizon(s, caps, every) for s in range(1, 351)]
    for checkpoint in (99, 100, 101, 200):  # stop after `checkpoint`, resume at checkpoint + 1
        resumed = [horizon(s, caps, every) for s in range(1, checkpoint + 1)]
        resumed += [horizon(s, caps, every) for s in range(checkpoint + 1, 351)]
        assert resumed == uninterrupted
    assert horizon(101, caps, every) == 13  # upstream restores its counter one behind: 13 already at step 101 after
    assert horizon(100, caps, every) == 6   # resuming from step 100 is right, but its next stage comes at step 200


def test_bad_schedules():
    with pytest.raises(ValueError):
        horizon(0, (10,), 100)
    with pytest.raises(ValueError):
        horizon(1, (), 100)


def test_describe():
    assert describe((15,), 100, 200) == "15 turns"
    assert describe((10, 20, 30), 100, 250) == "horizon 10 (1-100), 20 (101-200), 30 (201-250) turns"
    assert describe((10, 20, 30), 100, 150) == "horizon 10 (1-100), 20 (101-150) turns"
