"""In-process vs over-HTTP env steps/s for BabyAI and TextCraft, side by side, and the server under load.

    python scripts/bench_serve.py                                 # both envs, default sizes
    python scripts/bench_serve.py --envs textcraft --episodes 200 --clients 50 --out runs/bench.json

For each env, oracle episodes on the test split's tasks are recorded once in process (BabyAI's bot
cannot play a few levels: those tasks are skipped). The same tasks and the same response texts are then
replayed in process and through envs.make(name, url=...) against `python -m envs.serve` running in a
subprocess on loopback, and both must give the same observations, rewards and done. Steps/s counts the
step calls over the time of the resets and steps. Then --clients threads replay the episodes at once
through the server, each sending a malformed request after every --malformed-every steps, for
requests/s and errors (a good call that failed, a malformed one not answered 4xx, any 5xx), and the
server process's CPU time per request. Client and server share this machine's cores: compare the
columns within one run.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import envs  # noqa: E402

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


def record(name: str, task_ids: list[int], max_steps: int) -> list[tuple[int, list[str]]]:
    """(task id, the oracle's response texts) for each task the oracle finishes."""
    env, episodes = envs.make(name), []
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


def replay(env, episodes) -> tuple[int, float, list]:
    """Steps, seconds and the (observation, reward, done) of every call."""
    transcript, steps, start = [], 0, time.perf_counter()
    for task_id, texts in episodes:
        transcript.append(env.reset(task_id))
        for text in texts:
            result = env.step(text)
            transcript.append((result.observation, result.reward, result.done))
            steps += 1
    return steps, time.perf_counter() - start, transcript


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(name: str, clients: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "envs.serve", "--env", name, "--port", str(port),
                               "--max-envs", str(4 * clients + 16)], cwd=ROOT, stdout=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"the {name} server did not start")


def load(name: str, url: str, server_pid: int, episodes, clients: int, malformed_every: int) -> dict:
    """`clients` threads replay all episodes through the server at once, with malformed requests mixed in."""
    def client(share) -> dict:
        counts = {"requests": 0, "malformed": 0, "errors": 0}
        env = envs.make(name, url=url)
        counts["requests"] += 1
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


def bench(name: str, args) -> dict:
    episodes = record(name, envs.splits(name)["test"][:args.episodes], args.max_steps)
    server, url = start_server(name, args.clients)
    try:
        local_steps, local_s, local_transcript = replay(envs.make(name), episodes)
        remote, server_cpu = envs.make(name, url=url), cpu_seconds(server.pid)
        http_steps, http_s, http_transcript = replay(remote, episodes)
        server_cpu = cpu_seconds(server.pid) - server_cpu
        remote.close()
        assert http_transcript == local_transcript, f"{name}: the remote env answered differently"
        under_load = load(name, url, server.pid, episodes, args.clients, args.malformed_every)
    finally:
        server.terminate()
        server.wait(30)
    return {"episodes": len(episodes), "steps": local_steps,
            "in_process": {"seconds": local_s, "steps_per_s": local_steps / local_s},
            "http": {"seconds": http_s, "steps_per_s": http_steps / http_s,
                     "server_cpu_ms_per_call": 1000 * server_cpu / (http_steps + len(episodes))},
            "load": under_load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=["babyai", "textcraft"], choices=["babyai", "textcraft"])
    parser.add_argument("--episodes", type=int, default=100, help="test-split tasks per env (oracle episodes)")
    parser.add_argument("--max-steps", type=int, default=100, help="an oracle episode longer than this is dropped")
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients in the load test")
    parser.add_argument("--malformed-every", type=int, default=5, help="a malformed request after this many")
    parser.add_argument("--out", default="runs/bench_serve.json", help="where the JSON results go")
    args = parser.parse_args()

    results = {name: bench(name, args) for name in args.envs}
    print(f"\n{'env':<10} {'episodes':>8} {'steps':>6} {'in-process steps/s':>19} {'HTTP steps/s':>13} "
          f"{'ratio':>6} | {'clients':>7} {'requests/s':>10} {'requests':>8} {'malformed':>9} {'errors':>6} "
          f"{'server CPU/request':>18}")
    for name, r in results.items():
        local, remote, under_load = r["in_process"]["steps_per_s"], r["http"]["steps_per_s"], r["load"]
        print(f"{name:<10} {r['episodes']:>8} {r['steps']:>6} {local:>19,.0f} {remote:>13,.0f} "
              f"{local / remote:>5.1f}x | "
              f"{under_load['clients']:>7} {under_load['requests_per_s']:>10,.0f} {under_load['requests']:>8} "
              f"{under_load['malformed']:>9} {under_load['errors']:>6} "
              f"{under_load['server_cpu_ms_per_request']:>15.2f} ms")
    results["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
