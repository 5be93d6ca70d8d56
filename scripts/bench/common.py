"""What every section of scripts/bench.py shares: its flags (`Args`), the paths, the process helpers (a free
loopback port, a process's CPU seconds, a train.py run read off its metrics.jsonl) and the plots' (`pyplot`, `save`)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench.py"  # (each section's process runs it again, with --phase)
SECTIONS = ("env", "rollout", "server", "weights", "update", "async", "trl", "engine", "bare", "context")
QUICK = ("env", "rollout", "update")  # the default: minutes on 2 cores; the others are opt-in by --sections
TRL_VERSION = "1.16.0"


@dataclass
class Args:
    sections: tuple[Literal["env", "rollout", "server", "weights", "update", "async", "trl", "engine", "bare",
                            "context"], ...] = QUICK
    """which sections to run, in this order (trl and bare need update's trajectories: they run update when left out);
    the default leaves out the long ones (server, async, context: tens of minutes on 2 cores; weights: several
    rollout servers), trl (installs TRL), engine and bare"""
    out: str = "runs/bench.json"
    """where the JSON results go"""
    model: str = "tiny-agent"
    """rollout, update, trl: Hugging Face id or local directory"""

    # -- env
    envs: tuple[str, ...] = ("babyai", "textcraft", "sciworld", "searchqa", "webarena")
    """env: the envs timed in process and over HTTP"""
    episodes: int = 40
    """oracle episodes per env (SciWorld and WebArena: a quarter, their episodes are long and slow)"""
    standards: tuple[Literal["gym", "openenv", "verifiers"], ...] = ("gym", "openenv", "verifiers")
    """env: the standards each env is replayed through too (scripts/bench/env.py; openenv and verifiers need
    requirements-standards.txt)"""
    clients: int = 0
    """env: concurrent clients of the load test (0: no load test)"""
    malformed_every: int = 5
    """env load test: a malformed request after this many"""

    # -- rollout
    env: str = "babyai"
    """rollout, server: the env played"""
    tasks: int = 8
    """rollout, server: tasks, each played --n times (the embedded model's training step)"""
    n: int = 8
    """rollout, server: episodes per task"""
    horizon: int = 6
    """rollout, server: turn cap per episode"""
    max_new_tokens: int = 48
    """rollout, server: tokens per turn"""
    max_tokens: int = 3072
    """rollout, server: tokens per trajectory"""
    temperature: float = 1.0
    """rollout, server: sampling temperature"""
    env_delay: str = "0"
    """rollout, server: what env calls take longer (envs/latency.py): 0, SECONDS added to every step (a stand-in for
    slow simulators, browsers or search APIs), webarena (WebArena's measured steps and resets), webarena*X"""
    engines: tuple[str, ...] = ("hf", "vllm-rounds", "vllm")
    """rollout: which engines, in this order"""
    syncs: int = 5
    """rollout, server, weights: weight syncs timed (each with its probe check)"""
    repeats: int = 3
    """server: rollouts on each engine, alternated (the figures are medians)"""

    # -- weights
    weight_servers: int = 4
    """weights: the sync is timed to 1, 2, ... this many rollout servers"""
    weight_bucket_mb: int = 256
    """weights: the sync's bucket size (train.py --weight-bucket-mb)"""

    # -- engine
    engine_tasks: int = 4
    """engine: tasks of --env, each played --engine-n times (small: a real model on CPU)"""
    engine_n: int = 2
    """engine: episodes per task"""
    engine_horizon: int = 4
    """engine: turn cap per episode"""
    engine_max_new_tokens: int = 32
    """engine: tokens per turn"""

    # -- update, trl
    update_steps: int = 3
    """update: training steps of train.py (the first is warm-up)"""
    train_args: str = ""
    """update: more train.py flags, e.g. "--tasks-per-step 8 --n 4" for a real model"""
    trl_venv: str = "~/.cache/agentgym-rl/bench-trl-" + TRL_VERSION
    """trl: the throwaway venv TRL is installed into (made on first use)"""

    # -- async
    staleness: tuple[int, ...] = (1, 2, 4)
    """async: the --max-staleness values run beside the synchronous loop"""
    async_delay: str = "webarena*10"
    """async: the env latency workload (train.py --env-delay; envs/latency.py): WebArena's measured shape, its seconds
    x10 by default (the local pages answer in ~0.13 s; real sites, a search API or a simulator in seconds)"""
    async_steps: int = 8
    """async: training steps of each run"""
    seeds: tuple[int, ...] = (1,)
    """async: a run of each loop per seed (the reward's spread over seeds)"""
    async_args: str = ""
    """async: more train.py flags for every run, e.g. "--env textcraft" """

    # -- context
    contexts: tuple[str, ...] = ("full", "window:4", "summary:5")
    """context: the --context modes compared"""
    context_envs: tuple[str, ...] = ("sciworld", "webarena")
    """context: the envs they are compared on"""
    context_horizon: int = 20
    """context: the turn cap of every run"""
    context_steps: int = 2
    """context: training steps of each run"""
    context_args: str = "--tasks-per-step 4 --n 4 --max-tokens 8192"
    """context: more train.py flags for every run"""

    # -- internal: one section in a process of its own
    phase: Literal["env", "rollout", "server", "weights", "trl", "engine", "bare"] | None = None
    """internal: the section this process runs (bench.py starts one process per section)"""
    phase_out: str | None = None
    """internal: where that section's process writes its figures"""
    run_dir: str | None = None
    """internal: the update section's run, whose batches the trl and bare sections replay"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_metrics(section: str, command: list[str], run: Path) -> list[dict]:
    """Run `command` (a train.py run writing into `run`) and answer its metrics.jsonl's rows."""
    print(f"{section}: " + shlex.join(command), flush=True)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"train.py failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def pyplot():
    """matplotlib's pyplot drawing to files only, or None where matplotlib is not installed (the section's figure
    is then left out, its table kept)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(figure, path: Path) -> str:
    """Write `figure` to `path` (its folder made) and free it."""
    import matplotlib.pyplot as plt
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)
