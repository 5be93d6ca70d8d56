"""Asynchronous training (--max-staleness k, rollout.py's Rollouts): staleness 0 is the synchronous loop exactly, no
trained token is more than k updates old, the importance weights are pi_prox / pi_behav truncated at the cap, and
episodes go on under newer weights (partial rollouts); rollout/logprob_diff is the lag-0 tokens' engine check, the
stale tokens' difference is async/logprob_diff_stale."""

import importlib.util
import json
import math
import sys
import types

import pytest

import envs
import train
from envs import StepResult, react_action
from envs.babyai import BabyAI
from rl.records import decode_array

pytestmark = pytest.mark.slow  # training runs


class Ragged(BabyAI):
    """BabyAI's first observation; task t ends after t % 3 + 1 turns, rewarded when the last reply says "turn left",
    so episodes of a step end at different turns and the samples of a task differ."""

    name = "ragged"

    def reset(self, task_id):
        self.left = task_id % 3 + 1
        return super().reset(task_id)

    def step(self, text):
        self.left -= 1
        done = self.left == 0
        return StepResult("Done." if done else "Go on.", float(done and react_action(text) == "turn left"), done, {})


def register_ragged(patch: pytest.MonkeyPatch, tmp_path) -> None:
    """envs.make("ragged"), its categories and its splits (tasks 121-520), while `patch` holds."""
    ids = tmp_path / "ids.json"
    envs.save_task_ids(ids, "ragged", list(range(121, 521)))
    module = types.SimpleNamespace(make=lambda **_: Ragged(), category=lambda t: ("one", "two", "three")[t % 3],
                                   default_split_files=lambda: (ids, ids))
    patch.setitem(sys.modules, "ragged_env", module)
    patch.setitem(envs.ENVS, "ragged", envs.Registration("ragged_env", call_timeout=60.0, upstream_horizon=3))


@pytest.fixture
def ragged(monkeypatch, tmp_path):
    register_ragged(monkeypatch, tmp_path)


def run(tmp_path, name, *flags):
    args = train.parse_args(["--env", "ragged", "--steps", "5", "--tasks-per-step", "2", "--n", "4", "--horizon", "3",
                             "--max-new-tokens", "16", "--lr", "0.01", "--out-dir", str(tmp_path), "--run-name", name,
                             *map(str, flags)])
    run_dir = train.main(args)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return metrics, rollouts


def timeless(metrics):
    return [{k: v for k, v in m.items() if not k.startswith(("perf/", "async/", "sync/seconds"))} for m in metrics]


@pytest.mark.parametrize("algo,engine", [("grpo", "hf"), ("ppo", "hf"), ("grpo", "vllm")])
def test_staleness_zero_is_the_synchronous_loop(algo, engine, ragged, tmp_path):
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    flags = ["--algo", algo, "--engine", engine, "--deterministic", "--eval-every", "2", "--eval-tasks", "3",
             "--steps", "3"]
    sync_metrics, sync_rollouts = run(tmp_path, "sync", *flags)
    async_metrics, async_rollouts = run(tmp_path, "async", *flags, "--max-staleness", "0")
    assert [m["charts/step"] for m in async_metrics] == [0, 1, 2, 3]
    assert timeless(async_metrics) == timeless(sync_metrics)  # rewards, losses, KL, evaluations: every one
    assert all(m["async/staleness_max"] == 0 and m["async/is_weight_mean"] == 1 for m in async_metrics[1:])
    for played, reference in zip(async_rollouts, sync_rollouts, strict=True):
        assert played.pop("versions") == [played["step"] - 1] * played["turns"]
        assert played == reference  # every token, log-prob and advantage


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    """A k = 2 run on the HF engine (rounds: every set under way plays together), the cap low enough to truncate."""
    mp = pytest.MonkeyPatch()
    tmp_path = tmp_path_factory.mktemp("stale")
    register_ragged(mp, tmp_path)
    try:
        yield run(tmp_path, "k2", "--engine", "hf", "--max-staleness", "2", "--is-cap", "1.1", "--eval-every", "0")
    finally:
        mp.undo()


def test_no_trained_token_is_more_than_k_updates_old(stale_run):
    metrics, rollouts = stale_run
    assert sorted({r["step"] for r in rollouts}) == [1, 2, 3, 4, 5]
    for record in rollouts:
        step, versions = record["step"], record["versions"]
        assert len(versions) == record["turns"] == len(record["action_spans"])
        assert versions == sorted(versions)  # an episode goes on under the same or newer weights
        assert all(step - 1 - 2 <= v <= step - 1 for v in versions), (step, versions)
    assert any(len(set(r["versions"])) > 1 for r in rollouts)  # partial rollouts: an episode under two versions
    assert {r["step"] - 1 - v for r in rollouts for v in r["versions"]} == {0, 1, 2}
    for m in metrics:
        assert m["async/staleness_max"] <= 2
        assert sum(m[f"async/lag_{k}_share"] for k in range(3)) == pytest.approx(1)
        assert 0 <= m["perf/engine_idle_share"] <= 1 and m["perf/generate_s"] <= m["perf/step_s"]  # (this step's own)


def test_tokens_per_second_is_of_the_steps_own_generation(stale_run):
    """perf/tokens_per_s is the tokens generated during a step over the engine's seconds then; a step that generated
    nothing (here the last: its set and the one before it were played during earlier steps) logs none, not 0."""
    metrics, _ = stale_run
    steps = metrics[1:] if metrics[0]["charts/step"] == 0 else metrics
    idle = [m["charts/step"] for m in steps if m["perf/generate_s"] == 0]
    assert idle and all("perf/tokens_per_s" not in m for m in steps if m["charts/step"] in idle)
    assert all(m["perf/tokens_per_s"] > 0 for m in steps if m["charts/step"] not in idle)


def test_importance_weights_are_recomputed_from_the_logs(stale_run):
    """pi_prox / pi_behav from the logged log-probs (the trainer's before its update, the sampler's), truncated at
    the cap, over the stale tokens: the run's metrics exactly."""
    metrics, rollouts = stale_run
    truncated_somewhere = untruncated_somewhere = False
    for m in metrics:
        weights, fresh, stale = [], [], []
        for record in (r for r in rollouts if r["step"] == m["charts/step"]):
            behaviour = decode_array(record["sampled_logprobs"])
            proximal = decode_array(record["trainer_logprobs"])
            proximal = proximal * len(behaviour) if len(proximal) == 1 else proximal  # (all equal: logged once)
            lags = [record["step"] - 1 - v for (start, end), v in zip(record["action_spans"], record["versions"])
                    for _ in range(start, end)]
            weights += [math.exp(p - b) for p, b, lag in zip(proximal, behaviour, lags, strict=True) if lag > 0]
            for p, b, lag in zip(proximal, behaviour, lags):
                (stale if lag > 0 else fresh).append(abs(p - b))
        # the engine check over the lag-0 tokens alone (the HF engine: the trainer's own weights), staleness apart
        assert m["rollout/logprob_diff"] == pytest.approx(sum(fresh) / max(len(fresh), 1), abs=1e-7)
        assert m["rollout/logprob_diff"] < 1e-5 and m["rollout/logprob_diff_max"] < 1e-4
        if stale:  # (staleness: 1e-2 and more, after updates at --lr 0.01)
            assert m["async/logprob_diff_stale"] == pytest.approx(sum(stale) / len(stale), rel=1e-4)
            assert m["async/logprob_diff_stale"] > 1e-3
        if not weights:
            assert m["async/is_weight_mean"] == 1 and m["async/is_truncated_share"] == 0
            continue
        capped = [min(w, 1.1) for w in weights]
        assert m["async/is_weight_mean"] == pytest.approx(sum(capped) / len(capped), rel=1e-5)
        assert m["async/is_weight_max"] == pytest.approx(max(capped), rel=1e-5)
        assert m["async/is_truncated_share"] == pytest.approx(sum(w > 1.1 for w in weights) / len(weights))
        truncated_somewhere |= any(w > 1.1 for w in weights)
        untruncated_somewhere |= any(w < 1.1 for w in weights)
    assert truncated_somewhere and untruncated_somewhere


@pytest.mark.parametrize("flags,message", [
    (["--max-staleness", "-1"], "--max-staleness takes 0"),
    (["--max-staleness", "1", "--is-cap", "0.5"], "--is-cap 1 or more"),
    (["--max-staleness", "1", "--agent", "reflect"], "reflect"),
])
def test_bad_staleness_flags_stop_with_a_sentence(flags, message, tmp_path):
    args = train.parse_args(["--out-dir", str(tmp_path), *flags])
    with pytest.raises(SystemExit, match=message):
        train.check(args, 1)


def test_versions_follow_every_row_layout():
    """Each sampled token carries its turn's version into the batch: a trajectory a row, packed rows, and
    --reasoning drop's row per turn."""
    from rl.batch import arrange, make_batch, rows_of
    from rollout import Trajectory

    def played(versions, drop=False):
        traj = Trajectory("babyai", 1, 0, 0, [])
        traj.add([1, 2, 3])  # the prompt
        for turn, version in enumerate(versions):
            traj.add([10 + turn, 11 + turn], [-0.5, -0.25], trained=True)
            traj.add([4, 5])  # the observation
            if drop:
                traj.sequences.append(([1, 2, 3, 10 + turn, 11 + turn], [0, 0, 0, 1, 1], [0, 0, 0, -0.5, -0.25]))
        traj.versions = list(versions)
        return traj

    traj = played([3, 4, 4])
    assert traj.token_versions() == [-1] * 3 + [3, 3, -1, -1, 4, 4, -1, -1, 4, 4, -1, -1]
    for pack in (False, True):
        rows = [played([3, 4, 4]), played([5])]
        layout = arrange([len(t.token_ids) for t in rows], 2, 64 if pack else 0, pack)
        batch = make_batch(rows, 0, layout, "cpu", pack=pack)
        mask = batch.full.loss_mask > 0
        assert batch.full.versions[mask].tolist() == [3, 3, 4, 4, 4, 4, 5, 5]
        micro = batch.micro[0]
        assert sorted(micro.versions[micro.loss_mask > 0].tolist()) == [3, 3, 4, 4, 4, 4, 5, 5]
    rows, episodes = rows_of([played([3, 4, 4], drop=True)])
    assert [row.token_versions()[-2:] for row in rows] == [[3, 3], [4, 4], [4, 4]] and episodes == [0, 0, 0]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_lora_minibatches_and_evaluation_under_staleness(ragged, tmp_path):
    """The crossing a real run meets: the continuous vLLM engine (turns resubmitted as envs answer, advanced between
    the update's micro-batches, its weights changed only between advance and resume), LoRA merged into it, two
    mini-batches (proximal log-probs computed apart), and evaluations on envs of their own while sets are under way."""
    metrics, rollouts = run(tmp_path, "crossing", "--engine", "vllm", "--max-staleness", "2", "--lora-rank", "8",
                            "--minibatches", "2", "--eval-every", "2", "--eval-tasks", "3", "--steps", "4")
    assert [m["charts/step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert all("eval/success" in m for m in (metrics[0], metrics[2], metrics[4]))
    for record in rollouts:
        assert all(record["step"] - 3 <= v <= record["step"] - 1 for v in record["versions"])
    assert all(m["sync/probe_diff"] < 1e-3 for m in metrics[1:])  # every in-flight sync checked
    assert any(m["async/staleness_mean"] > 0 for m in metrics[1:])


def test_env_delay_is_checked_before_anything_loads(tmp_path):
    args = train.parse_args(["--out-dir", str(tmp_path), "--env-delay", "webarena*fast"])
    with pytest.raises(SystemExit, match="--env-delay 'webarena\\*fast' is not a delay"):
        train.check(args, 1)
    train.check(train.parse_args(["--out-dir", str(tmp_path), "--env-delay", "webarena*0.5"]), 1)


def test_each_turn_records_the_weights_that_sampled_it_on_the_trainers_own_model(ragged, tmp_path, monkeypatch):
    """The HF engine samples with the trainer's own model: no turn of it is generated between the update and the
    sync (the weights there are already the next version's), so every turn's recorded version is the number of
    updates its weights had had when it was sampled."""
    import rl.engines
    import rollout

    updates, wrong = [0], []
    original_update, original_poll, original_take = train.update, rl.engines.RoundEngine.poll, rollout.Rollouts.take

    def counted_update(*args, **kwargs):
        result = original_update(*args, **kwargs)
        updates[0] += 1
        return result

    def noted_poll(self):
        answered = original_poll(self)
        for traj, _ in answered:
            traj.__dict__.setdefault("sampled_by", []).append(updates[0])
        return answered

    def checked_take(self, j, *args, **kwargs):
        taken = original_take(self, j, *args, **kwargs)
        wrong.extend((j, t.versions, t.sampled_by) for t in taken if t.versions != t.__dict__.get("sampled_by", []))
        return taken

    monkeypatch.setattr(train, "update", counted_update)
    monkeypatch.setattr(rl.engines.RoundEngine, "poll", noted_poll)
    monkeypatch.setattr(rollout.Rollouts, "take", checked_take)
    metrics, _ = run(tmp_path, "hf", "--engine", "hf", "--max-staleness", "2", "--steps", "4", "--eval-every", "0")
    assert len(metrics) == 4 and wrong == []
