"""scripts/bench.py: the env section end to end on two envs, and the table of every section's figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402


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
    assert results["env"]["peak_gib"] > 0 and results["machine"]["cpus"] >= 1


def test_outcomes_compare_what_each_env_keeps_fixed():
    transcript = ["first observation", ("objects in hash order", 0.0, False), ("done", 1.0, True)]
    assert bench.outcomes("babyai", transcript) == transcript
    assert bench.outcomes("sciworld", transcript) == [(0.0, False), (1.0, True)]


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
    text = bench.table(results)
    assert "300 / 100 = 3.0x" in text and "no chromium" in text
    assert "| rollout | vLLM / HF rollout tokens/s | 4.0x |" in text
    assert "| update | ours: padding share | 3.0% | <= 5% |" in text
    assert "| trl | failed | RuntimeError: pip could not install trl | |" in text
    results["trl"] = {"trl": "1.16.0", "update_tokens_per_s": 1500.0, "update_padding_share": 0.4, "update_peak_gib": 1.0}
    assert "| trl | ours / TRL update tokens/s | 2.00x | >= 1.5x |" in bench.table(results)
