"""Each env's own limits in a run of several: its horizon schedule and its token budgets (train.py --env-limits).

    train.py --env babyai webarena --horizon 6 13 20 --horizon-every 80 \\
        --env-limits webarena.horizon 8,12,15 webarena.max_tokens 16384 webarena.max_new_tokens 256

The run's --horizon, --horizon-every, --max-new-tokens and --max-tokens are every env's; an entry ENV.KEY VALUE gives
env ENV its own (KEY: horizon, horizon_every, max_new_tokens, max_tokens; a horizon's stages comma-separated, `auto`
first for --horizon auto's rule on that env's own episodes). Upstream trains one env a run, each with its own
script's stages (BabyAI 6 13 20, WebArena 8 12 15) and response length (WebArena's 14,098 tokens); a run of several
keeps each env's. A run's limits are each env's `Limits` by name (a run of one env: a mix of one), made once at its
start (env_limits) and cut to the model's context window once (within); an episode plays under its env's (rollout.py's
Rollouts takes them by name, each set's turn caps too); what is sized for the whole run (the rollout engine's context,
micro-batches, the memory plan) takes the largest."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

from rl.horizon import AUTO, LADDER, auto_horizon, caps_of, describe, env_rows, horizon_at, known_before
from rl.records import read_metrics
from rl.tasks import env_names

KEYS = ("horizon", "horizon_every", "max_new_tokens", "max_tokens")


class Limits(NamedTuple):
    """One env's limits: its horizon schedule (stages, `auto` first or not), steps a stage, tokens a turn and a
    trajectory."""

    horizon: tuple
    horizon_every: int
    max_new_tokens: int
    max_tokens: int


def env_limits(args) -> dict[str, Limits]:
    """Each env of the run (args.env) by name: the run's limits (args.horizon, horizon_every, max_new_tokens,
    max_tokens) with its --env-limits entries over them."""
    run = Limits(tuple(args.horizon), args.horizon_every, args.max_new_tokens, args.max_tokens)
    entries = args.env_limits or {}
    check_entries(entries, args.env)
    own = {name: own_entries(entries, name) for name in args.env}
    for settings in own.values():
        if settings.get("horizon") == (AUTO,):  # (`auto` alone: the run's stages, else the recipe's, as --horizon)
            settings["horizon"] = (AUTO, *(caps if len(caps := caps_of(run.horizon)) > 1 else LADDER))
    return {name: run._replace(**settings) for name, settings in own.items()}


def within(limits: dict[str, Limits], context: int) -> dict[str, Limits]:
    """Each env's limits with its max_tokens cut to `context`, the most tokens a trajectory may hold (the model's
    context window: rl/model.py's context_limit)."""
    return {name: own._replace(max_tokens=min(own.max_tokens, context)) for name, own in limits.items()}


def check_entries(entries: dict, names, keys: tuple[str, ...] = KEYS, auto: bool = True) -> None:
    """Stop on --env-limits entries that are not ENV.KEY of the envs `names` and the `keys`, or (not `auto`: eval.py,
    which plays caps) a horizon of `auto`."""
    for key, value in entries.items():
        name, setting = entry_of(key)
        if name not in names or setting not in keys:
            raise SystemExit(f"--env-limits {key}: entries are ENV.KEY VALUE, ENV one of the run's envs "
                             f"({', '.join(names)}), KEY one of {', '.join(keys)}")
        if setting == "horizon" and not auto and AUTO in _value(key, setting, value):
            raise SystemExit(f"--env-limits {key} {value}: turn caps to play (eval.py), not `auto`")


def own_entries(entries: dict, name: str) -> dict:
    """Env `name`'s --env-limits entries, parsed, by KEY."""
    return {entry_of(key)[1]: _value(key, entry_of(key)[1], value) for key, value in entries.items()
            if entry_of(key)[0] == name}


def entry_of(key: str) -> tuple[str, str]:
    """An --env-limits key's ENV and KEY, split on the last dot so that a spec's dots stay its own
    (gym:mypkg.games:Guess.horizon), as envs.scope_of splits --env-options."""
    name, _, setting = key.rpartition(".")
    return name, setting


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


def last_caps(limits: dict[str, Limits]) -> dict[str, int]:
    """Each env's last stage: the cap its held-out evaluations play under, so that they compare across steps."""
    return {name: caps_of(own.horizon)[-1] for name, own in limits.items()}


def caps_at(step: int, limits: dict[str, Limits], known: list[dict], patience: int, cut: float, gain: float
            ) -> tuple[dict[str, int], str | None]:
    """Each env's turn cap of step `step`, by name, and why, if --horizon auto decided it: its ScalingInter-RL stage
    then, or `auto`'s rule on `known` (the metrics of the steps finished when the step's episodes begin), each env's
    on its own rows where a run has several (rl/metrics.py logs rollout/<env>/ then: rl/horizon.py's env_rows)."""
    caps, whys = {}, []
    for name, own in limits.items():
        if own.horizon[0] != AUTO:
            caps[name] = horizon_at(step, own.horizon, own.horizon_every)
            continue
        caps[name], why = auto_horizon(caps_of(own.horizon), env_rows(known, name) if len(limits) > 1 else known,
                                       patience, cut, gain)
        whys.append(f"{name} {why}" if len(limits) > 1 else why)
    return caps, ("; ".join(whys) if whys else None)


def horizon_for(step: int, args, limits: dict[str, Limits], history: list[dict]) -> tuple[int, str | None]:
    """caps_for's largest turn cap of step `step` (logged as rollout/horizon) and why (rollout/horizon_reason)."""
    caps, why = caps_for(step, args, limits, history)
    return max(caps.values()), why


def caps_for(step: int, args, limits: dict[str, Limits], history: list[dict]) -> tuple[dict[str, int], str | None]:
    """train.py's turn caps of step `step` (`args`: its Args; `limits`: its envs'), each env's (caps_at) on the metrics
    of the steps finished when the step's episodes begin (`history`: the run's step rows; the staleness rule's
    known_before), and why."""
    known = [row for row in history if row["charts/step"] <= known_before(step, args.max_staleness)]
    # (reflect: one cap, its attempts' sets', on the pooled rows; its envs' horizons are the run's: rl/flags.py)
    limits = {args.env[0]: limits[args.env[0]]} if args.layout_args.agent == "reflect" else limits
    return caps_at(step, limits, known, args.horizon_patience, args.horizon_cut, args.horizon_gain)


def describe_limits(limits: dict[str, Limits], steps: int) -> str:
    """The run's banner's turn caps (rl/horizon.py's describe) and, where the envs' limits differ, each env's."""
    if len(set(limits.values())) == 1:
        own = next(iter(limits.values()))
        return describe(own.horizon, own.horizon_every, steps)
    return "; ".join(f"{name} {describe(own.horizon, own.horizon_every, steps)}, {own.max_new_tokens}/{own.max_tokens}"
                     f" tokens" for name, own in limits.items())


# ----------------------------------------------------------------------------------------------
# A run's checkpoint, as eval.py plays it (--protocol run)


def checkpoint_limits(model: str, config: dict, env: str) -> Limits:
    """The limits env `env` played under in the run (its config.json `config`) at the step of its checkpoint `model`:
    one stage, its turn cap then (checkpoint_horizon), and its token budgets, the env's own where --env-limits gave
    them."""
    if "horizon" not in config:  # a run from before horizon schedules
        return Limits((config["max_turns"],), 1, config["max_new_tokens"], config["max_tokens"])
    names = env_names(config.get("env", "babyai"))
    trained = env in names  # (an env the run did not play: the run's own limits, its pooled caps)
    own = env_limits(SimpleNamespace(env=names if trained else (env,), env_limits=config.get("env_limits", {}) if
                                     trained else {}, horizon=config["horizon"], horizon_every=config["horizon_every"],
                                     max_new_tokens=config["max_new_tokens"], max_tokens=config["max_tokens"]))[env]
    return own._replace(horizon=(checkpoint_horizon(model, own, env if trained and len(names) > 1 else None),),
                        horizon_every=1)


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
