"""Avg@k and Pass@k of a model on an environment's test split, overall and per category.

    python eval.py --model runs/<run>/checkpoints/step_8          # scores a checkpoint as it was trained
    python eval.py --model Qwen/Qwen2.5-7B-Instruct --env textcraft --k 4

    python eval.py --model openai:gpt-4o --base-url https://api.openai.com/v1 --price-in 2.5 --price-out 10

A LoRA run's checkpoint holds an adapter: it is loaded on its base model (and a vLLM engine gets the merged
weights, checked on a probe).

Each task is played k times. Avg@k is the mean final score over all k x tasks episodes (the raw env
score: BabyAI's fractional reward, SciWorld's 0-100 progress); Pass@k is the fraction of tasks where
at least one of the k episodes scored above 0. Both as AgentGym-RL computes them.

Which limits an episode plays under is a protocol (`--protocol`), recorded with every result:
- `run`: the training run's own settings, for a checkpoint inside runs/<run>/ (env, the turn cap of
  the checkpoint's step, token limits, env options): the score the run itself would see;
- `tiny`: the embedded model's short turns and trajectories;
- `agentgym`: upstream's evaluation (AgentGym-RL's examples/eval/*.sh): its turn cap per env, 512
  tokens a turn (200 for SciWorld) and no trajectory budget below the 32k context of its vLLM
  engine. Use it to compare with the paper's numbers.
`auto` picks `run` for a run's checkpoint, `tiny` for the embedded model, `agentgym` otherwise;
--horizon, --max-new-tokens and --max-tokens override single limits. The results go to <out>.json
(written atomically) and every episode to <out>.jsonl. Episodes run on vLLM when it is installed
(`--engine`, as in train.py), else on Hugging Face sampling; the result records which.

`--model openai:<name>` evaluates a model behind an OpenAI-compatible chat endpoint (--base-url: a hosted
API, or a checkpoint served by `python -m vllm.entrypoints.openai.api_server`) through the same episodes,
limits and scores, text in, text out (rl/api.py: retries, --api-concurrency, how the token budget is held).
No local model or tokenizer is loaded. The key comes from $OPENAI_API_KEY (or --api-key-env) and is never
written; each episode's token usage and cost (--price-in/--price-out) go to the .jsonl, their sums and the
base URL to the .json. A server that cannot be reached stops the eval before any episode; one that fails
later fails only the episodes it does not answer (counted under `errors`).
"""

from __future__ import annotations

import rl  # noqa: F401 - first: sets OpenMP's wait policy before torch loads (see rl/__init__.py)

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import envs
from envs.guard import close_envs, make_envs
from rl import api, plots
from rl.checkpoint import write_atomic
from rl.horizon import horizon_at
from rl.model import EMBEDDED, EMBEDDED_ROLLOUT, full_weights, is_adapter, load_model, load_tokenizer
from rl.scores import score, spread
from rl.engines import engine_kind, make_engine
from rollout import ChatFormat, play

# Upstream's eval scripts: max_rounds per env, max_tokens a turn, and vLLM's max_model_len.
UPSTREAM_TURNS = {"babyai": 20, "textcraft": 30, "sciworld": 30, "searchqa": 30, "webarena": 15}
UPSTREAM_TURN_TOKENS = {"sciworld": 200}  # 512 for the others
UPSTREAM_CONTEXT = 32768


@dataclass
class Args:
    model: str = "tiny-agent"
    """Hugging Face id, local directory or checkpoint (runs/<run>/checkpoints/step_<k>)"""
    env: str | None = None
    """default: the run's env, else babyai"""
    protocol: Literal["auto", "run", "tiny", "agentgym"] = "auto"
    """the limits episodes play under (see above): the run's, the embedded model's, or upstream's eval"""
    split: Literal["test", "train"] = "test"
    """which of the env's shipped splits to evaluate"""
    tasks: str | None = None
    """task id file (AgentGym-RL-Data-ID format) instead of the split; a run's checkpoint: default its run's --test-tasks"""
    limit: int | None = None
    """evaluate N tasks spread evenly over the split"""
    k: int = 1
    """episodes per task"""
    horizon: int | None = None
    """turn cap per episode; default: set by --protocol"""
    max_new_tokens: int | None = None
    """tokens per assistant turn; default: set by --protocol"""
    max_tokens: int | None = None
    """tokens per trajectory (prompt + every turn); default: set by --protocol"""
    temperature: float = 1.0
    """upstream evaluates with temperature 1; 0 is greedy"""
    top_p: float = 1.0
    """nucleus sampling: draw from the smallest set of tokens holding this much probability"""
    env_options: dict[str, str] = field(default_factory=dict)
    """keyword options for envs.make, added to the run's own, e.g. --env-options reward normalized"""
    env_timeout: float = 0.0
    """seconds an env reset or step may take before its episode ends as failed (counted under `errors`)
    and the env is replaced; 0: the env's default (envs.CALL_TIMEOUT)"""
    env_url: str | None = None
    """play on an AgentGym env server (ours, `python -m envs.serve`, or upstream's) at this URL instead
    of in process"""
    batch_size: int = 64
    """episodes played at once"""
    engine: Literal["auto", "vllm", "hf"] = "auto"
    """vllm: vLLM's engine (continuous batching, prefix caching); hf: Hugging Face sampling; auto: vllm
    when it is installed"""
    vllm_gpu_memory_utilization: float = 0.85
    """share of the GPU's memory vLLM takes (nothing else shares the GPU in eval)"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine (tensor parallel)"""
    base_url: str | None = None
    """--model openai:<name>: the OpenAI-compatible endpoint; default $OPENAI_BASE_URL, else OpenAI's"""
    api_key_env: str = "OPENAI_API_KEY"
    """--model openai:<name>: the environment variable holding the API key (never written anywhere)"""
    api_concurrency: int = 8
    """--model openai:<name>: requests in flight at once"""
    api_retries: int = 4
    """--model openai:<name>: retries of a request after a connection error, a timeout, HTTP 429 or 5xx"""
    api_timeout: float = 120.0
    """--model openai:<name>: seconds a request may wait for the server before it counts as timed out"""
    api_backoff: float = 1.0
    """--model openai:<name>: seconds before the first retry, doubled for each next one (plus jitter)"""
    price_in: float = 0.0
    """--model openai:<name>: dollars per million prompt tokens, for the cost in the results"""
    price_out: float = 0.0
    """--model openai:<name>: dollars per million completion tokens"""
    seed: int = 0
    """seeds the sampler"""
    out: str | None = None
    """output path without extension; default: next to the checkpoint, else runs/eval/"""


def run_config(model: str) -> dict | None:
    """The training config of a checkpoint inside runs/<run>/checkpoints/step_<k>, if it is one."""
    path = Path(model)
    config = path.parent.parent / "config.json"
    if path.is_dir() and path.parent.name == "checkpoints" and config.is_file():
        return json.loads(config.read_text())
    return None


def checkpoint_horizon(model: str, config: dict) -> int:
    """The turn cap the run trained with at this checkpoint's step (ScalingInter-RL's stage then)."""
    if "horizon" not in config:
        return config["max_turns"]  # a run from before horizon schedules
    state = Path(model) / "trainer_state.json"
    step = json.loads(state.read_text())["step"] if state.is_file() else 10**9
    return horizon_at(max(step, 1), config["horizon"], config["horizon_every"])  # (agentevol's iteration 0 is step 0)


def resolve_settings(args: Args) -> dict:
    """The env, its options, the protocol and its limits (horizon, max_new_tokens, max_tokens)."""
    config = run_config(args.model)
    protocol = args.protocol
    if protocol == "auto":
        protocol = "run" if config is not None else "tiny" if args.model in EMBEDDED else "agentgym"
    if protocol == "run" and config is None:
        raise SystemExit("--protocol run takes a checkpoint of a training run (runs/<run>/checkpoints/step_<k>)")
    env = args.env or (config["env"] if config is not None else EMBEDDED_ROLLOUT["env"] if protocol == "tiny" else "babyai")
    if env not in envs.ENVS:
        raise SystemExit(f"unknown env {env!r}; choose one of: {', '.join(envs.ENVS)}")
    if protocol == "run":
        limits = {"horizon": checkpoint_horizon(args.model, config), "max_new_tokens": config["max_new_tokens"],
                  "max_tokens": config["max_tokens"]}
    elif protocol == "tiny":
        limits = {key: EMBEDDED_ROLLOUT[key] for key in ("horizon", "max_new_tokens", "max_tokens")}
    else:
        limits = {"horizon": UPSTREAM_TURNS[env], "max_new_tokens": UPSTREAM_TURN_TOKENS.get(env, 512),
                  "max_tokens": UPSTREAM_CONTEXT}
    overrides = {key: getattr(args, key) for key in limits if getattr(args, key) is not None}
    if any(value < 1 for value in overrides.values()):
        raise SystemExit(f"--{' --'.join(k.replace('_', '-') for k, v in overrides.items() if v < 1)}: at least 1")
    own_options = config.get("env_options", {}) if config is not None and config["env"] == env else {}
    options = {**envs.parse_options(own_options), **envs.parse_options(args.env_options)}
    # a run's checkpoint plays its run's test tasks (the tiny preset's on BabyAI: the short-horizon levels')
    own_tasks = config.get("test_tasks") if protocol == "run" and config["env"] == env and args.split == "test" else None
    return {"env": env, "protocol": protocol, **limits, **overrides, "overrides": sorted(overrides), "env_options": options,
            "tasks": args.tasks or own_tasks}


def load_engine(args: Args, settings: dict):
    """(kind, format, engine) that episodes play on: the local model on vLLM or HF sampling, or for --model
    openai:<name> the server at --base-url (no local model or tokenizer is loaded then)."""
    if args.model.startswith(api.PREFIX):
        return "api", api.APIFormat(), api_engine(args)
    if args.base_url is not None:
        raise SystemExit(f"--base-url is for --model {api.PREFIX}<name>: a model on a server, by the name it serves it under")
    tokenizer = load_tokenizer(args.model)
    fmt = ChatFormat(tokenizer)
    kind = engine_kind(args.engine)
    model = None
    if kind == "hf" or is_adapter(args.model):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = load_model(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    engine = make_engine(kind, args.model, fmt, model, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         batch_size=args.batch_size, max_model_len=settings["max_tokens"],
                         gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                         tensor_parallel_size=args.vllm_tensor_parallel_size)
    if kind == "vllm" and model is not None:  # a LoRA checkpoint: vLLM loaded its base; the adapter goes in merged
        engine.load_weights(model, weights=full_weights(model))
    return kind, fmt, engine


def api_engine(args: Args) -> api.APIEngine:
    """The engine for a model behind an OpenAI-compatible endpoint, after one request that shows the server
    answers and takes the key."""
    if args.engine != "auto":
        raise SystemExit(f"--engine chooses a local model's engine; --model {args.model} runs on its server")
    if args.api_concurrency < 1 or args.api_retries < 0 or args.api_timeout <= 0 or args.api_backoff < 0:
        raise SystemExit("need --api-concurrency >= 1, --api-retries >= 0, --api-timeout > 0 and --api-backoff >= 0")
    base_url = args.base_url or os.environ.get("OPENAI_BASE_URL") or api.DEFAULT_URL
    if not os.environ.get(args.api_key_env):
        print(f"no API key in ${args.api_key_env}: requests go without one (a local server needs none)")
    engine = api.APIEngine(base_url, args.model.removeprefix(api.PREFIX), temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed, concurrency=args.api_concurrency,
                           retries=args.api_retries, timeout=args.api_timeout, backoff=args.api_backoff,
                           api_key_env=args.api_key_env, price_in=args.price_in, price_out=args.price_out)
    try:
        note = engine.check()
    except ConnectionError as error:
        engine.close()
        raise SystemExit(f"{error}\nCheck --base-url (it ends in /v1 for most servers) and that the server is up.")
    if note:
        print(note)
    return engine


def main(args: Args) -> dict:
    settings = resolve_settings(args)
    env_name = settings["env"]
    if settings["tasks"]:
        task_ids = envs.load_task_ids(settings["tasks"], env_name)
    else:
        task_ids = envs.splits(env_name)[args.split]
    if args.limit:
        task_ids = spread(task_ids, args.limit)
    if args.k < 1 or not task_ids:
        raise SystemExit("nothing to evaluate: need --k >= 1 and at least one task")

    kind, fmt, engine = load_engine(args, settings)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    episodes = [(task, group) for group, task in enumerate(task_ids) for _ in range(args.k)]
    environments = make_envs(env_name, min(args.batch_size, len(episodes)), settings["env_options"], args.env_timeout,
                             args.env_url)
    env_settings = getattr(environments[0], "options", {})
    start = time.perf_counter()
    bar = tqdm(total=len(episodes), desc=f"eval {env_name}", unit="episode", dynamic_ncols=True)
    try:
        trajectories = play(engine, fmt, environments, [t for t, _ in episodes], [g for _, g in episodes],
                            horizon=settings["horizon"], max_new_tokens=settings["max_new_tokens"],
                            max_tokens=settings["max_tokens"], progress=bar.update)
    finally:
        bar.close()
        engine.close()
        close_envs(environments)
    results = {"model": args.model, "split": settings["tasks"] or args.split, "k": args.k,
               "temperature": args.temperature, "engine": kind, **settings, "env_settings": env_settings,
               "env_url": args.env_url,
               **score(trajectories, env_name),
               "seconds": round(time.perf_counter() - start, 1)}
    if kind == "api":  # where the model was served (never the key) and what its calls cost
        results |= {"base_url": engine.base_url, "usage": api.total_usage(trajectories),
                    "prices": {"in": args.price_in, "out": args.price_out}}
    if args.out:
        out = Path(args.out)
    elif run_config(args.model) is not None:
        out = Path(args.model) / f"eval_{env_name}_{args.split}_k{args.k}_{settings['protocol']}"
    else:
        name = Path(args.model.replace(":", "-")).name  # (openai:<name> -> openai-<name>)
        out = Path("runs/eval") / f"{env_name}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out.with_suffix(".jsonl"), "".join(json.dumps(t.log_record()) + "\n" for t in trajectories))
    write_atomic(out.with_suffix(".json"), json.dumps(results, indent=2) + "\n")

    limits = (f"{settings['horizon']} turns, {settings['max_new_tokens']} tokens a turn, {settings['max_tokens']} a trajectory"
              + (f"; set by flag: {', '.join(settings['overrides'])}" if settings["overrides"] else "")
              + ("; the server's context window holds the trajectory's" if kind == "api" else ""))
    print(f"protocol {settings['protocol']} ({limits})")
    print(f"{env_name} {results['split']}: {results['tasks']} tasks x {args.k}  "
          f"Avg@{args.k} {results['avg@k']:.4f}  Pass@{args.k} {results['pass@k']:.4f}  turns {results['turns']:.1f}"
          + (f"  failed episodes {results['errors']} (scored 0; see the .jsonl)" if results["errors"] else ""))
    if results["errors"]:
        print(f"  first failure: {next(t.error for t in trajectories if t.error is not None)}")
    if kind == "api":
        usage = results["usage"]
        print(f"{engine.base_url}: {usage['calls']} calls, {usage['prompt_tokens']} prompt and "
              f"{usage['completion_tokens']} completion tokens, ${usage['cost']:.4f}")
    for name, c in results["categories"].items():
        print(f"  {name:<24} {c['tasks']:>4} tasks  Avg@{args.k} {c['avg@k']:.4f}  Pass@{args.k} {c['pass@k']:.4f}")
    plotted = plots.draw(out.with_suffix(".json"))
    print(f"wrote {out.with_suffix('.json')}" + (f" and {plotted}" if plotted else ""))
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
