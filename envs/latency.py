"""Env latency: any env's resets and steps made as slow as WebArena's pages (or any other latency), for
benchmarks that need slow, long-tailed envs on a machine whose envs answer in milliseconds.

    latency = parse("webarena*0.1")                      # --env-delay SPEC; None for "0"
    env = Delayed(envs.make("babyai"), Draws(latency, seed=0, index=3))
    environments = make_envs("babyai", 64, delay="webarena", seed=0)   # envs/guard.py: each delayed inside its guard

Specs (scripts/bench.py's `--env-delay`; make_envs' `delay`, for the scripts' own `--env-delay`):

    0, none                   no delay (the env as it is)
    SECONDS                   every step SECONDS longer, resets as they are (bench.py's --env-delay 0.2 of before)
    webarena                  steps and resets drawn from the distributions fitted to WebArena's (below)
    lognormal:MEDIAN,SIGMA    steps drawn from a lognormal of that median (seconds) and sigma, resets as they are
    SPEC*X                    SPEC's seconds times X: webarena*0.1 has WebArena's shape at a tenth of its seconds

A Delayed env answers exactly what its env answers (observations, rewards, done, info: byte for byte), only later:
each call sleeps its drawn seconds after the env has answered, as if the page had taken that long. The draws come
from a random stream per (seed, index), the env's place in the run, so two runs with the same seed sleep the same
sequence on each env, whatever the other envs do; a guarded env that is replaced after a failure goes on with its
slot's stream.

The `webarena` distributions were measured on this project's WebArena env by scripts/webarena_latency.py, with
the raw seconds in envs/data/webarena_latency.json (how, when, on which commit and machine, the load): one env
on the local sites (a real Chromium on the shop, forum and homepage that envs/webarena/sites.py serves; settle_s
0.1 s), playing the tasks' experts and random valid actions to `stop`. A step's seconds have a floor, the settle
wait every action ends with (settle_s), a lognormal body above it, and a tail the lognormal misses: an Enter that
starts no navigation waits up to 1 s for one (envs/webarena/actions.py, NAV_START_S), a `stop` runs the task's
evaluators, some of which load pages. So each is fitted (`fit`) as floor + a lognormal body by maximum
likelihood (the mean and standard deviation of log(seconds - floor)), spliced at the empirical 95th percentile
to a Pareto tail whose index is the maximum-likelihood (Hill) estimate over the top 5%. Resets the same, with no
floor. docs/environments.md ("Slow envs") has the measured and fitted percentiles side by side; tests/test_latency.py refits the
data file and checks the constants below. The fit is close at p50, p90 and p99 (within 11%) and in the mean; the
Pareto tail has no upper bound, so it draws steps longer than any measured (the median of the largest of 1,529
draws is 2.6 s, the measured largest 1.3 s): on the small local pages the env's own waits cap the tail, while
WebArena's real sites (a 1.5 s settle wait, page loads of seconds), which could not be measured here, have
longer ones. `webarena*X` stretches or shrinks the whole shape.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist, fmean, pstdev

from envs import Env, StepResult

DATA_FILE = Path(__file__).parent / "data" / "webarena_latency.json"
TAIL_SHARE = 0.05  # the share of calls fitted by the Pareto tail: where the lognormal starts to miss (docs/environments.md)
_NORMAL = NormalDist()


@dataclass(frozen=True)
class Distribution:
    """Seconds = floor + a lognormal body of `median` and `sigma` (of the seconds above the floor), cut at
    `tail_from`; above it, for a `tail_share` of the calls, a Pareto tail of index `alpha`. sigma 0 and no tail:
    always floor + median."""

    median: float
    sigma: float
    floor: float = 0.0
    tail_share: float = 0.0
    tail_from: float = math.inf  # seconds, floor included
    alpha: float = math.inf

    def quantile(self, p: float) -> float:
        """The seconds below which a share p of the calls fall, 0 < p < 1."""
        if p > 1 - self.tail_share:  # the Pareto tail, from tail_from up
            return self.floor + (self.tail_from - self.floor) * ((1 - p) / self.tail_share) ** (-1 / self.alpha)
        # the lognormal body below tail_from: its quantile at the same share of the body's (cut) probability
        cut = _NORMAL.cdf(math.log((self.tail_from - self.floor) / self.median) / self.sigma) if self.sigma else 1.0
        return self.floor + self.median * math.exp(self.sigma * _NORMAL.inv_cdf(p / (1 - self.tail_share) * cut))

    def draw(self, rng: random.Random) -> float:
        return self.quantile((rng.getrandbits(53) + 0.5) / 2 ** 53)  # a uniform share in (0, 1), never 0 or 1

    def scaled(self, x: float) -> Distribution:
        return replace(self, median=self.median * x, floor=self.floor * x, tail_from=self.tail_from * x)


@dataclass(frozen=True)
class Latency:
    """What an --env-delay spec asks for: the distribution of a step's added seconds and of a reset's (None: none)."""

    step: Distribution
    reset: Distribution | None = None

    def scaled(self, x: float) -> Latency:
        return Latency(self.step.scaled(x), self.reset.scaled(x) if self.reset else None)


# ----------------------------------------------------------------------------------------------
# WebArena's latencies, fitted by fit() to envs/data/webarena_latency.json (module docstring)

# 1,529 steps and 238 resets; p50 / p90 / p99 measured 0.139 / 0.340 / 1.078 s a step, 0.613 / 0.915 / 1.450 s a reset
WEBARENA = Latency(
    step=Distribution(median=0.05238, sigma=1.073, floor=0.1, tail_share=0.04971, tail_from=0.7048, alpha=3.266),
    reset=Distribution(median=0.6239, sigma=0.2903, tail_share=0.05042, tail_from=1.048, alpha=5.233),
)


def fit(seconds: list[float], floor: float = 0.0, tail_share: float = TAIL_SHARE) -> Distribution:
    """floor + a lognormal body by maximum likelihood, spliced at the empirical (1 - tail_share) quantile to a
    Pareto tail whose index is the maximum-likelihood (Hill) estimate over the calls above it."""
    above = sorted(s - floor for s in seconds)
    logs = [math.log(s) for s in above]
    median, sigma = math.exp(fmean(logs)), pstdev(logs)
    tail = round(tail_share * len(above))
    if tail == 0:
        return Distribution(median, sigma, floor)
    start = above[-tail - 1]  # the largest call of the body: the tail's scale
    alpha = tail / sum(math.log(s / start) for s in above[-tail:])
    return Distribution(median, sigma, floor, tail / len(above), floor + start, alpha)


def fit_webarena(path: Path = DATA_FILE) -> Latency:
    """WEBARENA as fitted to the data file: steps above the env's settle wait, resets from 0."""
    data = json.loads(Path(path).read_text())
    return Latency(fit(data["step_s"], floor=data["options"]["settle_s"]), fit(data["reset_s"]))


# ----------------------------------------------------------------------------------------------
# Specs

NUMBER = r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"


def parse(spec: str | float | None) -> Latency | None:
    """An --env-delay spec (module docstring) as a Latency; None when it asks for no delay. A spec that is none of
    the forms raises ValueError with one sentence that lists them."""
    text = str(spec).strip().lower() if spec is not None else ""
    base, star, scale = (part.strip() for part in text.partition("*"))
    refusal = ValueError(f"--env-delay {spec!r} is not a delay: give 0 or none, SECONDS, webarena, "
                         "lognormal:MEDIAN,SIGMA (a median above 0), any of them times a positive X as SPEC*X")
    if star and not (re.fullmatch(NUMBER, scale) and float(scale) > 0):
        raise refusal
    if (base in ("", "none", "off") and not star) or (re.fullmatch(NUMBER, base) and float(base) == 0):
        return None
    if re.fullmatch(NUMBER, base):
        latency = Latency(Distribution(float(base), 0.0))
    elif base == "webarena":
        latency = WEBARENA
    elif (match := re.fullmatch(rf"lognormal:\s*({NUMBER})\s*,\s*({NUMBER})", base)) and float(match[1]) > 0:
        latency = Latency(Distribution(float(match[1]), float(match[2])))
    else:
        raise refusal
    return latency.scaled(float(scale)) if star else latency


# ----------------------------------------------------------------------------------------------
# The delayed env


class Draws:
    """A Latency's seconds for one env, from a random stream of its own, seeded from (seed, index)."""

    def __init__(self, latency: Latency, seed: int, index: int):
        self.latency = latency
        self.rng = random.Random(f"env-delay/{seed}/{index}")  # (a str seed: the same stream on every run)

    def step(self) -> float:
        return self.latency.step.draw(self.rng)

    def reset(self) -> float:
        return self.latency.reset.draw(self.rng) if self.latency.reset else 0.0


class Delayed(Env):
    """The env, whose every reset and step answers its drawn seconds later; everything else is the env's own. A call
    draws when it starts (so the draws follow the calls' order even when a guard gives up on one that still runs)
    and sleeps when the env has answered."""

    def __init__(self, env: Env, draws: Draws):
        self.wrapped, self.draws = env, draws

    def __getattr__(self, name: str):  # name, instruction, ack, options, and whatever the env's oracle reads
        if name == "wrapped":  # (not set yet: copying or unpickling)
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def reset(self, task_id: int) -> str:
        seconds = self.draws.reset()
        observation = self.wrapped.reset(task_id)
        time.sleep(seconds)
        return observation

    def step(self, text: str) -> StepResult:
        seconds = self.draws.step()
        result = self.wrapped.step(text)
        time.sleep(seconds)
        return result

    def state_key(self) -> str | None:  # (Env has one, so __getattr__ would not reach the env's)
        return self.wrapped.state_key()

    def fork(self) -> Delayed:  # (as state_key: Env has one)
        """The env's fork, delayed by a copy of this one's draws (its calls then draw what this one's would)."""
        return Delayed(self.wrapped.fork(), copy.deepcopy(self.draws))

    def close(self) -> None:
        self.wrapped.close()
