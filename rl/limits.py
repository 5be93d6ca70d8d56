"""Each env's own limits in a run of several: its horizon schedule and its token budgets (train.py --env-limits).

    train.py --env babyai webarena --horizon 6 13 20 --horizon-every 80 \\
        --env-limits webarena.horizon 8,12,15 webarena.max_tokens 16384 webarena.max_new_tokens 256

The run's --horizon, --horizon-every, --max-new-tokens and --max-tokens are every env's; an entry ENV.KEY VALUE gives
env ENV its own (KEY: horizon, horizon_every, max_new_tokens, max_tokens; a horizon's stages comma-separated, `auto`
first for --horizon auto's rule on that env's own episodes). Upstream trains one env a run, each with its own
script's stages (BabyAI 6 13 20, WebArena 8 12 15) and response length (WebArena's 14,098 tokens); a run of several
keeps each env's. An episode plays under its env's limits (rollout.py takes a limit or one per env, by name); what is
sized for the whole run (the rollout engine's context, micro-batches, the memory plan) takes the largest.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

from rl.horizon import AUTO, LADDER, auto_horizon, caps_of, describe, env_rows, horizon_at, known_before
from rl.records import read_metrics
from rl.tasks import env_names

KEYS = ("horizon", "horizon_every", "max_new_tokens", "max_tokens")
Limit = int | dict[str, int]  # a limit as rollout.py takes it: one for every env, or each env's by name


class Limits(NamedTuple):
    """One env's limits: its horizon schedule (stages, `auto` first or not), steps a stage, tokens a turn and a
    trajectory."""

    horizon: tuple
    horizon_every: int
    max_new_tokens: int
    max_tokens: int


def env_limits(args, context: int | None = None) -> dict[str, Limits]:
    """Each env of the run (args.env) by name: the run's limits (args.horizon, horizon_every, max_new_tokens,
    max_tokens; eval.py's Args has no horizon_every) with its --env-limits entries over them; `context`: the most
    tokens a trajectory may hold (rl/model.py's context_limit), which cuts every env's max_tokens."""
    run = Limits(tuple(args.horizon), getattr(args, "horizon_every", 1), args.max_new_tokens, args.max_tokens)
    entries = getattr(args, "env_limits", None) or {}
    check_entries(entries, args.env)
    own = {name: own_entries(entries, name) for name in args.env}
    for settings in own.values():
        if settings.get("horizon") == (AUTO,):  # (`auto` alone: the run's stages, else the recipe's, as --horizon)
            settings["horizon"] = (AUTO, *(caps if len(caps := caps_of(run.horizon)) > 1 else LADDER))
    limits = {name: run._replace(**settings) for name, settings in own.items()}
    if context is not None:
        limits = {name: own._replace(max_tokens=min(own.max_tokens, context)) for name, own in limits.items()}
    return limits


def check_entries(entries: dict, names, keys: tuple[str, ...] = KEYS, auto: bool = True) -> None:
    """Stop on --env-limits entries that are not ENV.KEY of the envs `names` and the `keys`, or (not `auto`: eval.py,
    which plays caps) a horizon of `auto`."""
    for key, value in entries.items():
        name, _, setting = key.partition(".")
        if name not in names or setting not in keys:
            raise SystemExit(f"--env-limits {key}: entries are ENV.KEY VALUE, ENV one of the run's envs "
                             f"({', '.join(names)}), KEY one of {', '.join(keys)}")
        if setting == "horizon" and not auto and AUTO in _value(key, setting, value):
            raise SystemExit(f"--env-limits {key} {value}: turn caps to play (eval.py), not `auto`")


def own_entries(entries: dict, name: str) -> dict:
    """Env `name`'s --env-limits entries, parsed, by KEY."""
    return {key.partition(".")[2]: _value(key, key.partition(".")[2], value) for key, value in entries.items()
            if key.partition(".")[0] == name}


def _value(key: str, setting: str, value) -> tuple | int:
    """An --env-limits value: a horizon's stages (`8,12,15`, `auto,3,6`), or a whole number."""
    try:
        if setting != "horizon":
            return int(value)
        stages = value if isinstance(value, (list, tuple)) else tuple(part.strip() for part in str(value).split(","))
        return tuple(AUTO if part == AUTO else int(part) for part in stages)
    except ValueError:
        raise SystemExit(f"--env-limits {key} {value}: " + ("stages are whole numbers, comma-separated, `auto` first "
                         "or not (8,12,15)" if setting == "horizon" else "a whole number")) from None


def check(limits: dict[str, Limits]) -> None:
    """Stop early on an env's limits that cannot work (the run's own are checked as flags: rl/flags.py)."""
    for name, own in limits.items():
        caps = caps_of(own.horizon)
        if not caps or min(caps) < 1 or AUTO in own.horizon[1:] or list(caps) != sorted(caps) or own.horizon_every < 1:
            raise SystemExit(f"{name}'s horizon {','.join(map(str, own.horizon))} every {own.horizon_every}: caps of at "
                             "least 1 that only grow, `auto` first or not at all, a stage of at least 1 step")
        if not 1 <= own.max_new_tokens < own.max_tokens:
            raise SystemExit(f"{name}'s max_new_tokens {own.max_new_tokens}: at least 1 and below its max_tokens "
                             f"{own.max_tokens}")


def largest(limits: dict[str, Limits]) -> Limits:
    """The run's sizes over all its envs: each setting's largest (a horizon: the largest last stage)."""
    return Limits((max(caps_of(own.horizon)[-1] for own in limits.values()),),
                  max(own.horizon_every for own in limits.values()),
                  max(own.max_new_tokens for own in limits.values()), max(own.max_tokens for own in limits.values()))


def per_env(limits: dict[str, Limits], key: str):
    """One setting as rollout.py takes it: a value for every env, or each env's by name where they differ."""
    values = {name: getattr(own, key) for name, own in limits.items()}
    return next(iter(values.values())) if len(set(values.values())) == 1 else values


def last_caps(limits: dict[str, Limits]) -> dict[str, int]:
    """Each env's last stage: the cap its held-out evaluations play under, so that they compare across steps."""
    return {name: caps_of(own.horizon)[-1] for name, own in limits.items()}


def caps_at(step: int, limits: dict[str, Limits], known: list[dict], patience: int, cut: float, gain: float
            ) -> tuple[int | dict[str, int], str | None]:
    """The turn cap of step `step` (one for every env, or each env's by name) and why, if --horizon auto decided it:
    each env's ScalingInter-RL stage then, or `auto`'s rule on `known` (the metrics of the steps finished when the
    step's episodes begin), each env's on its own rows with several (rl/horizon.py's env_rows)."""
    caps, whys = {}, []
    for name, own in limits.items():
        if own.horizon[0] != AUTO:
            caps[name] = horizon_at(step, own.horizon, own.horizon_every)
            continue
        caps[name], why = auto_horizon(caps_of(own.horizon), env_rows(known, name) if len(limits) > 1 else known,
                                       patience, cut, gain)
        whys.append(f"{name} {why}" if len(limits) > 1 else why)
    values = set(caps.values())
    return (values.pop() if len(values) == 1 else caps), ("; ".join(whys) if whys else None)


def horizon_for(step: int, args, history: list[dict]) -> tuple[int, str | None]:
    """caps_for's turn cap of step `step` (several envs': the largest) and why (logged as rollout/horizon_reason)."""
    caps, why = caps_for(step, args, history)
    return most(caps), why


def caps_for(step: int, args, history: list[dict]) -> tuple[Limit, str | None]:
    """train.py's turn cap of step `step` (`args`: its Args), each env's (caps_at) on the metrics of the steps finished
    when the step's episodes begin (`history`: the run's step rows; the staleness rule's known_before), and why."""
    known = [row for row in history if row["charts/step"] <= known_before(step, args.max_staleness)]
    limits = env_limits(args)  # (reflect: one cap, its attempts' sets; its envs' horizons are the run's: rl/flags.py)
    limits = {args.env[0]: limits[args.env[0]]} if args.layout_args.agent == "reflect" else limits
    return caps_at(step, limits, known, args.horizon_patience, args.horizon_cut, args.horizon_gain)


def describe_limits(limits: dict[str, Limits], steps: int) -> str:
    """The run's banner's turn caps (rl/horizon.py's describe) and, where the envs' limits differ, each env's."""
    if len(set(limits.values())) == 1:
        own = next(iter(limits.values()))
        return describe(own.horizon, own.horizon_every, steps)
    return "; ".join(f"{name} {describe(own.horizon, own.horizon_every, steps)}, {own.max_new_tokens}/{own.max_tokens}"
                     f" tokens" for name, own in limits.items())


def named(value: Limit, name: str) -> int:
    """A limit as rollout.py takes it (one for every env, or each env's by name), for an episode of env `name`."""
    return value if isinstance(value, int) else value[name]


def most(value: Limit) -> int:
    """A limit's largest over the envs (one for every env, or each env's by name)."""
    return value if isinstance(value, int) else max(value.values())


# ----------------------------------------------------------------------------------------------
# A run's checkpoint, as eval.py plays it (--protocol run)


def checkpoint_limits(model: str, config: dict, env: str) -> dict[str, int]:
    """The limits env `env` played under in the run (its config.json `config`) at the step of its checkpoint `model`:
    its turn cap then (checkpoint_horizon) and its token budgets, the env's own where --env-limits gave them."""
    if "horizon" not in config:  # a run from before horizon schedules
        return {"horizon": config["max_turns"], "max_new_tokens": config["max_new_tokens"],
                "max_tokens": config["max_tokens"]}
    names = env_names(config.get("env", "babyai"))
    trained = env in names  # (an env the run did not play: the run's own limits, its pooled caps)
    own = env_limits(SimpleNamespace(env=names if trained else (env,), env_limits=config.get("env_limits", {}) if
                                     trained else {}, horizon=config["horizon"], horizon_every=config["horizon_every"],
                                     max_new_tokens=config["max_new_tokens"], max_tokens=config["max_tokens"]))[env]
    return {"horizon": checkpoint_horizon(model, own, env if trained and len(names) > 1 else None),
            "max_new_tokens": own.max_new_tokens, "max_tokens": own.max_tokens}


def checkpoint_horizon(model: str, own: Limits, env: str | None = None) -> int:
    """The turn cap an env (`own`: its limits in the run) trained with at the step of checkpoint `model`:
    ScalingInter-RL's stage then; under --horizon auto, what the run's metrics.jsonl logged then (`env`'s own in a run
    of several envs), else the last it could climb to."""
    state = Path(model) / "trainer_state.json"
    step = json.loads(state.read_text())["step"] if state.is_file() else 10**9
    if own.horizon[0] == AUTO:  # (runs/<run>/checkpoints/step_<n>)
        metrics = Path(model).parent.parent / "metrics.jsonl"
        key = f"rollout/{env}/horizon" if env else "rollout/horizon"
        logged = [row[key] for row in (read_metrics(metrics) if metrics.is_file() else [])
                  if row.get("charts/step") == step and key in row]
        return logged[-1] if logged else own.horizon[-1]
    return horizon_at(max(step, 1), own.horizon, own.horizon_every)  # (agentevol's iteration 0 is step 0)
