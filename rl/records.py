"""Trajectory records: one JSON line per episode in rollouts.jsonl, evaluations.jsonl and eval.py's
.jsonl, holding what the viewer (scripts/view.py), DPO's --experience and a person need, compactly.

A record (log format 2):

    item_id, task_id, category, group      the task (AgentGym's item id) and its n samples' group
    step, horizon                          the training step (0: the initial policy) and its turn cap
    reward, success, turns, finish, error  the outcome; finish is done | horizon | max_tokens | error
    invalid_actions                        turns the env answered as not a valid action
    tokens, action_tokens                  trajectory length and how many of its tokens were sampled
    messages                               the conversation as text (instruction, ack, observations, replies)
    token_ids                              the exact ids, encoded (below)
    action_spans                           [start, end) of each sampled turn among the ids: loss mask 1
    sampled_logprobs                       the sampler's log-prob of each action token, in span order
    trainer_logprobs                       the trainer's (before the update), RL steps only
    advantages                             one number where it is constant over the trajectory (GRPO,
                                           RLOO, outcome REINFORCE++), else one per action token
    values, returns                        PPO's critic values and GAE returns, per action token
    usage                                  API models only (rl/engines/api.py): calls, prompt_tokens, completion_tokens,
                                           reasoning_tokens (of the completion tokens) and cost (dollars) summed
                                           over the episode; token_ids are empty

Number arrays are encoded as "<type>:<base64 of little-endian values>" with type i32 or f32: exact,
and 1.5x (ids) to 4x (log-probs) smaller than JSON's decimals. `decode_array` reads them back, and also the
plain lists of log format 1 (token_ids and action_spans only), so every older log still opens:

    from rl.records import decode_array
    ids = decode_array(record["token_ids"])
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

FORMAT = 2
_TYPES = {"i32": "<i4", "f32": "<f4"}


def encode_array(values, kind: str) -> str:
    """Numbers as "<kind>:<base64>", kind i32 or f32."""
    return f"{kind}:" + base64.b64encode(np.asarray(values, dtype=_TYPES[kind]).tobytes()).decode("ascii")


def decode_array(value) -> list:
    """An encoded array (or a plain list, or a number, as older logs and constant advantages hold) as a list."""
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, (int, float)):
        return [value]
    kind, _, data = value.partition(":")
    if kind not in _TYPES:
        raise ValueError(f"not an encoded array: {value[:20]!r}")
    return np.frombuffer(base64.b64decode(data), dtype=_TYPES[kind]).tolist()


def action_positions(spans: list[list[int]]) -> list[int]:
    """The token positions of the action tokens, in span order."""
    return [i for start, end in spans for i in range(start, end)]


def per_action(row, positions: list[int]):
    """A [T] tensor's values at the action positions: one number when they are all equal, else encoded."""
    values = row[positions].float()
    if values.numel() and bool((values == values[0]).all()):
        return round(float(values[0]), 7)
    return encode_array(values.tolist(), "f32")


# Metrics that older runs logged under another name, read under today's: how many episodes the horizon ended
# was `finish/max_turns` before the horizon had one name.
RENAMED_METRICS = {"finish/max_turns": "finish/horizon"}


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl (read_log), older runs' metric names read as today's (RENAMED_METRICS)."""
    return [{RENAMED_METRICS.get(key, key): value for key, value in row.items()} for row in read_log(path)]


def read_log(path: Path) -> list[dict]:
    """The complete lines of a JSONL log (metrics.jsonl, rollouts.jsonl, ...) as records; a line torn by a crash, or
    still being written, is skipped."""
    records = []
    for line in Path(path).read_bytes().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def rollout_records(trajectories: list, batch, step: int) -> list[dict]:
    """A training step's trajectories as log records, with what the update saw of each (`batch`: rl/batch.py's
    Batch): the trainer's log-probs, the advantages, and PPO's values and returns, at its action tokens."""
    records = []
    last = {int(episode): row for row, episode in enumerate(batch.episodes)}  # (--reasoning drop: an episode's rows)
    for k, traj in enumerate(trajectories):
        row = last[k]  # the row of the sequence the record holds (its last turn's, under --reasoning drop)
        record = {"step": step, **traj.log_record()}
        positions = action_positions(record["action_spans"])
        for key, name in (("trainer_logprobs", "trainer_logprobs"), ("advantages", "advantages"),
                          ("old_values", "values"), ("returns", "returns")):
            if traj.error is None and positions and key in batch.full:
                record[name] = per_action(batch.full[key][row], positions)
        records.append(record)
    return records
