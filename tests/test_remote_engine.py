"""The rollout-server client (rl/engines/remote.py) against fake servers (httpx.MockTransport, no vLLM; a second each):
the processes of a run spread their trajectories evenly over the servers, a trajectory keeps its server for its whole
episode also when an evaluation plays meanwhile, and a turn sampled by other weights than the ones asked for fails.
The real servers' side is in tests/test_rollout_server.py."""

import functools
import json
import threading

import httpx
import pytest

from rl.engines import remote as remote_engine
from rl.engines.remote import RemoteEngine
from rollout import Trajectory
from train import my_tasks


class FakeServers:
    """Rollout servers as the client sees them: /info, and /poll answering every submitted turn at once with one token
    (the turn's `version` that of the poll, or `sampled_by` where set). `turns[address]`: the trajectories (their
    first token) of the turns it was given, in order."""

    def __init__(self, addresses):
        self.turns = {address: [] for address in addresses}
        self.sampled_by, self.lock = None, threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        address = f"{request.url.host}:{request.url.port}"
        if request.url.path == "/info":
            return httpx.Response(200, json={"max_model_len": 4096, "deterministic": False, "instance": address,
                                             "version": 0})
        body = json.loads(request.content)
        with self.lock:
            self.turns[address] += [turn["token_ids"][0] for turn in body["submit"]]
        version = body["version"] if self.sampled_by is None else self.sampled_by
        done = [{"id": turn["id"], "token_ids": [7], "logprobs": [-0.5], "prompt_tokens": len(turn["token_ids"]),
                 "cached_tokens": 0, "version": version} for turn in body["submit"]]
        return httpx.Response(200, json={"done": done, "pending": 0, "progress": 0, "version": version})


@pytest.fixture
def servers(monkeypatch):
    """Four fake servers, and every RemoteEngine made meanwhile talking to them."""
    fake = FakeServers([f"10.0.0.{k}:8900" for k in range(4)])
    client = functools.partial(httpx.Client, transport=httpx.MockTransport(fake))
    monkeypatch.setattr(remote_engine.httpx, "Client", client)
    return fake


def engine_on(fake, rank=0):
    return RemoteEngine(list(fake.turns), fmt=_Format(), temperature=1.0, top_p=1.0, rank=rank)


class _Format:
    """What RemoteEngine reads of a ChatFormat: the stop ids, and the probe's tokens."""

    stop_ids = frozenset({2})

    def render(self, messages):
        return ""

    def encode(self, text):
        return [1]


def trajectories(first_token: int, groups: list[int]) -> list[Trajectory]:
    """A trajectory for each entry of `groups`, in rows from 0 (as every rollout numbers them); the first token of
    each prompt names it."""
    return [Trajectory("babyai", 0, group, row, [], token_ids=[first_token + row]) for row, group in enumerate(groups)]


def play(engine, played: list[Trajectory], turns: int) -> None:
    """`turns` more turns of each trajectory, in rounds (its episode goes on: `end` ends it)."""
    for _ in range(turns):
        for traj in played:
            engine.submit(traj, 4)
        while engine.pending:
            for traj, sample in engine.poll():
                assert sample.error is None, sample.error
                traj.token_ids += sample.token_ids
                traj.turns += 1


def end(played: list[Trajectory]) -> None:
    for traj in played:
        traj.finish = "horizon"


@pytest.mark.parametrize("n", [8, 1])
def test_eight_processes_spread_their_turns_over_four_servers_evenly(servers, n):
    """The two-node recipe: 16 tasks a step over 8 processes (2 each, groups 0 and 1 on every process) x n samples,
    4 servers; every server gets within 25% of the mean of the turns (n 8: a step's rollout; n 1: an evaluation of
    --eval-k 1). Each process numbers its groups from 0, so a choice by group number put everything on two."""
    class Accelerator:
        num_processes = 8

    for rank in range(8):
        Accelerator.process_index = rank
        engine = engine_on(servers, rank)
        _, groups = my_tasks(list(range(16)), n, Accelerator)
        play(engine, trajectories(1000 * rank, groups), turns=3)
        engine.close()
    counts = [len(turns) for turns in servers.turns.values()]
    mean = sum(counts) / len(counts)
    assert all(abs(count - mean) <= 0.25 * mean for count in counts), counts


def test_an_evaluation_meanwhile_moves_no_episode_to_another_server(servers):
    """An asynchronous run: its set's episodes (rows 0-3, 2 tasks x 2) are between turns when an evaluation plays
    on other envs, whose rows are numbered from 0 too (4 tasks x 1); every turn of every episode goes to the server
    of its first turn (its prefix cache is there)."""
    engine = engine_on(servers)
    stream = trajectories(100, [0, 0, 1, 1])
    play(engine, stream, turns=1)
    evaluation = trajectories(200, [0, 1, 2, 3])
    play(engine, evaluation, turns=2)
    end(evaluation)
    play(engine, stream, turns=2)
    where = {first: [address for address, turns in servers.turns.items() for _ in range(turns.count(first))]
             for first in range(100, 104)}
    assert all(len(set(addresses)) == 1 and len(addresses) == 3 for addresses in where.values()), where
    end(stream)
    engine.home(trajectories(300, [0])[0])
    assert len(engine.homes) == 1  # (the ended episodes' homes are forgotten)
    engine.close()


def test_a_turn_sampled_by_other_weights_than_asked_for_fails(servers):
    """A server that answers a turn with another version than the one the client asked for (another trainer's
    weights): the turn fails with a sentence naming both, counted as lost, never taken as a sample."""
    engine = engine_on(servers)
    engine.version = "A/5"
    servers.sampled_by = "B/1"
    traj = trajectories(100, [0])[0]
    engine.submit(traj, 4)
    (_, sample), = engine.poll()
    assert sample.token_ids == [] and "sampled by weights version B/1, not A/5" in sample.error, sample
    assert engine.metrics()["server_lost_turns"] == 1
    engine.close()
