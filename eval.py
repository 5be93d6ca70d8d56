"""Avg@k and Pass@k of a model on an environment's test split, overall and per category.

    python eval.py --model runs/<run>/checkpoints/step_8          # scores a checkpoint as it was trained
    python eval.py --model Qwen/Qwen2.5-7B-Instruct --env textcraft --k 4
    python eval.py --env textcraft --horizon 5 10 20 30            # test-time interaction scaling: a table and a PNG
    python eval.py --agent reflect --attempts 3                    # success after each attempt
    python eval.py --compare runs/eval/a.json runs/eval/b.json     # differences per category, 95% CIs
    python eval.py --model openai:gpt-4o --base-url https://api.openai.com/v1 --price-in 2.5 --price-out 10

A LoRA run's checkpoint holds an adapter: it is loaded on its base model (and a vLLM engine gets the merged
weights, checked on a probe).

Each task is played k times. Avg@k is the mean final score over all k x tasks episodes (the raw env
score: BabyAI's fractional reward, SciWorld's 0-100 progress); Pass@k is the fraction of tasks where
at least one of the k episodes scored above 0. Both as AgentGym-RL computes them.

Which limits an episode plays under is a protocol (`--protocol`), recorded with every result:
- `run`: the training run's own settings, for a checkpoint inside runs/<run>/ (env, the turn cap of the checkpoint's
  step, token limits, env options): the score the run itself would see;
- `tiny`: the embedded model's short turns and trajectories;
- `agentgym`: upstream's evaluation (AgentGym-RL's examples/eval/*.sh), to compare with the paper's numbers: its
  horizon per env, 512 tokens a turn (200 for SciWorld; both in envs.ENVS), 32k a trajectory (its vLLM's context).
`auto` picks `run` for a run's checkpoint, `tiny` for the embedded model, `agentgym` otherwise; --horizon,
--max-new-tokens and --max-tokens override single limits; a budget past the model's context window is cut to it (a line
says so). The results go to <out>.json (written atomically) and every episode to <out>.jsonl. Episodes run on vLLM
when it is installed (`--engine`, as in train.py), else on Hugging Face sampling; the result records which.

`--model openai:<name>` evaluates a model behind an OpenAI-compatible chat endpoint (--base-url: a hosted
API, or a checkpoint served by `python -m vllm.entrypoints.openai.api_server`) through the same episodes,
limits and scores, text in, text out (rl/engines/api.py: retries, --api-concurrency, how the token budget is held).
No local model or tokenizer is loaded. The key comes from $OPENAI_API_KEY (or --api-key-env) and is never
written; each episode's token usage and cost (--price-in/--price-out) go to the .jsonl, their sums and the
base URL to the .json. A server that cannot be reached stops the eval before any episode; one that fails
later fails only the episodes it does not answer (counted under `errors`). A hosted reasoning model that takes
only temperature 1 is played at 1: the result's temperature and top_p are those the replies were sampled at,
with the asked ones under `asked` and a warning in the summary.

A result holds what was run, so that two can be compared: model, env, split, k, the limits, the agent format,
temperature, seed, engine, the code's git revision ("+dirty" with uncommitted changes), and each task's
episodes ([reward, success] each, `per_task`). `--compare A.json B.json` pairs two results' tasks and prints,
per category, each one's Avg@k and success and the difference with a 95% interval (rl/scores.paired).

Several horizons (`--horizon 5 10 20 30`; `--max-turns` is the same flag) sweep the interaction budget, as
the paper's figure on scaling test-time interaction: Avg@k and Pass@k per horizon, overall and per category, as
a table, in the result's `sweep` and as its PNG. The episodes are played once, under the largest horizon, and
each lower horizon h scores them as they stood after turn h (Trajectory.cut): nothing an episode sees depends on
its horizon (the prompts do not name it), so their first h turns are episodes played under horizon h, and the
horizons are compared on the same episodes. Under --agent reflect, where a failed attempt starts the next one,
each horizon is played on its own.
"""

from __future__ import annotations

import rl  # noqa: F401 - first: sets OpenMP's wait policy before torch loads (see rl/__init__.py)

import json
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

import envs
from envs.guard import EnvArgs, close_envs
from rl import plots
from rl.agent import LAYOUT_KEYS, LayoutArgs, chat_format, run_layout
from rl.checkpoint import write_atomic
from rl.flags import GROUP, embedded_of
from rl.limits import Limits, check_entries, checkpoint_limits, own_entries
from rl.tasks import env_names
from rl.progress import play_until_stopped, stopped
from rl.model import (EMBEDDED, EMBEDDED_ROLLOUT, EMBEDDED_TOOLS, context_limit, deterministic_kernels,
                      embedded_rollout, load_config, load_tokenizer, stop_on_nondeterministic)
from rl.run import code_revision, file_safe, run_of
from rl.scores import (actions, cells, compare_rows, endings, env_table, macro, per_task, result_text, score,
                       spread, sweep_table)
from rl.engines import api
from rl.engines.setup import EngineArgs, build_engine, engine_kind
from rollout import EngineStalled, play

# The context of upstream's eval engine (vLLM's max_model_len in its eval scripts); its turn cap and tokens a
# turn are each env's (envs.ENVS).
UPSTREAM_CONTEXT = 32768
PLAYED = ("horizon", "max_new_tokens", "max_tokens")  # an episode's limits (rl/limits.py's Limits, a sweep its stages)


@dataclass
class Args:
    model: str = "tiny-agent"
    """Hugging Face id, local directory or checkpoint (runs/<run>/checkpoints/step_<k>)"""
    env: tuple[str, ...] | None = None
    """default: the run's envs, else babyai; several (or all): each played in turn on one engine, and one table with
    a row each and their macro average"""
    protocol: Literal["auto", "run", "tiny", "agentgym"] = "auto"
    """the limits episodes play under (see above): the run's, the embedded model's, or upstream's eval"""
    split: Literal["test", "train"] = "test"
    """which of the env's shipped splits to evaluate"""
    tasks: str | None = None
    """task id file (AgentGym-RL-Data-ID format) instead of the split; a run's checkpoint: its run's --test-tasks"""
    limit: int | None = None
    """evaluate N tasks spread evenly over the split"""
    k: int = 1
    """episodes per task"""
    horizon: Annotated[tuple[int, ...] | None, tyro.conf.arg(aliases=("--max-turns",))] = None
    """turn cap per episode; default: set by --protocol. Several (--horizon 5 10 20 30) sweep the test-time
    interaction budget: a table and a PNG of Avg@k and Pass@k against it, per category"""
    agent: Literal["react", "plan", "reflect", "tools"] | None = None
    """how episodes are laid out (rl/agent.py): react (AgentGym's), plan, reflect (--attempts attempts a task) or
    tools (native tool calls); default: a run's checkpoint plays its run's (--protocol run), anything else react"""
    reasoning_tags: tuple[str, str] | None = None
    """a reasoning model's block (e.g. --reasoning-tags '<think>' '</think>'); default: a run's own, else the tags the
    chat template names (an API model: <think> </think>). The env reads the reply after the block"""
    reasoning: Literal["keep", "drop"] | None = None
    """the layout of an episode's turns (train.py's --reasoning): keep, the trajectory's own tokens; drop, each turn
    the chat template's rendering so far; default: a run's own, else keep"""
    chat_template_kwargs: dict[str, str] = field(default_factory=dict)
    """options for the chat template, e.g. --chat-template-kwargs enable_thinking false (Qwen3), added to a run's own;
    an API model's server gets them as its request's chat_template_kwargs"""
    max_obs_tokens: int | None = None
    """an observation of more than N tokens is cut to its first and last N/2 (train.py's); default: a run's, else 0"""
    context: str | None = None
    """full, window:K or summary:M: what a turn's prompt holds (train.py's); default: a run's own, else full"""
    attempts: int = 3
    """--agent reflect: attempts a task gets (it stops at its first success); success is reported per attempt"""
    compare: tuple[str, str] | None = None
    """two eval results (.json) to compare instead of evaluating: their differences per category with 95% CIs"""
    max_new_tokens: int | None = None
    """tokens per assistant turn; default: set by --protocol"""
    max_tokens: int | None = None
    """tokens per trajectory (prompt + every turn); default: set by --protocol"""
    env_limits: dict[str, str] = field(default_factory=dict)
    """several envs: an env's own horizon (several: a sweep, 5,10,20), max_new_tokens or max_tokens, ENV.KEY VALUE
    (webarena.max_tokens 16384), over the flags above and --protocol's"""
    # rl/engines/setup.py (vLLM takes 0.85 of the GPU here: nothing else shares it in eval), envs/guard.py
    engine_args: Annotated[EngineArgs, GROUP] = field(
        default_factory=lambda: EngineArgs(vllm_gpu_memory_utilization=0.85))
    env_args: Annotated[EnvArgs, GROUP] = field(default_factory=EnvArgs)
    batch_size: int = 64
    """episodes played at once"""
    api_args: Annotated[api.APIArgs, GROUP] = field(default_factory=api.APIArgs)  # rl/engines/api.py
    seed: int = 0
    """seeds the sampler"""
    out: str | None = None
    """output path without extension; default: next to the checkpoint, else runs/eval/"""


def eval_envs(args: Args) -> tuple[str, ...]:
    """The envs to play: --env's (all: every env), else the run's where the model is a run's checkpoint, else the
    embedded model's or babyai."""
    config = run_of(args.model)
    names = env_names(args.env) if args.env else env_names(config["env"]) if config is not None else \
        (EMBEDDED_ROLLOUT["env"] if args.model in EMBEDDED else "babyai",)
    for env in names:
        envs.check_env(env)
    return names


def resolve_settings(args: Args, env: str) -> dict:
    """The env's options, the protocol and its limits (horizon, max_new_tokens, max_tokens)."""
    config = run_of(args.model)
    protocol = args.protocol
    if protocol == "auto":
        protocol = "run" if config is not None else "tiny" if args.model in EMBEDDED else "agentgym"
    if protocol == "run" and config is None:
        raise SystemExit("--protocol run takes a checkpoint of a training run (runs/<run>/checkpoints/step_<k>)")
    trained = env_names(config["env"]) if config is not None else ()  # (the envs of the run, where the model is one's)
    if protocol == "run":
        limits = checkpoint_limits(args.model, config, env)  # (the env's own in the run, at the checkpoint's step)
    elif protocol == "tiny":
        tiny = embedded_rollout(embedded_of(args.model)) | (EMBEDDED_TOOLS if args.agent == "tools" else {})
        limits = Limits((tiny["horizon"],), 1, tiny["max_new_tokens"], tiny["max_tokens"])  # (the embedded model's)
    else:
        up = envs.registration(env)
        limits = Limits((up.upstream_horizon,), 1, up.upstream_max_new_tokens, UPSTREAM_CONTEXT)
    overrides = {key: getattr(args, key) for key in PLAYED if getattr(args, key) is not None}
    horizons = (args.horizon,) if isinstance(args.horizon, int) else args.horizon  # (Args(horizon=6) from code)
    own = own_entries(args.env_limits, env)  # (the env's own: --env-limits)
    overrides |= {key: value for key, value in own.items() if key != "horizon"}
    horizons = own.get("horizon", horizons)
    flag = {key: f"--env-limits {env}.{key}" if key in own else "--" + key.replace("_", "-") for key in PLAYED}
    if horizons is not None:  # a sweep plays up to its largest horizon
        if not horizons or min(horizons) < 1:
            raise SystemExit(f"{flag['horizon']} takes one or more turn caps of at least 1")
        overrides["horizon"] = max(horizons)
    if any(value < 1 for value in overrides.values()):
        raise SystemExit(f"{', '.join(flag[k] for k, v in overrides.items() if v < 1)}: at least 1")
    limits = limits._replace(**overrides | {"horizon": tuple(sorted(set(horizons))) if horizons else limits.horizon})
    if not args.model.startswith(api.PREFIX):  # within the model's context window (a served model's: its server's)
        limits = limits._replace(max_tokens=context_limit(limits.max_tokens, args.model, load_config(args.model),
                                 budget=flag["max_tokens"] if "max_tokens" in overrides else
                                 f"--protocol {protocol}'s --max-tokens"))
    own_options = config.get("env_options", {}) if env in trained else {}
    options = {**envs.parse_options(envs.own_options(own_options, env)),
               **envs.parse_options(envs.own_options(args.env_args.env_options, env))}
    # a run's checkpoint plays its run's test tasks (the tiny preset's on BabyAI: the short-horizon levels')
    own_tasks = config.get("test_tasks") if protocol == "run" and env in trained and args.split == "test" else None
    # (of several files joined, the one of this env's tasks; none: the run played the env's split)
    own_tasks = next((one for one in envs.task_files(own_tasks) if run_tasks(one, trained).get(env)), None) \
        if own_tasks else None
    # the layout: a run's checkpoint plays as its run was trained (agent format, template options, reasoning tags)
    own = config if protocol == "run" else {}
    layout = run_layout(args, own)
    return {"env": env, "protocol": protocol, "horizon": limits.horizon[-1], "max_new_tokens": limits.max_new_tokens,
            "max_tokens": limits.max_tokens, "overrides": sorted(overrides), "env_options": options,
            "tasks": args.tasks or own_tasks, "horizons": list(limits.horizon), **layout}


def main(args: Args) -> dict:
    """Evaluate: one env's results (its .json's), or with several, {"envs": each one's, "macro": their average}."""
    if args.compare:
        return compare(*args.compare)
    args.engine_args.check(args.model)
    args.api_args.check(args.model)
    if args.engine_args.deterministic:  # (before anything starts CUDA)
        deterministic_kernels()
    names = eval_envs(args)
    check_entries(args.env_limits, names, PLAYED, auto=False)
    args.env_args.check(names)
    args.env_args.check_urls(names)
    settings = {env: resolve_settings(args, env) for env in names}
    first = settings[names[0]]  # (the layout is the run's or the flags', the same for every env)
    layout = LayoutArgs(**{key: first[key] for key in LAYOUT_KEYS}, attempts=args.attempts)
    tasks = {env: evaluation_tasks(args, settings[env]) for env in names}
    for env in names:
        layout.check(env)

    kind, fmt = engine_format(args, layout)
    engine = build_engine(args.engine_args, fmt, args.model, max(s["max_tokens"] for s in settings.values()), args.seed,
                          args.batch_size, api_args=args.api_args)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    try:
        results = {env: evaluate(args, engine, kind, fmt, layout, settings[env], tasks[env]) for env in names}
    finally:
        engine.close()
    if len(names) == 1:
        return results[names[0]]
    average = macro(results)
    print(env_table(results, average, args.k))
    return {"envs": results, "macro": average}


def evaluate(args: Args, engine, kind: str, fmt, layout: LayoutArgs, settings: dict, task_ids: list[int]) -> dict:
    """One env's episodes, k a task, on `engine`: its results, written with its episodes under output_path."""
    env_name = settings["env"]
    agent = layout.make_agent()
    # -- every episode, k per task: once under the largest cap (a lower cap's episodes are its prefixes), or once
    # per cap for reflect, whose next attempt starts when one ends
    episodes = [(task, group) for group, task in enumerate(task_ids) for _ in range(args.k)]
    environments = args.env_args.make_envs(env_name, min(args.batch_size, len(episodes)), seed=args.seed,
                                           options=settings["env_options"])
    env_settings = getattr(environments[0], "options", {})
    start = time.perf_counter()
    played: dict[int, list] = {}
    try:  # (Ctrl-C: the episodes that ended are written, and it stops, below)
        for horizon in (settings["horizons"] if agent.attempts > 1 else settings["horizons"][-1:]):
            name = f"eval {env_name}" + (f" ({horizon} turns)" if len(settings["horizons"]) > 1 else "")
            played[horizon], stop = play_until_stopped(
                partial(play, engine, fmt, environments, [t for t, _ in episodes], [g for _, g in episodes],
                        horizon=horizon, max_new_tokens=settings["max_new_tokens"], max_tokens=settings["max_tokens"],
                        agent=agent), name, len(episodes), horizon, agent.attempts)
            if stop:
                break
    finally:
        close_envs(environments)
    trajectories = played[horizon]
    scored = score(trajectories, env_name, envs.score_max(env_name, settings["env_options"]))
    results = {"model": args.model, "split": settings["tasks"] or args.split, "k": args.k, "agent": agent.name,
               **({"attempts": agent.attempts} if agent.attempts > 1 else {}),
               "temperature": args.engine_args.temperature, "top_p": args.engine_args.top_p, "seed": args.seed,
               "engine": kind, "code": code_revision(), **settings, "env_settings": env_settings,
               "env_url": args.env_args.env_url, **scored, **({"served": engine.served()} if kind == "server" else {}),
               "per_task": per_task(trajectories), "seconds": round(time.perf_counter() - start, 1),
               **({"stopped": f"by Ctrl-C, after {len(trajectories)} of {len(episodes)} episodes"} if stop else {})}
    if kind == "api":  # where the model was served (never the key), what its calls cost, what it was sampled at
        results |= {"base_url": engine.base_url, "usage": api.total_usage(trajectories),
                    "prices": {"in": args.api_args.price_in, "out": args.api_args.price_out}, **engine.sampling}
        if engine.refused:  # a hosted reasoning model's rules (rl/engines/api.py): the parameters it refused
            results["refused"] = sorted(engine.refused)
        asked = {"temperature": args.engine_args.temperature, "top_p": args.engine_args.top_p}
        if engine.sampling != asked:
            results["asked"] = asked
    if len(settings["horizons"]) > 1 and not stop:
        results["sweep"] = [{"horizon": h, **score([t.cut(h) for t in played.get(h, trajectories)], env_name,
                                                   envs.score_max(env_name, settings["env_options"]))}
                            for h in settings["horizons"]]
    out = output_path(args, env_name, settings)
    write_atomic(Path(f"{out}.jsonl"), "".join(json.dumps(t.log_record()) + "\n" for t in trajectories))
    write_atomic(Path(f"{out}.json"), result_text(results))
    report(results, settings, args.k, trajectories)
    plotted = plots.draw(Path(f"{out}.json"))
    print(f"wrote {Path(f'{out}.json')}" + (f" and {plotted}" if plotted else ""))
    if stop:
        stopped(f"stopped by Ctrl-C: wrote the {len(trajectories)} episodes that had ended, of {len(episodes)}")
    return results


def run_tasks(path: str, trained: tuple[str, ...]) -> dict[str, list[int]]:
    """A run's --test-tasks file by env (it may hold several envs' tasks), or a SystemExit that says what is wrong."""
    try:
        return envs.load_tasks(path, trained)
    except envs.TaskFileError as error:
        raise SystemExit(f"the run's --test-tasks: {error}") from None


def evaluation_tasks(args: Args, settings: dict) -> list[int]:
    """The task ids to play: --tasks (or a run's own test tasks, which may be several envs'), else the split;
    --limit of them, spread."""
    if settings["tasks"] and not args.tasks:
        task_ids = run_tasks(settings["tasks"], env_names(run_of(args.model)["env"])).get(settings["env"], [])
    elif settings["tasks"]:  # (several envs: a file names each task's env; an env it names none of plays its split)
        names = eval_envs(args)
        try:
            task_ids = envs.load_tasks(settings["tasks"], names).get(settings["env"], [])
        except envs.TaskFileError as error:
            raise SystemExit(f"--tasks: {error}") from None
        task_ids = task_ids or (envs.splits(settings["env"])[args.split] if len(names) > 1 else [])
    else:
        task_ids = envs.splits(settings["env"])[args.split]
    if args.limit:
        task_ids = spread(task_ids, args.limit)
    if args.k < 1 or not task_ids:
        raise SystemExit("nothing to evaluate: need --k >= 1 and at least one task")
    return task_ids


def engine_format(args: Args, layout: LayoutArgs) -> tuple[str, object]:
    """The kind of engine episodes play on (api for --model openai:<name>, whose server templates the messages;
    server for --rollout-server; else vllm or hf) and the format they are laid out in."""
    if args.engine_args.rollout_server and args.engine_args.engine != "auto":
        raise SystemExit("--rollout-server plays on vLLM servers: leave --engine out")
    if args.model.startswith(api.PREFIX):  # (no local model or tokenizer is loaded)
        return "api", api.APIFormat(layout.reasoning_tags, envs.parse_options(args.chat_template_kwargs, words=True),
                                    layout.max_obs_tokens)
    fmt = chat_format(load_tokenizer(args.model), layout)
    return "server" if args.engine_args.rollout_server else engine_kind(args.engine_args.engine), fmt


def output_path(args: Args, env_name: str, settings: dict) -> Path:
    """<out> (without extension): --out (with several envs, <out>_<env> each), else beside the checkpoint, else
    runs/eval/."""
    if args.out:  # (a trailing .json is the file's own: res.json writes res.json and res.jsonl)
        out = Path(args.out.removesuffix(".json") + ("" if len(eval_envs(args)) == 1 else f"_{file_safe(env_name)}"))
    elif run_of(args.model) is not None:
        out = Path(args.model) / f"eval_{file_safe(env_name)}_{args.split}_k{args.k}_{settings['protocol']}"
    else:
        name = Path(args.model.replace(":", "-")).name  # (openai:<name> -> openai-<name>)
        out = Path("runs/eval") / f"{file_safe(env_name)}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def report(results: dict, settings: dict, k: int, trajectories: list) -> None:
    """The console summary: the limits, Avg@k and Pass@k overall and per category, how the episodes ended (a
    warning when most ran out of tokens), the first failure, an API model's usage, per attempt and per turn cap."""
    limits = (f"{settings['horizon']} turns, {settings['max_new_tokens']} tokens a turn, {settings['max_tokens']} a "
              "trajectory" + (f"; set by flag: {', '.join(settings['overrides'])}" if settings["overrides"] else "")
              + ("; the server's context window holds the trajectory's" if results["engine"] == "api" else ""))
    print(f"protocol {settings['protocol']} ({limits}), agent {results['agent']}")
    print(f"{settings['env']} {Path(str(results['split'])).name}: {results['tasks']} tasks x {k}  {cells(results, k)}"
          + (f"  failed episodes {results['errors']} (scored 0; see the .jsonl)" if results["errors"] else ""))
    print(f"  {endings(results['finish'], settings['max_tokens'])}")
    if said := actions(results, results["agent"]):
        print(f"  {said}")
    if results["errors"]:
        print(f"  first failure: {next(t.error for t in trajectories if t.error is not None)}")
    if results["engine"] == "api":
        usage = results["usage"]
        print(f"{results['base_url']}: {usage['calls']} calls, {usage['prompt_tokens']} prompt and "
              f"{usage['completion_tokens']} completion tokens"
              + (f" ({usage['reasoning_tokens']} of them reasoning)" if usage["reasoning_tokens"] else "")
              + f", ${usage['cost']:.4f}")
        if "asked" in results:
            print(f"warning: the server takes only its default sampling for {results['model']}: played at "
                  f"temperature {results['temperature']} and top_p {results['top_p']}, not the asked "
                  f"{results['asked']['temperature']} and {results['asked']['top_p']}")
    for name, c in results["categories"].items():
        print(f"  {name:<24} {c['tasks']:>4} tasks  {cells(c, k)}")
    for row in results.get("by_attempt", []):
        print(f"  after attempt {row['attempt']}: success {row['success']:.4f}, tasks solved {row['solved']:.4f}")
    if "sweep" in results:
        print(sweep_table(results["sweep"], k))


def compare(first: str, second: str) -> dict:
    """Two eval results side by side: per category (overall first) each one's Avg@k and success, and the
    difference (second - first) with a 95% interval, paired by task (rl/scores.paired); the settings that differ."""
    results = []
    for path in (first, second):
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"--compare: cannot read {path}: {error}") from error
        if not isinstance(results[-1], dict) or "avg@k" not in results[-1]:
            raise SystemExit(f"--compare: {path} is not an eval result (no avg@k)")
    a, b = results
    keys = ("model", "env", "split", "k", "protocol", "horizon", "max_new_tokens", "max_tokens", "agent", "temperature",
            "seed", "engine", "code", "env_options", "score_max", "context", "max_obs_tokens")
    differ = {key: (a.get(key), b.get(key)) for key in keys if a.get(key) != b.get(key)}
    print(f"A {first}\nB {second}")
    for key, (x, y) in differ.items():
        print(f"  {key}: A {x}  B {y}")
    if a.get("env") != b.get("env"):
        raise SystemExit("--compare: the two results are on different envs; nothing to pair")
    rows = compare_rows(a, b)
    print(f"{'category':<24} {'tasks':>5}  {'Avg A':>7} {'Avg B':>7} {'B - A (95% CI)':>24}  "
          f"{'succ A':>7} {'succ B':>7} {'B - A (95% CI)':>24}")
    for row in rows:
        cells = []
        for metric in ("avg", "success"):
            d = row[metric]
            interval = ("no paired tasks" if not d["tasks"] else f"{d['gain']:+.3f} (one task)" if d["low"] is None
                        else f"{d['gain']:+.3f} ({d['low']:+.3f}, {d['high']:+.3f})")
            cells.append(f"{d['before']:>7.3f} {d['after']:>7.3f} {interval:>24}")
        print(f"{row['category'][:24]:<24} {row['tasks']:>5}  " + "  ".join(cells))
    if any(row["tasks"] == 0 for row in rows):
        print("(a result without per-task scores, written before eval.py kept them, or none in common: no intervals)")
    return {"first": first, "second": second, "settings_differ": differ, "categories": rows}


if __name__ == "__main__":
    rl.freeze_heap()  # (what the imports made: no garbage)
    try:
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
    except EngineStalled as error:  # one sentence, not a traceback
        raise SystemExit(str(error)) from None
    except KeyboardInterrupt:  # (Ctrl-C while playing is handled in main: the episodes that ended are written)
        stopped("eval.py: stopped by Ctrl-C")
    except RuntimeError as error:  # --deterministic on a GPU: an op without a deterministic kernel, in one sentence
        stop_on_nondeterministic(error)
        raise
