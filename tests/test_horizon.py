"""ScalingInter-RL's horizon schedule: stage boundaries and fixed caps. (Resuming on the right stage is
tested on the training loop in test_algorithms.py.)"""

import pytest

from rl.horizon import describe, horizon_at


def test_stepwise_stage_boundaries():
    caps = (10, 20, 30)
    assert [horizon_at(s, caps, 100) for s in (1, 100, 101, 200, 201, 300, 10_000)] == [10, 10, 20, 20, 30, 30, 30]


def test_fixed_horizon_is_one_cap():
    assert {horizon_at(s, (15,), 100) for s in range(1, 1000)} == {15}


def test_bad_schedules():
    with pytest.raises(ValueError):
        horizon_at(0, (10,), 100)
    with pytest.raises(ValueError):
        horizon_at(1, (), 100)


def test_describe():
    assert describe((15,), 100, 200) == "15 turns"
    assert describe((10, 20, 30), 100, 250) == "horizon 10 (1-100), 20 (101-200), 30 (201-250) turns"
    assert describe((10, 20, 30), 100, 150) == "horizon 10 (1-100), 20 (101-150) turns"
