"""An env behind a timeout: what the rollout loop steps, so that a broken env costs one trajectory.

    env = Guarded("sciworld", options, timeout=120)
    env.reset(task_id); env.step(text)        # as the env's own, or its exception, or EnvTimeout
    environments = make_envs("webarena", 64, urls=["http://host1:8000", "http://host2:8000"])  # 32 on each
    environments = make_envs("babyai", 64, delay="webarena*0.5", seed=0)   # as slow as WebArena's pages, at half
    environments = args.env_args.make_envs(args.env, 64, rank, seed)          # as the scripts' --env-* flags say

Every reset and step runs in its own daemon thread and is waited for at most `timeout` seconds. A call
that raises passes the exception on; one that does not answer in time (a hung simulator, a browser that
stopped responding) raises EnvTimeout. Either way the instance is abandoned (closed in the background,
since its close may hang too) and the next call starts on a fresh one, so one broken episode never
poisons the next. A hung call's thread is a daemon: it never keeps the process from exiting.

On AgentGym env servers (make_envs' `urls`) each instance lives on one server, and the fresh one that replaces
it is made on the same server: a server that goes down fails only the trajectories of its own instances (at
their next call, and every episode they start while it is down), never another server's.

With a `delay` (--env-delay, envs/latency.py) each instance is a Delayed env inside its guard: the drawn seconds
are part of the call the timeout bounds, as a slow page's would be, and a fresh instance goes on with its slot's
random stream.

EnvArgs holds the --env-* flags that train.py and eval.py share (each script's Args nests it without a prefix).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Annotated

import tyro

import envs
from envs.latency import Delayed, Draws, parse


class EnvTimeout(TimeoutError):
    """An env call gave no answer within its timeout."""


def _in_thread(fn, *args) -> Future:
    future: Future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the caller, whatever it is
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="env-call").start()
    return future


class Guarded(envs.Env):
    """`envs.make(name, **options)` with a per-call timeout and a fresh instance after any failure; with `delay`,
    each instance delayed by those draws (envs/latency.py)."""

    def __init__(self, name: str, options: dict, timeout: float, delay: Draws | None = None,
                 env: envs.Env | None = None):
        self.name, self.make_options, self.timeout, self.delay = name, options, timeout, delay
        self.env: envs.Env | None = env if env is not None else self._make()  # (`env`: a fork's, made elsewhere)
        # fixed by the env and its options: a fresh instance has the same
        self.instruction, self.ack = self.env.instruction, self.env.ack
        self.options = getattr(self.env, "options", {})
        self.lock = threading.Lock()
        self.generation = 0  # +1 whenever the instance is given up on
        # (a failed trajectory's error names the server its instance is on)
        self.where = f" from the env server at {options['url']}" if options.get("url") else ""

    def _call(self, method: str, *args):
        generation = self.generation
        future = _in_thread(self._run, generation, method, args)
        wait([future], timeout=self.timeout)  # (not result(timeout): the env's own TimeoutError is not ours)
        if not future.done():
            self._abandon()
            raise EnvTimeout(f"no answer in {self.timeout:g} s{self.where}")
        if future.exception() is not None:
            self._abandon()
        return future.result()

    def _run(self, generation: int, method: str, args: tuple):
        """The call, in its own thread; on a fresh instance if the last one was given up on. A fresh one
        made after its call timed out (a slow JVM or browser start) is closed, never used."""
        env = self.env
        if env is None:
            env = self._make()
            with self.lock:
                current = generation == self.generation and self.env is None
                if current:
                    self.env = env
            if not current:
                env.close()
                raise EnvTimeout(f"given up on while starting{self.where}")
        return getattr(env, method)(*args)

    def _make(self) -> envs.Env:
        env = envs.make(self.name, **self.make_options)
        return Delayed(env, self.delay) if self.delay else env

    def _abandon(self) -> Future:
        """Give up on the instance: close it in the background (its close may hang too)."""
        with self.lock:
            env, self.env = self.env, None
            self.generation += 1
        return _in_thread(env.close if env is not None else lambda: None)

    def reset(self, task_id: int) -> str:
        return self._call("reset", task_id)

    def step(self, text: str) -> envs.StepResult:
        return self._call("step", text)

    def state_key(self) -> str | None:
        """The instance's state key, read in the caller's thread after its call returned (cheap, as Env.state_key
        promises); None when the instance was given up on."""
        env = self.env
        return None if env is None else env.state_key()

    def fork(self) -> Guarded:
        """The instance's fork (Env.fork), behind a guard of its own (its fresh instances are made as this one's are);
        called between calls, in the caller's thread: a copy is Python state, never a call that could hang. Raises
        the env's own refusal, and RuntimeError when the instance was given up on."""
        env = self.env
        if env is None:
            raise RuntimeError(f"the {self.name} env was given up on{self.where}: nothing to fork")
        return Guarded(self.name, self.make_options, self.timeout, self.delay, env=env.fork())

    def close(self) -> None:
        """Close the instance, waiting for it at most `timeout` (close_envs closes many at once)."""
        wait([self._abandon()], timeout=self.timeout)


def make_envs(name: str, count: int, options: dict | None = None, timeout: float = 0.0,
              urls: str | Sequence[str] | None = None, rank: int = 0, delay: str | None = None,
              seed: int = 0) -> list[Guarded]:
    """`count` guarded instances of an env, in process or (`urls`: one URL or several) on AgentGym env servers,
    whose own requests then have the same timeout; `timeout` 0: the env's default (its call_timeout in envs.ENVS).
    Several servers take the instances round robin, so that each gets an even share: instance i is on
    urls[(rank x count + i) % len(urls)], where `rank` is this process's index when every process of a run makes
    `count` (the processes' instances are spread over the servers together). What cannot be made at all (options
    the env does not take, a server that is down or never answers) stops the script (train.py, eval.py) with one
    line that says why, naming the server, before any episode.

    `delay`: an --env-delay spec (envs/latency.py: 0 or None none, SECONDS, webarena, webarena*X, ...); every
    instance, remote ones too, answers that much later, inside its timeout. Instance i draws from the stream of
    (seed, rank x count + i), so a run's draws do not depend on how its envs are split over processes. A spec that
    does not parse stops the script with one line."""
    timeout = timeout or envs.call_timeout(name)
    try:
        latency = parse(delay)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    urls = (urls,) if isinstance(urls, str) else tuple(urls or ())
    given = dict(options or {})
    made: list[Guarded] = []
    try:
        for i in range(count):
            url = urls[(rank * count + i) % len(urls)] if urls else None
            draws = Draws(latency, seed, rank * count + i) if latency else None
            # (a client of the env's own, a server's or an OpenEnv spec's, waits as long as the guard does)
            client = url or (envs.standards.is_spec(name) and envs.standards.module(name).takes_timeout)
            made.append(Guarded(name, given | ({"url": url} if url else {}) | ({"timeout": timeout} if client else {}),
                                timeout, draws))
    except (TypeError, ValueError, OSError, RuntimeError) as error:  # (bad options, a server or backend that fails)
        close_envs(made)
        lines = str(error).strip().splitlines()
        raise SystemExit(f"cannot make a {name} env" + (f" on the env server at {url}" if url else "")
                         + (f" with options {given}" if given else "")
                         + f": {type(error).__name__}: {lines[0] if lines else ''}") from None
    return made


def close_envs(environments: list[Guarded]) -> None:
    """Close them all at once, waiting at most the longest timeout (so that browsers and JVMs are gone
    when a run ends, and hung ones cannot hold it up for long)."""
    if environments:
        wait([env._abandon() for env in environments], timeout=max(env.timeout for env in environments))


@dataclass
class EnvArgs:
    """Where the env instances run and how long a call may take: the flags train.py and eval.py share."""

    env_options: dict[str, str] = field(default_factory=dict)
    """keyword options for envs.make, e.g. --env-options reward normalized; ENV.KEY VALUE: env ENV's only, in a run of
    several (eval.py: added to the run's own)"""
    env_timeout: Annotated[tuple[str, ...], tyro.conf.arg(metavar="SECONDS|ENV=SECONDS ...")] = ()
    """seconds an env reset or step may take before its trajectory ends as failed (eval.py: counted under `errors`)
    and the env is replaced: SECONDS for every env, ENV=SECONDS for one (webarena=300 babyai=5); default: each env's
    own (its call_timeout in envs.ENVS), also for an env given none or 0"""
    env_url: Annotated[tuple[str, ...] | None, tyro.conf.arg(metavar="URL [URL ...]")] = None
    """play on AgentGym env servers (ours, `python -m envs.serve`, or upstream's) at these URLs instead of in process;
    several take the env instances round robin, an even share each; with several envs, ENV=URL (webarena=http://...)
    says whose, and an env given none plays in process"""
    env_delay: str = "0"
    """slow every env down, for benchmarks: each step (webarena: each reset too) sleeps a drawn latency after the env
    answers, within --env-timeout: SECONDS, webarena (our WebArena env's measured distribution), lognormal:MEDIAN,SIGMA,
    SPEC*X (webarena*10: its shape at 10x its seconds); 0: none (envs/latency.py)"""

    def check(self, names: tuple[str, ...] | None = None) -> None:
        """Stop early, with what to do, on settings that cannot work (`names`: the envs played)."""
        for name in envs.ENVS if names is None else names:  # (a spec's timeout is checked where it is named)
            self.timeout(name)  # (a SystemExit on an entry that does not parse)
        scoped = {entry.partition("=")[0] for entry in self.timeouts() if "=" in entry}
        if names is not None and scoped - set(names):
            raise SystemExit(f"--env-timeout names {', '.join(sorted(scoped - set(names)))}, not an env of this run "
                             f"({', '.join(names)})")
        scopes = {envs.scope_of(key)[0] for key in self.env_options} - {None}
        if names is not None and scopes - set(names):
            raise SystemExit(f"--env-options names {', '.join(sorted(scopes - set(names)))}, not an env of this run "
                             f"({', '.join(names)})")
        try:
            parse(self.env_delay)
        except ValueError as error:
            raise SystemExit(str(error)) from None

    def timeouts(self) -> tuple[str, ...]:
        """--env-timeout's entries (set from code: also one number or string)."""
        given = self.env_timeout
        return (str(given),) if isinstance(given, (int, float, str)) else tuple(map(str, given))

    def timeout(self, name: str) -> float:
        """Env `name`'s call timeout in seconds: its ENV=SECONDS entry, else a plain one, else 0 (its default)."""
        seconds: dict[str, float] = {}  # by scope, "" for every env
        for entry in self.timeouts():
            scope, equals, text = entry.strip().rpartition("=")
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if not 0 <= value < math.inf or (equals and not envs.known(scope)):
                raise SystemExit(f"--env-timeout {entry}: give SECONDS (0: the env's default) or ENV=SECONDS, "
                                 f"ENV one of {envs.choices()}")
            if scope in seconds:
                raise SystemExit(f"--env-timeout gives {scope or 'every env'} two timeouts: give one")
            seconds[scope] = value
        return seconds.get(name, seconds.get("", 0.0))

    def options(self, name: str) -> dict:
        """Env `name`'s options: --env-options' plain and `name.`-scoped entries, as Python values."""
        return envs.parse_options(envs.own_options(self.env_options, name))

    def make_envs(self, name: str, count: int, rank: int = 0, seed: int = 0, options: dict | None = None) -> list[Guarded]:
        """`count` guarded instances of env `name` as these flags say (make_envs); `options`: the env's options,
        by default --env-options as Python values (envs.parse_options)."""
        options = self.options(name) if options is None else options
        return make_envs(name, count, options, self.timeout(name), self.urls(name), rank, delay=self.env_delay,
                         seed=seed)

    def make_pool(self, rows: list[str], blocks: int = 1, rank: int = 0, seed: int = 0) -> list[Guarded]:
        """Instances for `blocks` blocks of len(rows) episodes, episode i of each block on an instance of env
        rows[i] (rl/tasks.py's Mix.rows); each env's instances made together (make_envs: its servers' round robin and
        its delays' streams count its own instances), so that a run of one env makes what it always made."""
        made: dict[str, list[Guarded]] = {}
        try:
            for name in dict.fromkeys(rows):
                made[name] = self.make_envs(name, rows.count(name) * blocks, rank, seed)
        except SystemExit:
            close_envs([env for instances in made.values() for env in instances])
            raise
        left = {name: iter(instances) for name, instances in made.items()}
        return [next(left[name]) for _ in range(blocks) for name in rows]

    def evaluation_pool(self, rows: list[str], environments: list[Guarded], test_ids: dict, apart: bool,
                        rank: int = 0, seed: int = 0) -> list[Guarded]:
        """The instances evaluations play on: the training ones (`environments`, laid out by `rows`) where they hold
        every env evaluated (`test_ids`' keys), else a pool of their own with each env's count of the rows (an env
        they lack: an even share of them): `apart` (train.py's --max-staleness, whose rollouts go on through an
        evaluation), and on a process whose share of a step holds only some of a run's envs (seeded seed + 1:
        --env-delay's draws a stream apart)."""
        if not test_ids or (not apart and set(test_ids) <= set(rows)):
            return environments
        share = max(1, len(rows) // len(test_ids))  # (an env this process's rows lack: an even share of them)
        return self.make_pool([name for name in test_ids for _ in range(rows.count(name) or share)], 1, rank, seed + 1)

    def check_urls(self, names: Sequence[str]) -> None:
        """Stop early on --env-url entries a run on the envs `names` cannot place: with several envs each says whose
        (ENV=URL: a server serves one env), and an ENV= entry names one of them."""
        for url in (self.env_url,) if isinstance(self.env_url, str) else self.env_url or ():
            name = self.named(url)
            if name is None and len(names) > 1:
                raise SystemExit(f"--env-url {url}: a run on several envs ({', '.join(names)}) needs to know whose "
                                 f"server it is: write it ENV=URL ({names[0]}={url})")
            if name is not None and name not in names:
                raise SystemExit(f"--env-url {url} is for {name}, which this run does not play ({', '.join(names)})")

    def urls(self, name: str) -> tuple[str, ...] | None:
        """The env servers of env `name`: --env-url's ENV=URL entries for it, else its plain URLs (none: in process)."""
        given = (self.env_url,) if isinstance(self.env_url, str) else self.env_url or ()  # (one, set from code)
        named = [url.partition("=")[2] for url in given if self.named(url) == name]
        return tuple(named) or tuple(url for url in given if self.named(url) is None) or None

    @staticmethod
    def named(url: str) -> str | None:
        """The env an --env-url entry names (ENV=URL), or None."""
        prefix, equals, _ = url.partition("=")
        return prefix if equals and envs.known(prefix) else None
