"""bench section env: oracle episodes of every env, recorded once, replayed in process (envs.make) and over AgentGym's
HTTP protocol (envs.make(name, url=...) against `python -m envs.serve` on loopback, upstream's architecture); both must
answer the same (SciWorld and WebArena: the same rewards and done, their observations vary between two plays of a
task). Calls (resets and steps) per second each way: the ratio is what in-process envs gain. WebArena plays its local
sites' tasks. `--clients N` adds a load test: N threads replay the episodes through the server at once, a malformed
request after every `--malformed-every` calls, counting requests/s, errors (a good call that failed, a malformed one
not answered 4xx, any 5xx) and the server's CPU time per request.

The same episodes also go round trip through each standard (issue 63), out of our env by our Out module and back in by
our In adapter (envs/standards), `--standards` choosing which; an episode counts as identical when every answer is
what the in-process play answered, as the standard shows it (STANDARDS):

    gym        envs.make("gym:bench.env:GymStyle", env=...): a 15-line Gymnasium-style class around our env, played by
               the gym: adapter in this process, so the figure is the adapter's own cost
    openenv    `python -m envs.standards.openenv_server` on a loopback port, played by envs.make("openenv:URL")
               (OpenEnv's own WebSocket client, one session)
    verifiers  envs.standards.verifiers_env's taskset (id agentgym-rl) played by envs.make("verifiers:agentgym-rl") in
               verifiers' own Env.run; task id k of the adapter is row k, the k-th episode's task id (task_ids); every
               episode makes, resets and closes an env of its own, as verifiers_env runs one. verifiers says the
               opening (instruction, ack, first observation) as one prompt and never shows the agent an episode's last
               observation (run() ends with it): the adapter's first observation is the three joined, its last END.
               Its steps before the last score 0 (a trace's reward is recorded at its end), which only SciWorld's
               progress scores tell apart
One reset of each before the clock starts (OpenEnv's server makes its env at a session's first reset, verifiers reads
its rows then, an env reset each), as the other paths make their env before it. WebArena's expert plays live from what
the env shows (LIVE_ORACLE), so it is not replayed through the standards.

    python scripts/bench.py --sections env --envs babyai textcraft --clients 8
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import ROOT, Args, cpu_seconds, free_port

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


def episodes_of(transcript: list) -> list[list]:
    """A transcript cut into its episodes, each from its reset's answer (a str) on."""
    episodes = []
    for answer in transcript:
        if isinstance(answer, str):
            episodes.append([])
        episodes[-1].append(answer)
    return episodes


def identical(name: str, expected: list, played: list) -> int:
    """How many episodes `played` answered exactly as `expected` (outcomes: the answers an env keeps fixed)."""
    return sum(outcomes(name, mine) == outcomes(name, theirs)
               for mine, theirs in zip(episodes_of(expected), episodes_of(played)))


# ----------------------------------------------------------------------------------------------
# The standards: each env round trip through an Out module and an In adapter (the module docstring says how)


class GymStyle:
    """Our env `env` as a Gymnasium-style env for the gym: adapter: reset(seed) is reset(task_id), step's reward the
    step's increment (the adapter sums them back to our return so far)."""

    def __init__(self, env: str, **options):
        import envs

        self.env, self.score, self.metadata = envs.make(env, **options), 0.0, {}

    def reset(self, seed: int, options: dict | None = None) -> tuple[str, dict]:
        self.score = 0.0
        return self.env.reset(seed), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        result = self.env.step(action)
        reward, self.score = result.reward - self.score, result.reward
        return result.observation, reward, result.done, False, result.info

    def close(self) -> None:
        self.env.close()


def shown(standard: str, env, transcript: list) -> list:
    """The in-process transcript as `standard` shows it: verifiers joins the opening into its first observation and
    says END for an episode's last (envs/standards/verifiers.py); its steps before the last score 0."""
    if standard != "verifiers":
        return transcript
    from envs.standards.verifiers import END

    out = []
    for episode in episodes_of(transcript):
        out.append("\n\n".join([env.instruction, env.ack, episode[0]]))
        out += [(observation, 0.0, done) for observation, _, done in episode[1:-1]]
        out.append((END, *episode[-1][1:]))
    return out


def replay_standard(standard: str, name: str, options: dict, episodes) -> tuple[int, float, list]:
    """replay() through `standard` (the env made by its In adapter on what its Out module serves)."""
    import envs

    server = None
    try:
        if standard == "gym":
            env = envs.make("gym:bench.env:GymStyle", env=name, whole_reply=True, **options)
            played = episodes
        elif standard == "openenv":
            server, url = start_server(name, options, 4, "envs.standards.openenv_server", "/health")
            env = envs.make(f"openenv:{url}", whole_reply=True, observation="text", task_key="task_id",
                            timeout=envs.call_timeout(name))
            played = episodes
        else:
            import envs.standards.verifiers_env  # noqa: F401 - registers the id agentgym-rl

            env = envs.make("verifiers:agentgym-rl", whole_reply=True,
                            taskset={"env": name, "task_ids": [task_id for task_id, _ in episodes], "horizon": 100,
                                     "env_options": options})
            played = [(row, texts) for row, (_, texts) in enumerate(episodes)]
        try:
            env.reset(played[-1][0])  # (before the clock, as the others make their env: OpenEnv's server makes its
            # env at a session's first reset, verifiers reads every row, an env reset each)
            return replay(env, played)
        finally:
            env.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def proc_status(pid, key: str) -> float:
    """A /proc/<pid>/status field in kB as GiB (VmHWM: the peak resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def start_server(name: str, options: dict, max_envs: int, module: str = "envs.serve",
                 probe: str = "/") -> tuple[subprocess.Popen, str]:
    """`python -m module` serving env `name` on a free loopback port (envs.serve, or envs.standards.openenv_server:
    its sessions flag is --max-sessions), once GET `probe` answers 200."""
    import httpx

    port = free_port()
    most = "--max-envs" if module == "envs.serve" else "--max-sessions"
    command = [sys.executable, "-m", module, "--env", name, "--port", str(port), most, str(max_envs)]
    if options:
        command += ["--env-options", *[str(x) for pair in options.items() for x in pair]]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url + probe).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"the {name} server did not start (python -m {module} --env {name})")


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
        standards = {}
        for standard in args.standards if name not in LIVE_ORACLE else ():
            try:
                calls, seconds, transcript = replay_standard(standard, name, options, episodes)
                expected = shown(standard, local, local_transcript)
                standards[standard] = {"calls_per_s": calls / seconds, "identical": identical(name, expected, transcript),
                                       "gain": (local_calls / local_s) / (calls / seconds)}
            except Exception as error:  # a standard not installed costs its row only
                standards[standard] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        local.close()
    return {"episodes": len(episodes), "calls": local_calls,
            "in_process_calls_per_s": local_calls / local_s, "http_calls_per_s": http_calls / http_s,
            "gain": (local_calls / local_s) / (http_calls / http_s),
            "http_identical": len(episodes) - differing if name in LIVE_ORACLE else identical(name, local_transcript,
                                                                                               http_transcript),
            "server_cpu_ms_per_call": 1000 * server_cpu / http_calls, "server_peak_gib": server_peak,
            "episodes_ending_differently": differing, "load": under_load, "standards": standards}


def phase_env(args: Args) -> dict:
    results = {}
    for name in args.envs:
        try:
            results[name] = bench_env(name, args)
        except Exception as error:  # a missing system package (Chromium, Java) costs that env's row only
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        print(f"env {name}: {results[name]}", flush=True)
    return {"envs": results, "peak_gib": proc_status("self", "VmHWM")}


THROUGH = {"gym": "through gym: (GymStyle, in process)", "openenv": "through OpenEnv (openenv_server, openenv:URL)",
           "verifiers": "through verifiers (agentgym-rl, verifiers:agentgym-rl)"}


def env_rows(env: dict) -> list[str]:
    """The env section's rows: an env each, its calls/s in process against over HTTP; then one an env a standard."""
    lines = []
    for name, r in (env.get("envs") or {}).items():
        if "error" in r:
            lines.append(f"| env | {name} | {r['error'][:80]} | |")
            continue
        same = f", {r['http_identical']} identical" if "http_identical" in r else ""
        lines.append(f"| env | {name}: calls/s in process / over HTTP ({r['episodes']} episodes, {r['calls']} calls"
                     f"{same}) | {r['in_process_calls_per_s']:,.0f} / {r['http_calls_per_s']:,.0f} = "
                     f"{r['gain']:.1f}x (server peak {r['server_peak_gib']:.2f} GiB"
                     + (f"; {r['episodes_ending_differently']} episodes ended differently"
                        if r.get("episodes_ending_differently") else "") + ") | |")
    for standard, through in THROUGH.items():
        for name, r in (env.get("envs") or {}).items():
            one = (r.get("standards") or {}).get(standard)
            if one is None:
                continue
            if "error" in one:
                lines.append(f"| env | {name}: {through} | {one['error'][:80]} | |")
                continue
            lines.append(f"| env | {name}: calls/s in process / {through} ({one['identical']} of {r['episodes']} "
                         f"episodes identical) | {r['in_process_calls_per_s']:,.0f} / {one['calls_per_s']:,.0f} = "
                         f"{one['gain']:.1f}x | |")
    return lines
