"""Several AgentGym env servers (--env-url URL URL ...), each a `python -m envs.serve` process on loopback: the env
instances are spread over them round robin and play exactly as in process; a server killed mid-run fails only the
trajectories of its own instances; train.py and eval.py take several URLs, and one that cannot be reached stops
them before any episode with one line naming it (envs/guard.py make_envs)."""

import contextlib
import json
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
import tyro

import envs
import eval as eval_script
from rl.flags import build
import train
from envs.guard import EnvTimeout, close_envs, make_envs
from rl.checkpoint import STATE
from rl.engines import RoundEngine
from rl.engines.expert import ExpertEngine
from rl.model import load_tokenizer
from rollout import ChatFormat, rollout

ROOT = Path(train.__file__).resolve().parent
# tiny-preset BabyAI train tasks whose expert episodes take 3, 2, 1, 3, 3 and 3 turns: over two servers the second
# one's rows (1, 3, 5) all outlast their first turn
TASKS = [4840, 4842, 4848, 4880, 4882, 4888]
GROUPS = list(range(len(TASKS)))
LIMITS = {"horizon": 8, "max_new_tokens": 200, "max_tokens": 4096}
SMALL = ["--steps", "1", "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "8"]


def free_url() -> str:
    """A loopback URL nothing listens on (yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@contextlib.contextmanager
def served(count: int):
    """`count` BabyAI servers, each `python -m envs.serve` in its own process; yields (their URLs, the processes)."""
    urls = [free_url() for _ in range(count)]
    processes = [subprocess.Popen([sys.executable, "-m", "envs.serve", "--env", "babyai", "--port", url.rsplit(":", 1)[1]],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for url in urls]
    try:
        deadline = time.monotonic() + 60
        for url, process in zip(urls, processes):
            while True:
                assert process.poll() is None, process.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, f"the server at {url} did not answer in 60 s"
                try:
                    httpx.get(url, timeout=1).raise_for_status()
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
        yield tuple(urls), processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def servers():
    with served(2) as (urls, _):
        yield urls


class Recorder(ExpertEngine):
    """BabyAI's expert, keeping what it said at each (row, turn)."""

    def __init__(self, fmt, environments):
        super().__init__(fmt, environments)
        self.said = {}

    def generate(self, batch, limits):
        samples = super().generate(batch, limits)
        self.said |= {(traj.row, traj.turns): sample for traj, sample in zip(batch, samples)}
        return samples


class Replays(RoundEngine):
    """Says again what the expert said at each (row, turn): the expert's episodes on envs it cannot read (remote)."""

    def __init__(self, said):
        super().__init__()
        self.said = said

    def generate(self, batch, limits):
        return [self.said[traj.row, traj.turns] for traj in batch]


@pytest.fixture(scope="module")
def expert():
    """The expert's in-process episodes of TASKS (their log records) and an engine that replays them."""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    local = [envs.make("babyai") for _ in TASKS]
    recorder = Recorder(fmt, local)
    played = [t.log_record() for t in rollout(recorder, fmt, local, TASKS, GROUPS, **LIMITS)]
    assert all(r["finish"] == "done" and r["success"] for r in played)
    assert [r["turns"] for r in played] == [3, 2, 1, 3, 3, 3]
    return fmt, Replays(recorder.said), played


def test_instances_spread_round_robin_and_play_as_in_process(servers, expert):
    fmt, replays, local = expert
    environments = make_envs("babyai", len(TASKS), urls=servers)
    try:
        assert [env.options["url"] for env in environments] == [*servers] * 3  # an even share each
        assert [t.log_record() for t in rollout(replays, fmt, environments, TASKS, GROUPS, **LIMITS)] == local
    finally:
        close_envs(environments)
    # a run's second process goes on where the first one's instances stopped; one URL takes them all
    environments = make_envs("babyai", 3, urls=servers, rank=1) + make_envs("babyai", 2, urls=servers[1])
    close_envs(environments)
    assert [env.options["url"] for env in environments] == [servers[1], servers[0], servers[1], servers[1], servers[1]]


def test_a_server_killed_mid_run_fails_only_its_instances_trajectories(expert):
    fmt, replays, local = expert
    with served(2) as (urls, processes):
        environments = make_envs("babyai", len(TASKS), {"retries": 1, "backoff": 0.01}, urls=urls)

        def kill_second(trajectories) -> None:  # (first called once every episode played its first turn)
            if processes[1].poll() is None:
                processes[1].kill()
                processes[1].wait()

        try:
            played = rollout(replays, fmt, environments, TASKS, GROUPS, progress=kill_second, **LIMITS)
            assert processes[1].poll() is not None and processes[0].poll() is None
            records = [t.log_record() for t in played]
            assert records[0::2] == local[0::2]  # the first server's episodes, as in process
            for record in records[1::2]:
                assert record["finish"] == "error" and record["reward"] == 0 and urls[1] in record["error"], record
            # the next episodes: the killed server's instances cannot start one, the other server's play on
            played = rollout(replays, fmt, environments, TASKS, GROUPS, **LIMITS)
            assert [t.log_record() for t in played[0::2]] == local[0::2]
            for traj in played[1::2]:
                assert traj.finish == "error" and traj.error.startswith("reset failed") and urls[1] in traj.error
        finally:
            close_envs(environments)


def test_a_call_that_times_out_names_its_server(servers):
    [env] = make_envs("babyai", 1, urls=servers[1:], timeout=0.2)
    env.env.step = lambda text: time.sleep(1)  # (a server that stopped answering)
    with pytest.raises(EnvTimeout, match=f"no answer in 0.2 s from the env server at {servers[1]}"):
        env.step("Action: turn left")
    close_envs([env])


def stopped(call) -> str:
    """The one line a call stopped the script with (SystemExit with a message: exit status 1, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        call()
    assert isinstance(stop.value.code, str) and "\n" not in stop.value.code, stop.value.code
    return stop.value.code


def test_train_and_eval_take_several_urls_and_stop_on_one_that_cannot_be_reached(servers, tmp_path):
    assert train.parse_args(["--env-url", *servers]).env_args.env_url == servers
    assert train.parse_args(["--env-url", servers[0]]).env_args.env_url == (servers[0],)
    assert train.parse_args([]).env_args.env_url is None
    assert tyro.cli(eval_script.Args, args=["--env-url", *servers]).env_args.env_url == servers
    assert tyro.cli(eval_script.Args, args=["--env-url", servers[0]]).env_args.env_url == (servers[0],)
    # train.py makes 2 x 2 envs, eval.py 3: the third is on the server that is down, named by the one line
    down = free_url()
    for message in (
        stopped(lambda: train.main(train.parse_args([*SMALL, "--env-url", *servers, down, "--env-options", "retries", "0",
                                                     "--out-dir", str(tmp_path)]))),
        stopped(lambda: eval_script.main(build(eval_script.Args, env_url=(*servers, down), env_options={"retries": "0"},
                                                          engine="hf", limit=3, out=str(tmp_path / "e")))),
    ):
        assert message.startswith(f"cannot make a babyai env on the env server at {down} ") and servers[0] not in message
        assert f"cannot reach the babyai env server at {down}" in message


def test_a_run_that_stored_one_url_resumes_with_it_or_with_several(tmp_path):
    """Runs from before --env-url took several servers stored one URL as a string in config.json."""
    checkpoint = tmp_path / "old" / "checkpoints" / "step_1"
    (checkpoint / "state").mkdir(parents=True)
    (checkpoint / STATE).write_text("{}")
    (checkpoint / "state" / "schedulers.json").write_text("{}")
    (tmp_path / "old" / "config.json").write_text(json.dumps({"preset": "tiny", "env_url": "http://old:36001"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (tyro warns of a default that is not of its field's type)
        assert train.parse_args(["--resume", str(checkpoint)]).env_args.env_url == ("http://old:36001",)
        assert train.parse_args(["--resume", str(checkpoint), "--env-url", "http://a:1", "http://b:1"]).env_args.env_url == \
               ("http://a:1", "http://b:1")
