"""End to end on the embedded model: train.py runs, changes the weights, writes a checkpoint and a
rollout log; eval.py scores the checkpoint; bad settings stop early with a message."""

import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import envs
import eval as eval_script
from rl.flags import build
import train
from envs.babyai import BabyAI
from rl import advantages as adv_lib
from rl import losses
from rl import plots
from rl import zero3
from rl.engines.setup import engine_kind
from rl.metrics import UpdateSums
from rl.model import EMBEDDED, Models, context_limit
from rl.optimizer import count_nonfinite
from rl.run import Logs, find_checkpoint, held_out_line, sample_table
from rl.batch import arrange, make_batch
from rl.records import decode_array
from rl.scores import gain
from rollout import Trajectory



# every step's metrics (docs/viewer-and-metrics.md, "Metrics")
STEP_METRICS = [
    "rollout/reward", "rollout/success", "rollout/turns", "rollout/horizon", "rollout/errors",
    "finish/done", "finish/horizon", "finish/max_tokens", "finish/error", "rollout/invalid_action_rate",
    "rollout/zero_variance_groups", "rollout/dynamic_groups", "rollout/dynamic_rounds", "rollout/tokens", "rollout/action_tokens", "rollout/advantage_mean",
    "rollout/advantage_abs", "rollout/logprob_diff", "rollout/logprob_diff_max",
    "mismatch/kl", "mismatch/truncated", "mismatch/masked", "mismatch/masked_tokens", "mismatch/ratio_max",
    "perf/env_call_s", "perf/env_call_p95_s", "perf/env_wait_share", "perf/tokens_per_s", "perf/rollout_s",
    "perf/generate_s", "perf/update_s", "perf/update_tokens_per_s", "perf/update_padding_share",
    "perf/rollout_peak_gib", "perf/update_peak_gib", "perf/step_s",
    "losses/policy", "losses/kl", "losses/entropy", "losses/clipfrac", "losses/ppo_kl", "losses/grad_norm",
    "losses/nonfinite_updates", "charts/lr", "charts/step",
]


def tiny_args(tmp_path, **overrides):
    argv = ["--steps", "2", "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "16",
            "--out-dir", str(tmp_path), "--run-name", "t"]
    for key, value in overrides.items():
        argv += [f"--{key.replace('_', '-')}", *([str(value)] if not isinstance(value, list) else map(str, value))]
    return train.parse_args(argv)


@pytest.mark.slow
def test_training_changes_weights_and_writes_a_checkpoint(trained):
    ckpt = trained / "checkpoints" / "step_2"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "state").is_dir()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["nonfinite_streak"] == {"policy": 0}
    # how far the logs got, for a resume to cut them back to: here, all of them
    assert state["logs"] == {name: (trained / name).stat().st_size for name in Logs.FILES}
    # nothing a resume would unpickle: weights and state in safetensors, the rest JSON
    assert {p.suffix for p in ckpt.rglob("*") if p.is_file()} <= {".safetensors", ".json", ".jinja"}
    before = load_file(EMBEDDED["tiny-agent"] / "model.safetensors")
    after = load_file(ckpt / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not list(trained.glob("checkpoints/*.tmp"))


@pytest.mark.slow
def test_rollout_log_has_every_trajectory(trained):
    lines = [json.loads(line) for line in (trained / "rollouts.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2  # steps x tasks x samples
    for record in lines:
        assert record["item_id"].startswith("babyai_")
        assert record["messages"][0]["role"] == "user" and record["messages"][1]["role"] == "assistant"
        assert 1 <= record["turns"] <= 2 and isinstance(record["reward"], float)
    assert {r["step"] for r in lines} == {1, 2}
    for record in lines:  # the exact tokens, which of them were sampled (and trained on), and what the update saw
        assert record["log_format"] == 2 and record["horizon"] == 2 and record["finish"] in ("done", "horizon")
        assert record["task_id"] == int(record["item_id"].split("_")[1])
        assert record["category"] == envs.category("babyai", record["task_id"])
        assert len(decode_array(record["token_ids"])) == record["tokens"]
        assert sum(end - start for start, end in record["action_spans"]) == record["action_tokens"] > 0
        sampled, trainer = decode_array(record["sampled_logprobs"]), decode_array(record["trainer_logprobs"])
        assert len(sampled) == len(trainer) == record["action_tokens"]
        assert max(abs(a - b) for a, b in zip(sampled, trainer)) < 1e-3 and max(sampled) <= 0
        assert isinstance(record["advantages"], float)  # GRPO: one advantage for the whole trajectory
        assert 0 <= record["invalid_actions"] <= record["turns"]
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == [0, 1, 2]  # step 0: the initial policy's evaluation
    metrics = metrics[1:]
    for m in metrics:  # every metric the docs list, grouped by name
        assert set(STEP_METRICS) <= set(m), set(STEP_METRICS) - set(m)
        assert sum(m[f"finish/{name}"] for name in ("done", "horizon", "max_tokens", "error")) == pytest.approx(1)
        categories = {r["category"] for r in lines if r["step"] == m["charts/step"]}
        assert {key.split("/")[1] for key in m if key.startswith("category/")} == categories
        assert 0 <= m["rollout/invalid_action_rate"] <= 1 and 0 <= m["rollout/zero_variance_groups"] <= 1
        assert 0 < m["perf/env_call_s"] <= m["perf/env_call_p95_s"] * 20 and 0 <= m["perf/env_wait_share"] < 1
    assert all(m["perf/tokens_per_s"] > 0 and m["rollout/horizon"] == 2 for m in metrics)
    assert all(m["perf/update_tokens_per_s"] > 0 and 0 <= m["perf/update_padding_share"] < 1 for m in metrics)
    assert all(m["perf/rollout_peak_gib"] > 0.1 and m["perf/update_peak_gib"] > 0.1 for m in metrics)
    assert all(m["rollout/logprob_diff"] < 1e-5 for m in metrics)  # the sampler's log-probs are the trainer's
    if engine_kind("auto") == "vllm":  # the default engine where vLLM is installed (CI): synced and checked
        assert all(m["sync/probe_diff"] < 1e-3 and m["perf/prefix_hit_rate"] > 0 for m in metrics)
    config = json.loads((trained / "config.json").read_text())
    assert config["preset"] == "tiny" and config["env"] == ["babyai"]  # (the run's envs: one)


@pytest.mark.slow
def test_eval_every_plays_the_test_tasks(trained):
    """--eval-every 2 of 2 steps: the initial policy (step 0) and step 2 play the same test tasks (the tiny
    preset's on BabyAI), and the run ends on the held-out comparison of the two."""
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert ["eval/success" in m for m in metrics] == [True, False, True]
    episodes = [json.loads(line) for line in (trained / "evaluations.jsonl").read_text().splitlines()]
    test = envs.load_task_ids(envs.DATA_DIR / "babyai_tiny_test.json", "babyai")
    assert [e["item_id"] for e in episodes] == 2 * [f"babyai_{i}" for i in eval_script.spread(test, 4) for _ in "kk"]
    assert [e["step"] for e in episodes] == [0] * 8 + [2] * 8 and all(1 <= e["turns"] <= 2 for e in episodes)
    assert metrics[2]["eval/avg@k"] == pytest.approx(sum(e["reward"] for e in episodes[8:]) / 8)  # --eval-k 2
    assert metrics[0]["eval/horizon"] == metrics[2]["eval/horizon"] == 2
    line = held_out_line(trained)
    assert line.startswith("held-out success ") and "4 test tasks x 2 episodes, step 0 vs step 2" in line


@pytest.mark.slow
def test_plots_of_a_run_and_an_eval(trained, tmp_path, monkeypatch):
    """The PNGs train.py and eval.py draw at their end (rl/plots.py runs scripts/plot.py): a run's curves, with a
    panel per metric group, and an eval result's Avg@k / Pass@k per category."""
    trained = shutil.copytree(trained, tmp_path / "run")  # (the shared run stays as train.py left it)
    monkeypatch.setenv("AGENTGYM_RL_PLOTS", "1")
    curves = plots.draw(trained)
    assert curves == trained / "curves.png" and curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"model": "m", "env": "babyai", "split": "test", "k": 2, "tasks": 3, "avg@k": 0.5,
                                  "pass@k": 0.67, "categories": {"GoTo": {"tasks": 3, "avg@k": 0.5, "pass@k": 0.67}}}))
    assert plots.draw(result) == tmp_path / "result.png" and (tmp_path / "result.png").stat().st_size > 1000
    (tmp_path / "broken.json").write_text("{")
    assert plots.draw(tmp_path / "broken.json") is None  # one line says why; nothing raised, nothing written
    assert not (tmp_path / "broken.png").exists()
    monkeypatch.setenv("AGENTGYM_RL_PLOTS", "0")
    assert plots.draw(trained) is None


def test_wandb_samples_are_the_best_and_worst_trajectories():
    records = [{"step": 3, "item_id": f"babyai_{i}", "category": "GoTo", "reward": r, "success": r > 0, "turns": 2,
                "finish": "done", "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]}
               for i, r in enumerate([0.0, 0.9, 0.2, 0.5, 0.0, 0.7])]
    columns, rows = sample_table(records, count=4)
    assert columns[:4] == ["step", "item_id", "category", "reward"] and len(rows) == 4
    assert [row[3] for row in rows] == [0.9, 0.7, 0.0, 0.0]
    assert rows[0][-1] == "[user] go\n\n[assistant] ok"
    assert len(sample_table(records[:2])[1]) == 2


def test_gain_is_paired_by_task():
    """Per-task success rates, paired: the gain is the mean difference, its 95% interval the normal one
    over the tasks' differences."""
    def episodes(rates):
        return [types.SimpleNamespace(task_id=task, success=s) for task, outcomes in rates.items() for s in outcomes]

    same = gain(episodes({1: [0, 0], 2: [1, 0], 3: [0, 0]}), episodes({1: [1, 0], 2: [1, 1], 3: [0, 1]}))
    assert same == pytest.approx({"before": 1 / 6, "after": 2 / 3, "gain": 0.5, "low": 0.5, "high": 0.5, "tasks": 3})
    mixed = gain(episodes({1: [0], 2: [1], 3: [1], 4: [0], 5: [1]}), episodes({1: [1], 2: [1], 3: [0], 4: [1], 9: [1]}))
    half = 1.96 * ((0.75 ** 2 * 2 + 0.25 ** 2 + 1.25 ** 2) / 3 / 4) ** 0.5  # differences 1, 0, -1, 1; tasks 5, 9 unpaired
    assert mixed["tasks"] == 4 and mixed["gain"] == pytest.approx(0.25)
    assert (mixed["low"], mixed["high"]) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    with pytest.raises(ValueError, match="no task in common"):
        gain(episodes({1: [1]}), episodes({2: [1]}))


@pytest.mark.slow
def test_eval_scores_the_checkpoint(trained, tmp_path):
    ckpt = trained / "checkpoints" / "step_2"
    out = tmp_path / "result"
    results = eval_script.main(build(eval_script.Args, model=str(ckpt), limit=3, k=2, out=str(out)))
    assert results["env"] == "babyai" and results["horizon"] == 2  # the run's own settings
    assert results["protocol"] == "run" and results["overrides"] == []
    assert results["tasks"] == 3 and 0.0 <= results["avg@k"] <= 1.0 and 0.0 <= results["pass@k"] <= 1.0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["avg@k"] == results["avg@k"]
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 6


def test_avg_and_pass_at_k_by_hand():
    """Three tasks, k = 3, raw scores as the env gives them: Avg@k is the mean of all nine, Pass@k the
    share of tasks with a score above 0 in any episode; per category the same over its tasks."""
    scores = {0: [0.0, 0.5, 0.0], 1: [0.0, 0.0, 0.0], 11: [1.0, 0.9, 0.8]}  # GoTo, GoTo, Open
    episodes = [types.SimpleNamespace(task_id=task, reward=r, success=r > 0, turns=2, finish="done", error=None)
                for task, rewards in scores.items() for r in rewards]
    results = eval_script.score(episodes, "babyai")
    assert results["tasks"] == 3
    assert results["avg@k"] == pytest.approx(3.2 / 9) and results["pass@k"] == pytest.approx(2 / 3)
    assert set(results["categories"]) == {"GoTo", "Open"}
    goto, open_ = results["categories"]["GoTo"], results["categories"]["Open"]
    assert (goto["tasks"], goto["avg@k"], goto["pass@k"]) == (2, pytest.approx(0.5 / 6), pytest.approx(0.5))
    assert (open_["tasks"], open_["avg@k"], open_["pass@k"]) == (1, pytest.approx(0.9), pytest.approx(1.0))


@pytest.mark.slow
def test_eval_protocols(trained):
    """A checkpoint plays by its run's limits unless told to play by upstream's evaluation, which
    has its own turn cap per env, 512 tokens a turn (200 for SciWorld) and a 32k context."""
    ckpt = str(trained / "checkpoints" / "step_2")
    def resolve(args):
        return eval_script.resolve_settings(args, eval_script.eval_envs(args)[0])

    run = resolve(build(eval_script.Args, model=ckpt))
    assert (run["protocol"], run["horizon"], run["max_new_tokens"], run["max_tokens"]) == ("run", 2, 16, 3072)
    upstream = resolve(build(eval_script.Args, model=ckpt, protocol="agentgym"))
    assert (upstream["env"], upstream["horizon"], upstream["max_new_tokens"], upstream["max_tokens"]) == ("babyai", 20, 512, 32768)
    sciworld = resolve(build(eval_script.Args, model=str(EMBEDDED["tiny-agent"]), env="sciworld"))  # (a directory)
    assert (sciworld["protocol"], sciworld["horizon"], sciworld["max_new_tokens"]) == ("agentgym", 30, 200)
    flagged = resolve(build(eval_script.Args, model=ckpt, protocol="agentgym", horizon=5))
    assert flagged["horizon"] == 5 and flagged["overrides"] == ["horizon"] and flagged["max_new_tokens"] == 512
    assert resolve(build(eval_script.Args))["protocol"] == "tiny"
    with pytest.raises(SystemExit, match="--protocol run takes a checkpoint"):
        resolve(build(eval_script.Args, model="Qwen/Qwen2.5-7B-Instruct", protocol="run"))


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(trained, tmp_path):
    trained = shutil.copytree(trained, tmp_path / "run")  # (the shared run stays as train.py left it)
    ckpt = trained / "checkpoints" / "step_2"
    args = train.parse_args(["--resume", str(ckpt), "--steps", "3"])
    run_dir = train.main(args)
    assert run_dir == trained
    steps = [json.loads(line)["charts/step"] for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert (trained / "checkpoints" / "step_3" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_resumed_run_equals_the_uninterrupted_run(tmp_path, algo):
    """Stopped after step 1 and resumed, a run logs the same metrics, step for step, as one that never
    stopped: the sampler's random stream, optimizers, critic and data order all continue. On the HF
    engine: vLLM's sampling stream is not restored (see rl/engines/vllm.py, VLLMEngine, "seeds")."""
    flags = {"engine": "hf", "algo": algo, "n": 2, "lr": 0.01, "critic_lr": 0.01, "ppo_epochs": 2}
    whole = train.main(tiny_args(tmp_path / "whole", steps=3, **flags))
    part = train.main(tiny_args(tmp_path / "part", steps=1, **flags))
    config = (part / "config.json").read_text()
    train.main(train.parse_args(["--resume", str(part / "checkpoints" / "step_1"), "--steps", "3"]))
    assert (part / "config.json").read_text() == config  # the run's settings, not overwritten

    def metrics(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]

    assert [m["charts/step"] for m in metrics(part)] == [1, 2, 3]
    for resumed, uninterrupted in zip(metrics(part), metrics(whole)):
        assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-9)
    rollouts = [[json.loads(line)["messages"] for line in (d / "rollouts.jsonl").read_text().splitlines()]
                for d in (part, whole)]
    assert rollouts[0] == rollouts[1]


@pytest.mark.slow
def test_resume_keeps_the_runs_settings(trained):
    ckpt = str(trained / "checkpoints" / "step_2")
    args = train.parse_args(["--resume", ckpt, "--steps", "5"])  # the flags RESUMABLE allows
    assert args.steps == 5 and args.model_args.lr == 1e-4 and args.model == "tiny-agent" and args.tasks_per_step == 2
    for flag, value in (["--lr", "0.5"], ["--algo", "rloo"], ["--model", "Qwen/Qwen2.5-3B-Instruct"], ["--seed", "7"],
                        ["--n", "4"], ["--run-name", "another"]):
        with pytest.raises(SystemExit, match=f"changes {flag} "):
            train.parse_args(["--resume", ckpt, flag, value])
    with pytest.raises(SystemExit, match="not a checkpoint of a run"):
        train.parse_args(["--resume", str(trained / "checkpoints")])
    newest = find_checkpoint(str(trained), "runs", None)  # a run directory: its newest complete checkpoint
    assert newest == max(trained.glob("checkpoints/step_*"), key=lambda p: int(p.name.split("_")[1]))
    with pytest.raises(SystemExit, match="--resume auto continues the run named by --run-name"):
        train.parse_args(["--resume", "auto"])


def test_presets_follow_the_model():
    assert train.parse_args([]).preset == "tiny"
    paper = train.parse_args(["--model", "Qwen/Qwen2.5-3B-Instruct"])
    assert paper.preset == "paper" and paper.model_args.lr == 1e-6 and paper.objective.kl_coef == 0.001 and paper.objective.clip == 0.2
    assert paper.objective.entropy_coef == 0.001 and paper.engine_args.temperature == 1.0
    assert train.parse_args(["--lr", "0.5"]).model_args.lr == 0.5  # a flag overrides the preset
    tiny = train.parse_args([])  # on BabyAI, the tiny preset's tasks are the levels where the tiny agent learns
    assert Path(tiny.train_tasks).name == "babyai_tiny_train.json" and Path(tiny.test_tasks).name == "babyai_tiny_test.json"
    assert train.parse_args(["--env", "textcraft"]).train_tasks is None and paper.train_tasks is None
    assert train.parse_args(["--train-tasks", "mine.json"]).train_tasks == "mine.json"


@pytest.mark.parametrize("argv, message", [
    (["--env", "nope"], "unknown env"),
    (["--n", "1"], "--n 2 or more"),
    (["--max-new-tokens", "9000", "--max-tokens", "100"], "smaller than --max-tokens"),
    (["--horizon", "20", "10"], "only grow"),
    (["--horizon", "0"], "at least 1"),
    (["--dual-clip", "0.5"], "larger than 1"),
    (["--algo", "rloo", "--n", "1"], "--n 2 or more"),
    (["--tasks-per-step", "2", "--n", "4", "--micro-batch-size", "4", "--minibatches", "3"], "micro-batches"),
    (["--algo", "ppo", "--mixed-precision", "fp16"], "bf16"),
    (["--minibatches", "0"], "--minibatches must be at least 1"),
    (["--ppo-epochs", "0"], "--ppo-epochs must be at least 1"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--critic-warmup", "3"], "use it with --algo ppo"),
    (["--vllm-gpu-memory-utilization", "1.5"], "in (0, 1]"),
    (["--vllm-max-model-len", "100"], "could not hold a whole trajectory"),
    (["--vllm-tensor-parallel-size", "2"], "train with --rollout-server"),
    (["--agent", "reflect", "--attempts", "0"], "--attempts must be at least 1"),
    (["--algo", "sft", "--agent", "plan", "--data", "x.json"], "plays them as react"),
])
def test_bad_settings_stop_early(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        train.check(train.parse_args(argv), world=1)
    assert message in str(stop.value)


@pytest.mark.slow
def test_reference_equals_the_policy_at_the_first_update(tmp_path):
    """Policy and reference start from the same weights and run the same way (fp32 under bf16 autocast
    here), so the KL of the first update, before any optimizer step, is exactly 0."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the process's other runs are fp32
    try:
        run_dir = train.main(tiny_args(tmp_path, steps=1, mixed_precision="bf16"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text())
    assert metrics["losses/kl"] == 0.0


def test_launches_that_cannot_work_are_refused():
    for distributed in ("MULTI_GPU", "FSDP", "DEEPSPEED"):  # data-parallel and sharded runs
        train.check(train.parse_args([]), world=2, distributed=distributed)
    with pytest.raises(SystemExit, match="configs/zero3.yaml"):
        train.check(train.parse_args([]), world=2, distributed="MEGATRON_LM")
    for distributed in ("FSDP", "DEEPSPEED"):
        with pytest.raises(SystemExit, match="agentevol resets"):
            train.check(train.parse_args(["--algo", "agentevol", "--data", "x.jsonl"]), world=2, distributed=distributed)
        with pytest.raises(SystemExit, match="offload"):
            train.check(train.parse_args(["--offload-reference"]), world=2, distributed=distributed)


def test_deepspeed_runs_at_zero3_with_one_micro_batch_per_engine_step():
    """rl/zero3.py settles DeepSpeed's config: ZeRO-3 only, no fp16 (its loss-scaler skips would pass for NaN
    steps), the engine stepping once per train.py step (no accumulation or loss scaling of its own), --grad-clip."""
    def accelerator(config):
        plugin = types.SimpleNamespace(deepspeed_config=config)
        return types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)

    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4, "bf16": {"enabled": True}}
    zero3.configure(accelerator(config), grad_clip=0.5)
    assert config["gradient_accumulation_steps"] == 1 and config["train_micro_batch_size_per_gpu"] == 1
    assert config["train_batch_size"] == 2 and config["data_types"]["grad_accum_dtype"] == "fp32"
    assert config["gradient_clipping"] == 0.5 and config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    with pytest.raises(SystemExit, match="stage 2"):
        zero3.configure(accelerator({"zero_optimization": {"stage": 2}}), grad_clip=1.0)
    with pytest.raises(SystemExit, match="bf16"):
        zero3.configure(accelerator({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}), grad_clip=1.0)


def test_unknown_flag_is_rejected():
    with pytest.raises(SystemExit):
        train.parse_args(["--no-such-flag", "1"])


class Flaky(BabyAI):
    """BabyAI whose infrastructure fails: resets of task ids divisible by 3 and steps of even ids raise."""

    name = "flaky"

    def reset(self, task_id):
        if task_id % 3 == 0:
            raise ConnectionError("simulator is gone")
        return super().reset(task_id)

    def step(self, text):
        if self.task_id % 2 == 0:
            raise TimeoutError("no answer in 60 s")
        return super().step(text)


@pytest.mark.slow
def test_env_failures_end_one_trajectory_not_the_run(monkeypatch, tmp_path):
    flaky_env(monkeypatch, tmp_path)
    run_dir = train.main(tiny_args(tmp_path, env="flaky", tasks_per_step=6, steps=1, env_timeout=30, max_error_rate=1))
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    failed = [r for r in records if r["error"]]
    doomed = [r for r in records if int(r["item_id"].split("_")[1]) % 2 == 0 or int(r["item_id"].split("_")[1]) % 3 == 0]
    assert failed == doomed
    assert all(r["finish"] == "error" and r["reward"] == 0.0 for r in failed)
    assert any("reset failed: ConnectionError" in r["error"] for r in failed)
    assert any("step failed: TimeoutError" in r["error"] for r in failed)
    assert len(failed) < len(records)  # the healthy ones played on
    metrics = json.loads((run_dir / "metrics.jsonl").read_text())
    assert metrics["rollout/errors"] == len(failed)
    assert math.isfinite(metrics["losses/policy"]) and math.isfinite(metrics["losses/grad_norm"])
    assert (run_dir / "checkpoints" / "step_1" / "model.safetensors").is_file()


def flaky_env(monkeypatch, tmp_path):
    ids = tmp_path / "ids.json"
    envs.save_task_ids(ids, "flaky", list(range(120, 132)))
    module = types.SimpleNamespace(make=lambda **_: Flaky(), category=lambda _: "all", default_split_files=lambda: (ids, ids))
    monkeypatch.setitem(sys.modules, "flaky_env", module)
    monkeypatch.setitem(envs.ENVS, "flaky", envs.Registration("flaky_env", call_timeout=60.0, upstream_horizon=2))


@pytest.mark.slow
def test_too_many_env_failures_stop_the_run_before_the_update(monkeypatch, tmp_path):
    flaky_env(monkeypatch, tmp_path)
    with pytest.raises(SystemExit, match=r"step 1: \d+ of 12 trajectories ended in an env failure, more than "
                                         r"--max-error-rate 0.25; most common: \d+ x (reset|step) failed"):
        train.main(tiny_args(tmp_path, env="flaky", tasks_per_step=6, steps=2, env_timeout=30))
    run_dir = tmp_path / "t"
    records = [json.loads(line) for line in (run_dir / "failed_step_1.jsonl").read_text().splitlines()]
    assert len(records) == 12 and sum(r["error"] is not None for r in records) > 3
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").read_text()  # nothing trained


def nan_policy_loss(monkeypatch):
    real = losses.policy_loss

    def poisoned(*args, **kwargs):
        loss, clipped = real(*args, **kwargs)
        return loss * float("nan"), clipped

    monkeypatch.setattr(losses, "policy_loss", poisoned)


@pytest.mark.slow
def test_a_nan_loss_skips_the_update(monkeypatch, tmp_path, capsys):
    nan_policy_loss(monkeypatch)
    run_dir = train.main(tiny_args(tmp_path, lr=0.01, engine="hf"))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["losses/nonfinite_updates"] for m in metrics] == [1, 1]
    assert "NaN or infinite policy loss or gradient, optimizer step skipped (2 in a row)" in capsys.readouterr().out
    before = load_file(EMBEDDED["tiny-agent"] / "model.safetensors")
    after = load_file(run_dir / "checkpoints" / "step_2" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step was taken


@pytest.mark.slow
def test_repeated_nan_updates_stop_the_run_and_keep_the_batch(monkeypatch, tmp_path):
    nan_policy_loss(monkeypatch)
    with pytest.raises(SystemExit, match="step 2: 2 optimizer steps in a row had a NaN or infinite loss"):
        train.main(tiny_args(tmp_path, steps=3, max_nonfinite_updates=2, engine="hf"))
    batch = load_file(tmp_path / "t" / "nonfinite_step_2" / "batch_0.safetensors")
    assert {"input_ids", "loss_mask", "sampler_logprobs", "advantages", "scores"} <= batch.keys()
    assert batch["input_ids"].shape[0] == 4


def test_truncated_trajectories_are_trained_on_their_reward_failed_ones_not_at_all():
    """The rule for an episode that ran out of tokens: scored by its last reward like one cut by the
    horizon, and trained with the advantage that reward earns in its group; an env failure has no
    outcome and is left out of the group and the update."""
    def played(reward, finish, error=None):
        traj = Trajectory("babyai", 1, 0, 0, [])
        traj.add([1, 2, 3])
        traj.add([4, 5], [-0.5, -0.5], trained=True)
        traj.reward, traj.finish, traj.error = reward, finish, error
        return traj

    trajectories = [played(1.0, "done"), played(0.5, "max_tokens"), played(0.0, "horizon"), played(0.0, "error", "x")]
    batch = make_batch(trajectories, 0, arrange([len(t.token_ids) for t in trajectories], 4), "cpu")
    args = tiny_args(Path("/tmp/unused"))
    advantages, _ = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, None)
    per_trajectory = advantages[:, 3]  # the first trained token
    expected = adv_lib.grpo(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([0, 0, 0]))
    assert torch.allclose(per_trajectory[:3], expected) and per_trajectory[1] == 0  # 0.5 is the group's mean
    assert batch.full.loss_mask[1].sum() == 2 and batch.full.loss_mask[3].sum() == 0
    assert per_trajectory[3] == 0


def test_the_token_budget_stays_within_the_models_context_window():
    args = tiny_args(Path("/tmp/unused"), max_tokens=4096)
    config = types.SimpleNamespace(max_position_embeddings=1024)
    assert context_limit(args.max_tokens, args.model, config) == 1024
    config.max_position_embeddings = 32768
    assert context_limit(args.max_tokens, args.model, config) == 4096


def test_each_model_keeps_its_own_nan_streak():
    """PPO with a policy whose loss is NaN every step and a healthy critic still stops: the critic's good
    steps do not end the policy's streak."""
    models = Models(None, None, None)
    accelerator = types.SimpleNamespace(is_main_process=False, process_index=0)
    sums = UpdateSums()
    for _ in range(3):
        count_nonfinite(models, sums, "policy", 1, True, accelerator)
        count_nonfinite(models, sums, "critic", 1, False, accelerator)
    assert models.nonfinite_streak == {"policy": 3, "critic": 0} and sums.nonfinite_updates == 3


def test_micro_batches_accumulate_unsynced_except_under_fsdp2():
    """rl/optimizer.gradient_sync: data-parallel runs skip the all-reduce until a mini-batch's last micro-batch;
    FSDP2 reduce-scatters every one (unsynced, each GPU would hold the whole unsharded gradient in between)."""
    import contextlib

    from rl.optimizer import gradient_sync

    for kind, skipped in (("MULTI_GPU", True), ("FSDP", False)):
        entered = []
        accelerator = types.SimpleNamespace(distributed_type=kind, no_sync=lambda m: entered.append(m) or contextlib.nullcontext())
        with gradient_sync(accelerator, ["policy", "critic"], now=False):
            pass
        with gradient_sync(accelerator, ["policy", "critic"], now=True):
            pass
        assert entered == (["policy", "critic"] if skipped else []), kind


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["plan", "reflect"])
def test_training_lays_rollouts_out_by_the_agent_format(tiny_run, agent):
    """--agent reaches the rollouts: plan's instruction asks for a plan, reflect's failed attempts are retried with
    their reflections, each attempt a trajectory of its own group, and the step trains on all of them."""
    from rl.agent import PLAN_GUIDE, REFLECTIONS

    run_dir, records, _ = tiny_run("babyai", "--agent", agent, "--attempts", "2", evaluate=False)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "config.json").read_text())["agent"] == agent
    assert math.isfinite(metrics[-1]["losses/policy"])
    if agent == "plan":
        assert len(records) == 4 and all(PLAN_GUIDE in r["messages"][0]["content"] for r in records)
        return
    retried = [r for r in records if r.get("attempt") == 2]
    assert len(records) == 4 + len(retried) and retried, "every first attempt succeeded: no retry to check"
    assert all(REFLECTIONS in r["messages"][0]["content"] for r in retried)
    assert {r["group"] for r in retried}.isdisjoint({r["group"] for r in records if r.get("attempt", 1) == 1})
    assert metrics[-1]["rollout/trajectories"] == len(records)


def counted_loads(monkeypatch) -> list[int]:
    """Every weight load into the engines train.py builds from here on (a load is a probe in process, a broadcast
    and a version on a rollout server): the step of the trainer's optimizer at each."""
    loads, build = [], train.build_engine

    def counting(*args, **kwargs):
        engine = build(*args, **kwargs)
        load = engine.load_weights
        engine.load_weights = lambda model, **options: loads.append(0) or load(model, **options)
        return engine

    monkeypatch.setattr(train, "build_engine", counting)
    return loads


@pytest.mark.slow
def test_one_sync_per_new_weights(monkeypatch, tmp_path):
    """An evaluation plays the weights the engine already has: RL's loop syncs them after each update (and once at
    the start), agentevol's before the test split after its training, never again before exploring with them."""
    loads = counted_loads(monkeypatch)
    train.main(tiny_args(tmp_path, engine="hf", eval_every=1, eval_tasks=1, eval_k=1, n=2, horizon=1))
    assert len(loads) == 3  # (the start and steps 1, 2; the evaluations at steps 0, 1 and 2 load nothing)
