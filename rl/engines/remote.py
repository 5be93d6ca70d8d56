"""The engine contract played on rollout servers (server.py): `--rollout-server HOST:PORT [HOST:PORT ...]`.

    engine = RemoteEngine(["10.0.0.2:8900"], fmt, temperature=1.0, top_p=1.0, seed=0, identity=..., owner=True, rank=0)
    engine.submit(traj, limit); engine.poll(); ...     # as every engine (rl/engines)
    engine.load_weights(model, weights=full_weights(model))   # after each update: the broadcast, then the probe

Each trajectory has a home server for its whole episode (its turns extend each other, so each reuses the last one's
prefix cache there), chosen when its first turn is submitted: the ready server homing the fewest live trajectories
of this engine, ties going round from the process's index (`rank`), so that the processes of a run, which number
their groups alike and start together, spread out instead of all picking the first servers. A home belongs to the
trajectory, not to its row: an evaluation played meanwhile on other envs (numbered from 0 too) moves nothing. The
samples of a task may so land on several servers, each prefilling their shared first prompt once: the price of an
even spread, which whole groups (8 episodes each, 2 a process in the two-node recipe) would not give in general.
Submitted turns go out with the next poll, several at once, and a poll waits on the server (at most POLL_WAIT_S)
for the first of them to finish, so nothing spins.
Under --deterministic turns go in rounds and each carries a seed from the engine's own stream, as in process, so a
run over one server replays the in-process engine's rollouts (the server must run --deterministic too).

Weights: every process of the trainer calls load_weights alike (a sharded model is gathered collectively); the
trainer's rank 0 (`owner`) packs the tensors, cast to the servers' dtype, into buckets of `bucket_mb` MiB and
broadcasts each bucket once over one process group with every server's workers (`weight_sync` "broadcast";
"per-server": a group with each server, the buckets sent to one after another; server.weight_group: NCCL when
every end has a GPU of its own, gloo otherwise). The trainer hosts the group's store and tells each server over
HTTP the group's size and its first rank (/weights/group), and all join; a server whose workers do not arrive
within `reconnect_s` is named. Then the trainer checks every server with the probe exactly as the in-process sync
does. The weights carry a version (the count of
syncs); every turn asks for it, and a server without it (restarted, or it missed an update) is not sampled from:
the server checks it on its engine thread as it adds the turn (an update between the check and the turn cannot
slip in), and names the version that sampled each turn in its answer, which the client checks again (a turn of
another version fails, never trained on).

Faults: a server that cannot be reached, answers an error or generates nothing for `stall_s` seconds while it holds
turns fails only its trajectories (Sample.error: their finish is "error", counted, left out of the update) and is
set aside. At the next sync the trainer reaches again for every server set aside: one that answers is checked
(the same model), given a new group and the weights; if none answers within `reconnect_s`, the run stops with a
message. A broadcast that breaks off stops the run (sync in setup.py), on every process together.
"""

from __future__ import annotations

import itertools
import re
import socket
import time
import uuid
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import torch

from rl.engines import PROBE, PROBE_TOLERANCE, Sample, Seeded, trainer_probe, verify_probe
from rl.engines.server import arrivals, backend_to, buckets, differences, send_bucket, weight_group

# The longest a poll waits on a server for one of its turns to finish: short, since a trajectory whose env answered
# meanwhile is submitted only after the poll (a round trip costs ~2 ms on loopback)
POLL_WAIT_S = 0.05


class RemoteServer:
    """One rollout server as the client sees it."""

    def __init__(self, address: str):
        self.address = address
        self.url = address if address.startswith("http") else f"http://{address}"
        self.info: dict = {}
        self.up, self.reason = False, ""
        self.outbox: list[dict] = []  # turns to send with the next poll
        self.aborts: list = []
        self.holding: set = set()  # ids of turns sent and not back
        self.progress, self.since = -1, time.monotonic()  # the server's progress count, and when it last moved


@dataclass
class WeightGroup:
    """A weights group as the trainer holds it: its name, its servers (at the processes that joined it), the process
    group (rank 0 here), its store (hosted here) and backend, and the device its tensors go from."""

    name: str
    servers: list[RemoteServer]
    instances: list
    group: object
    store: object
    backend: str
    device: object

    def holds(self) -> bool:
        """Every server of the group is up, the process that joined it, and still in it (as /info said at this sync's
        reach)."""
        return all(server.up and server.info.get("instance") == instance
                   and server.info.get("weights_group") == {"id": self.name, "state": "joined"}
                   for server, instance in zip(self.servers, self.instances))


class RemoteEngine(Seeded):
    name = "server"
    apart = True  # (its servers go on generating while the trainer updates)
    state_key = "request_seeds"

    def __init__(self, addresses: list[str], fmt, *, temperature: float, top_p: float, top_k: int = 0, seed: int = 0,
                 deterministic: bool = False, identity: dict | None = None, max_model_len: int = 0,
                 owner: bool = False, trainer: str | None = None, tolerance: float = 0.0, stall_s: float = 300.0,
                 reconnect_s: float = 120.0, weights_timeout: float = 600.0, rank: int = 0,
                 weight_sync: str = "broadcast", bucket_mb: int = 256):
        self.fmt, self.temperature, self.top_p, self.top_k = fmt, temperature, top_p, top_k
        self.deterministic, self.continuous = deterministic, not deterministic
        self.generator = torch.Generator().manual_seed(seed) if deterministic else None
        self.identity, self.max_model_len, self.owner, self.rank = identity or {}, max_model_len, owner, rank
        self.stall_s, self.reconnect_s, self.weights_timeout = stall_s, reconnect_s, weights_timeout
        self.tolerance_given = tolerance
        self.weight_sync, self.bucket_bytes = weight_sync, bucket_mb * 2**20
        self.groups: list[WeightGroup] = []  # the weights groups of the last sync
        self.http = httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0))
        self.client = uuid.uuid4().hex[:12]
        self.servers = [RemoteServer(address) for address in addresses]
        self.requests: dict[int, tuple[object, RemoteServer]] = {}
        self.homes: dict[int, tuple[weakref.ref, RemoteServer | None]] = {}  # id(trajectory) -> (it, its server)
        self.failed: list[tuple[object, Sample]] = []
        self.counter = itertools.count()
        # the weights' version: "<trainer>/<count of syncs>" once sent (`trainer` names this run, the same on every
        # process, so that two trainers on one server never take each other's weights for their own); 0: the
        # servers' weights as they loaded them; None: whatever they hold
        self.trainer, self.syncs, self.version = trainer or self.client, 0, None
        self.probe = fmt.encode(fmt.render(PROBE))
        self.counts = {"prompt_tokens": 0, "cached_tokens": 0, "lost_turns": 0}
        self.progress = 0
        self.pool = ThreadPoolExecutor(max(len(self.servers), 1), thread_name_prefix="rollout-server")
        for server in self.servers:
            if not self._connect(server):
                raise SystemExit(f"--rollout-server {server.address}: {server.reason}")
        twice = [instance for instance, count in Counter(server.info.get("instance") for server in self.servers).items()
                 if instance is not None and count > 1]
        if twice:  # (its workers would be asked to join a weights group twice, the second join queued behind the first)
            same = [server.address for server in self.servers if server.info.get("instance") == twice[0]]
            raise SystemExit(f"--rollout-server names one server more than once ({', '.join(same)} answer as the same "
                             "process): give each server once")

    # -- connecting

    def _connect(self, server: RemoteServer) -> bool:
        """Reach the server and check that it serves what this run needs; False (and why, in server.reason) if not."""
        try:
            answer = self.http.get(f"{server.url}/info", timeout=10.0)
            answer.raise_for_status()
            info = answer.json()
        except (httpx.HTTPError, ValueError) as error:
            server.up, server.reason = False, f"no rollout server answers at {server.url} ({_line(error)})"
            return False
        problems = differences(self.identity, info)
        if problems:
            raise SystemExit(f"the rollout server at {server.address} serves another model than the trainer's "
                             f"({'; '.join(problems)}): start it with the trainer's --model")
        if self.max_model_len > info["max_model_len"]:
            raise SystemExit(f"the rollout server at {server.address} holds {info['max_model_len']} tokens a "
                             f"trajectory, this run needs {self.max_model_len}: start it with --max-model-len "
                             f"{self.max_model_len}")
        if self.deterministic and not info["deterministic"]:
            raise SystemExit(f"--deterministic: the rollout server at {server.address} must run --deterministic too "
                             "(its batches are replayable only then)")
        server.info, server.up, server.reason = info, True, ""
        server.progress, server.since = -1, time.monotonic()
        return True

    def _set_aside(self, server: RemoteServer, reason: str) -> None:
        """Fail every turn the server holds (their trajectories end with the error) and use it no more until the
        next sync reaches it again."""
        server.up, server.reason = False, reason
        for rid in [rid for rid, (_, home) in self.requests.items() if home is server]:
            traj, _ = self.requests.pop(rid)
            self.failed.append((traj, Sample([], error=f"rollout server {server.address}: {reason}")))
            self.counts["lost_turns"] += 1
        server.outbox, server.aborts, server.holding = [], [], set()

    # -- generation

    @property
    def pending(self) -> int:
        return len(self.requests) + len(self.failed)

    def home(self, traj) -> RemoteServer | None:
        """The trajectory's server for its whole episode (None: none was up), chosen at its first turn (see above)."""
        mine = self.homes.get(id(traj))
        if mine is not None and mine[0]() is traj:
            return mine[1]
        # (the homes of trajectories ended or gone are forgotten: they weigh nothing, and an id may come again)
        self.homes = {key: (ref, server) for key, (ref, server) in self.homes.items()
                      if (other := ref()) is not None and other.live}
        load = Counter(server for _, server in self.homes.values())
        ready, count = [server for server in self.servers if server.up], len(self.servers)
        server = min(ready, key=lambda s: (load[s], (self.servers.index(s) - self.rank) % count), default=None)
        self.homes[id(traj)] = (weakref.ref(traj), server)
        return server

    def submit(self, traj, limit: int) -> None:
        rid = next(self.counter)
        server = self.home(traj)
        if server is None or not server.up:
            reason = (f"rollout server {server.address}: {server.reason}" if server else "no rollout server is up ("
                      + "; ".join(f"{s.address}: {s.reason}" for s in self.servers) + ")")
            self.failed.append((traj, Sample([], error=reason)))
            self.counts["lost_turns"] += 1
            return
        request = {"id": rid, "token_ids": list(traj.token_ids), "max_tokens": limit,
                   "stop_ids": sorted(self.fmt.stop_ids), "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k}
        if self.generator is not None:
            request["seed"] = int(torch.randint(2**63 - 1, (), generator=self.generator))
        server.outbox.append(request)
        self.requests[rid] = (traj, server)

    def poll(self) -> list[tuple[object, Sample]]:
        busy = [server for server in self.servers if server.up and (server.outbox or server.holding or server.aborts)]
        wait = 0.0 if self.failed else POLL_WAIT_S
        done = []
        for server, answer in zip(busy, self.pool.map(lambda server: self._poll(server, wait), busy)):
            done += self._take(server, answer)
        done, self.failed = self.failed + done, []
        self.progress += len(done)
        return done

    def _poll(self, server: RemoteServer, wait: float):
        """One round trip: the server's answer, or the exception that stood in its way."""
        body = {"client": self.client, "submit": server.outbox, "abort": server.aborts, "wait": wait,
                "version": self.version}
        try:
            answer = self.http.post(f"{server.url}/poll", json=body, timeout=wait + min(self.stall_s, 60.0))
            if answer.status_code != 200:
                return RuntimeError(f"it answered {answer.status_code}: {_error(answer)}")
            return answer.json()
        except (httpx.HTTPError, ValueError) as error:
            return error

    def _take(self, server: RemoteServer, answer) -> list[tuple[object, Sample]]:
        if isinstance(answer, Exception):
            self._set_aside(server, f"{_line(answer)}")
            return []
        idle = not server.holding  # (held nothing until now: the stall clock starts at this poll)
        server.holding |= {request["id"] for request in server.outbox}
        server.outbox, server.aborts = [], []
        done = []
        for turn in answer["done"]:
            server.holding.discard(turn["id"])
            traj, _ = self.requests.pop(turn["id"], (None, None))
            if traj is None:  # aborted here meanwhile
                continue
            if "error" in turn:
                done.append((traj, Sample([], error=f"rollout server {server.address}: {turn['error']}")))
                continue
            if self.version is not None and turn.get("version") != self.version:
                done.append((traj, Sample([], error=f"rollout server {server.address}: the turn was sampled by weights "
                                                    f"version {turn.get('version')}, not {self.version}: refused")))
                self.counts["lost_turns"] += 1
                continue
            self.counts["prompt_tokens"] += turn["prompt_tokens"]
            self.counts["cached_tokens"] += turn["cached_tokens"]
            done.append((traj, Sample(turn["token_ids"], turn["logprobs"])))
        now = time.monotonic()
        if answer["progress"] != server.progress or idle or not server.holding:
            self.progress += answer["progress"] != server.progress  # (the server generated: the rollout's watchdog)
            server.progress, server.since = answer["progress"], now
        elif now - server.since > self.stall_s:
            self._set_aside(server, f"it generated nothing for {self.stall_s:g} s while it held "
                                    f"{len(server.holding)} turns")
        return done

    def abort(self) -> None:
        """Drop every submitted turn (a rollout that stopped half-way); the servers abort theirs."""
        for rid, (_, server) in self.requests.items():
            if rid in server.holding:
                server.aborts.append(rid)
        self.requests.clear()
        self.failed = []
        for server in self.servers:
            server.outbox, server.holding = [], set()
            if server.up and server.aborts:
                self._poll(server, 0.0)
            server.aborts = []

    def metrics(self) -> dict[str, float]:
        """The prefix-cache hit rate since the last call, and the turns lost to servers that failed."""
        counts, self.counts = self.counts, {"prompt_tokens": 0, "cached_tokens": 0, "lost_turns": 0}
        return {"prefix_hit_rate": counts["cached_tokens"] / max(counts["prompt_tokens"], 1),
                "server_lost_turns": counts["lost_turns"]}

    def reseed(self, seed: int) -> None:
        """Deterministic: restart the stream of request seeds and drop the servers' prefix caches (as VLLMEngine)."""
        if self.deterministic:
            super().reseed(seed)
            for server in self.servers:
                if server.up:
                    try:
                        self._post(server, "/reset", {})
                    except (RuntimeError, httpx.HTTPError) as error:
                        raise SystemExit(f"--deterministic: the rollout server at {server.address} could not drop its "
                                         f"prefix cache ({_line(error)}); a deterministic run needs its servers to "
                                         "itself") from None

    # -- weights

    @property
    def tolerance(self) -> float:
        dtypes = [server.info.get("dtype", "bfloat16") for server in self.servers]
        return self.tolerance_given or max(PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE["bfloat16"]) for dtype in dtypes)

    def load_weights(self, model, weights=None, verify: bool = True) -> dict[str, float]:
        """Every process: iterate the weights (a sharded model's gather is collective), and take the trainer's side of
        the probe. The owner (rank 0) also reaches the servers set aside, sends the weights in buckets over the
        weights groups (`_open_groups`) to every server that is up, waits for them to load them and probes each.
        Returns the seconds (and of them the sends': packing and broadcasting), the bytes of one copy, the buckets
        and the worst mean probe difference, or {"error": why} (setup.sync stops every process on it)."""
        if self.requests:
            raise RuntimeError("the engine's weights change between rollouts, not during one")
        start = time.perf_counter()
        self.syncs += 1
        self.version = f"{self.trainer}/{self.syncs}"
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        weights = iter(weights if weights is not None else model.state_dict().items())
        if not self.owner:
            for server in self.servers:
                self._connect(server)
            for _ in weights:
                pass
            trainer_probe(model, self.probe)
            return {"sync_s": time.perf_counter() - start, "probe_diff": 0.0, "probe_diff_max": 0.0}
        error, sent = self._reach(), {"bytes": 0, "buckets": 0, "send_s": 0.0}
        servers = [server for server in self.servers if server.up]
        if error is None:
            error = self._open_groups(servers)
        for server in servers if error is None else []:
            try:
                self._post(server, "/weights/update", {"version": self.version})
            except (RuntimeError, httpx.HTTPError) as failure:
                error = f"the rollout server at {server.address} did not take the weight update: {_line(failure)}"
                break
        if error is None:
            sending = time.perf_counter()
            error = self._send(((name, tensor) for name, tensor in weights if not (tied and name == "lm_head.weight")),
                               _dtype(servers[0]), sent)
            sent["send_s"] = time.perf_counter() - sending
        for _ in weights:  # (every tensor is taken in, also after an error: the gathers are collective)
            pass
        if error is None:
            error = self._loaded(servers)
        seconds = time.perf_counter() - start
        trainer = trainer_probe(model, self.probe)
        if error is not None:
            self.groups = []  # a broken group is not used again (its peers' receive fails as it closes)
            return {"sync_s": seconds, "error": error}
        probes = list(self.pool.map(self._probe, servers))
        failed = [answer for answer in probes if isinstance(answer, str)]
        if failed:
            return {"sync_s": seconds, "error": f"a rollout server did not answer the probe: {failed[0]}"}
        diffs = [(torch.tensor(answer) - trainer).abs() for answer in probes]
        worst = max(diffs, key=lambda d: float(d.mean()) if d.mean() == d.mean() else float("inf"))
        if verify:
            self.verify(float(worst.mean()))
        return {"sync_s": seconds, "probe_diff": float(worst.mean()), "probe_diff_max": float(worst.max()),
                "send_s": sent["send_s"], "bytes": sent["bytes"], "buckets": sent["buckets"], "servers": len(servers)}

    def verify(self, diff: float) -> None:
        """Raise SyncError if `diff`, a mean probe difference, is past the tolerance."""
        verify_probe(diff, self.tolerance, "the rollout server's")

    def _send(self, weights, dtype: torch.dtype, sent: dict) -> str | None:
        """Broadcast `weights` in buckets on every weights group, each bucket once a group, then the end of the
        stream; None, or why it broke off (at the first failure: the tensors left are not sent)."""
        device = next((group.device for group in self.groups if group.backend == "nccl"), "cpu")
        for table, bucket in buckets(weights, dtype, self.bucket_bytes, device):
            for group in self.groups:
                try:
                    send_bucket(group.group, table, bucket, group.device)
                except RuntimeError as failure:
                    return f"the weight broadcast to {self._blamed(group.servers)} broke off at {table[0][0]}'s " \
                           f"bucket: {_line(failure)}"
            sent["bytes"] += bucket.numel()
            sent["buckets"] += 1
        for group in self.groups:
            try:
                send_bucket(group.group, None, None, group.device)
            except RuntimeError as failure:
                return f"the weight broadcast to {self._blamed(group.servers)} broke off at its end: {_line(failure)}"
        return None

    def _blamed(self, servers: list[RemoteServer]) -> str:
        """"the rollout server(s) at ADDRESS (why), ...": those of `servers` that do not answer /info within 5 s or
        answer that their workers' joining failed; all of them when none does (the failure itself may say why)."""
        def why(server):
            try:
                info = self.http.get(f"{server.url}/info", timeout=5.0).json()
                state = (info.get("weights_group") or {}).get("state")
            except (httpx.HTTPError, ValueError, AttributeError):
                return "it does not answer"
            return f"its workers' joining {state}" if str(state).startswith("failed") else None

        reasons = [(server, reason) for server, reason in zip(servers, self.pool.map(why, servers)) if reason]
        reasons = reasons or [(server, None) for server in servers]
        return f"the rollout server{'s' if len(reasons) > 1 else ''} at " + ", ".join(
            server.address + (f" ({reason})" if reason else "") for server, reason in reasons)

    def _probe(self, server: RemoteServer) -> list[float] | str:
        """The server's log-probs of the probe, or why it gave none."""
        try:
            return self._post(server, "/probe", {"token_ids": self.probe})["logprobs"]
        except (RuntimeError, httpx.HTTPError) as failure:
            return f"{server.address}: {_line(failure)}"

    def _reach(self) -> str | None:
        """Reach every server again (one set aside may be back; one that restarted needs a new group); with none up,
        keep trying for reconnect_s. None, or why not."""
        deadline = time.monotonic() + self.reconnect_s
        while True:
            for server in self.servers:
                self._connect(server)
            if any(server.up for server in self.servers):
                return None
            if time.monotonic() > deadline:
                reasons = "; ".join(server.reason for server in self.servers)
                return f"no rollout server answered for {self.reconnect_s:g} s ({reasons}): stopping"
            time.sleep(1.0)

    def _open_groups(self, servers: list[RemoteServer]) -> str | None:
        """The weights groups of this sync: with --weight-sync broadcast one over every server's workers, with
        per-server one with each server. A group of the last sync is kept while each of its servers, the same
        process, still holds it (another trainer's sync in between makes a server join that trainer's group)."""
        dtypes = {server.address: server.info.get("dtype", "float32") for server in servers}
        if len(set(dtypes.values())) > 1:
            return ("the rollout servers hold their weights in different dtypes (" + ", ".join(
                f"{address}: {dtype}" for address, dtype in dtypes.items()) + "): start them all with one --dtype")
        wanted = [servers] if self.weight_sync == "broadcast" else [[server] for server in servers]
        kept = {tuple(group.servers): group for group in self.groups if group.holds()}
        self.groups = []
        for members in wanted:
            group = kept.get(tuple(members)) or self._open_group(members)
            if isinstance(group, str):
                return group
            self.groups.append(group)
        return None

    def _open_group(self, servers: list[RemoteServer]) -> WeightGroup | str:
        """A new weights group, or why not: rank 0 here (it hosts the group's store, on this machine's address on
        the route to the first server), then each server's workers in turn; NCCL when every server is reached over
        it, else gloo. Returns once every rank has joined; a server that does not join within reconnect_s fails it."""
        host, port = servers[0].url.rsplit("//", 1)[1].rsplit(":", 1)
        world = 1 + sum(server.info["tensor_parallel_size"] for server in servers)
        backend = "nccl" if all(backend_to(server.info) == "nccl" for server in servers) else "gloo"
        try:
            with socket.create_connection((host, int(port)), timeout=10.0) as route:
                mine = route.getsockname()[0]
            store = torch.distributed.TCPStore(mine, 0, world, is_master=True, wait_for_workers=False,
                                               timeout=_seconds(self.reconnect_s))
        except (OSError, RuntimeError) as error:
            return f"the weights group to the rollout server at {servers[0].address} could not be opened: " \
                   f"{_line(error)}"
        name, ranks = uuid.uuid4().hex[:12], {}
        for server in servers:
            first = 1 + len(ranks)
            ranks |= {rank: server for rank in range(first, first + server.info["tensor_parallel_size"])}
            try:
                self._post(server, "/weights/group", {"id": name, "host": mine, "port": store.port, "world_size": world,
                                                      "rank": first, "backend": backend,
                                                      "timeout_s": self.weights_timeout})
            except (RuntimeError, httpx.HTTPError) as error:
                return f"the rollout server at {server.address} did not take the weights group: {_line(error)}"
        late = list(dict.fromkeys(ranks[rank] for rank in arrivals(store, list(ranks), self.reconnect_s)))
        if late:  # (the store goes with this frame: the workers that came stop waiting on it)
            return f"{self._blamed(late)} did not join the weights group within {self.reconnect_s:g} s"
        try:
            group = weight_group(store, 0, world, backend, self.weights_timeout)
        except RuntimeError as error:
            return f"{self._blamed(servers)} did not join the weights group: {_line(error)}"
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        return WeightGroup(name, list(servers), [server.info.get("instance") for server in servers], group, store,
                           backend, device)

    def _loaded(self, servers: list[RemoteServer]) -> str | None:
        """Wait for every server to have loaded the broadcast (all at once); None, or which did not, and why."""
        def wait(server):
            try:
                self._post(server, "/weights/wait", {"version": self.version, "timeout_s": self.weights_timeout},
                           timeout=self.weights_timeout + 10.0)
            except (RuntimeError, httpx.HTTPError) as error:
                return f"{server.address} ({_line(error)})"
            return None

        failed = [reason for reason in self.pool.map(wait, servers) if reason]
        if failed:
            return f"the rollout server{'s' if len(failed) > 1 else ''} at {', '.join(failed)} did not load the weights"
        return None

    def _post(self, server: RemoteServer, path: str, body: dict, timeout: float = 60.0) -> dict:
        answer = self.http.post(f"{server.url}{path}", json=body, timeout=timeout)
        if answer.status_code != 200:
            raise RuntimeError(f"{path} answered {answer.status_code}: {_error(answer)}")
        return answer.json()

    def served(self) -> dict[str, dict]:
        """What each server served, for a record: its model as it loaded it, and the weights' version (0: as loaded) when
        it was last reached (`close` reaches them)."""
        return {server.address: {key: server.info.get(key) for key in ("model", "version", "tensor_parallel_size", "dtype")}
                for server in self.servers}

    # -- the rest of the contract

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Abort what is still running there, and note what they served (`served`); the servers go on serving."""
        self.abort()
        for server in self.servers:
            if server.up:
                self._connect(server)
        self.pool.shutdown(wait=False)
        self.http.close()


def _dtype(server: RemoteServer) -> torch.dtype:
    return getattr(torch, server.info.get("dtype", "float32"))


def _seconds(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _error(answer: httpx.Response) -> str:
    try:
        return str(answer.json().get("error", answer.text))
    except ValueError:
        return answer.text[:200]


def _line(error: BaseException) -> str:
    """The error's first line, without the source position gloo starts its messages with."""
    text = re.sub(r"^\[[^\]\s]+:\d+\] ", "", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__
