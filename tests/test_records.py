"""Trajectory records (rl/records.py): encoded arrays read back exactly, and older logs still open."""

import json

import pytest
import torch

from rl.records import action_positions, decode_array, encode_array, per_action
from rollout import Trajectory


def test_encoded_arrays_read_back_exactly():
    ids = [0, 1, 151_643, 2**31 - 1]
    assert decode_array(encode_array(ids, "i32")) == ids
    logprobs = [-0.0, -2.0**-20, -3.25, -17.5]
    assert decode_array(encode_array(logprobs, "f32")) == logprobs  # float32-exact values stay exact
    assert decode_array(encode_array([], "f32")) == []
    # smaller than JSON's decimals for a real vocabulary's ids (Qwen2.5: 151,665) and for log-probs
    vocab_ids, sampled = list(range(100_000, 151_000, 7)), [-1 / (i + 3) for i in range(1000)]
    assert len(encode_array(vocab_ids, "i32")) < 0.8 * len(json.dumps(vocab_ids))
    assert len(encode_array(sampled, "f32")) < 0.4 * len(json.dumps(sampled))
    # older logs; constants
    assert decode_array([3, 4]) == [3, 4] and decode_array(None) is None and decode_array(0.5) == [0.5]
    with pytest.raises(ValueError, match="not an encoded array"):
        decode_array("u8:AAAA")


def test_per_action_values_are_one_number_when_constant():
    row = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.5])
    assert per_action(row, [1, 2, 4]) == 0.5
    row[4] = -1.0
    assert decode_array(per_action(row, [1, 2, 4])) == [0.5, 0.5, -1.0]
    assert action_positions([[1, 3], [4, 5]]) == [1, 2, 4]


def test_a_trajectory_record_holds_its_exact_tokens():
    traj = Trajectory("babyai", 3, group=0, row=0, messages=[{"role": "user", "content": "hi"}], horizon=3)
    traj.add([5, 6, 7])
    traj.add([8, 9], [-0.5, -0.25], trained=True)
    traj.add([10])
    traj.add([11], [-2.0], trained=True)
    record = json.loads(json.dumps(traj.log_record()))
    assert decode_array(record["token_ids"]) == [5, 6, 7, 8, 9, 10, 11]
    assert record["action_spans"] == [[3, 5], [6, 7]] and record["action_tokens"] == 3
    assert decode_array(record["sampled_logprobs"]) == [-0.5, -0.25, -2.0]
    assert record["category"] == "GoTo" and record["task_id"] == 3 and record["horizon"] == 3
