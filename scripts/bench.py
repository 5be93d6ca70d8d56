"""Every speed figure of the project side by side, in one run on the same inputs: a table and a JSON file.

    python scripts/bench.py                                  # env, rollout, update on the embedded model (~5 min, 2 CPU cores)
    python scripts/bench.py --sections env rollout           # some sections (server, weights, async, trl: only so)
    python scripts/bench.py --model smollm2-135m --sections engine   # the engines on a real model (a few minutes)
    python scripts/bench.py --model Qwen/Qwen2.5-0.5B-Instruct --train-args="--tasks-per-step 8 --n 4 --horizon 6"

Sections, each in a process of its own, so that its peak memory (the GPU's allocated bytes, else the
resident set's high-water mark) is its own; each module's docstring says what its section measures:

- env (scripts/bench/env.py): oracle episodes of every env in process, over AgentGym's HTTP protocol and round trip
  through each standard (gym:, OpenEnv, verifiers), calls/s each way; `--clients N` adds a load test with malformed
  requests.
- rollout (scripts/bench/rollout.py): a training step's rollout on the HF engine and on vLLM: rollout wall time /
  generation time, tokens/s, idle share, log-prob mismatch, weight-sync time.
- server (scripts/bench/server.py): the same step on the in-process vLLM engine and on a rollout server on loopback,
  alternated: tokens/s each way, what the loopback costs, the weight sync each way.
- weights (scripts/bench/weights.py): the weight sync to 1, 2, ... --weight-servers rollout servers, per server in
  turn against one broadcast over one group (--weight-sync per-server | broadcast): seconds by number of servers.
- update (scripts/bench/update.py): train.py's update tokens/s, padding share and peak memory.
- async (scripts/bench/asynchronous.py): the synchronous loop and --max-staleness k on a long-tailed env latency
  workload: steps/h, env steps/h, engine idle share, reward.
- trl (scripts/bench/update.py): the same GRPO update in TRL's GRPOTrainer on the update section's trajectories.
- engine (scripts/bench/engine.py): HF against vLLM, and our vLLM rollout against vLLM's own LLM.generate on the same
  turn prompts and token counts, greedy, on a few short episodes (for a real model).
- bare (scripts/bench/bare.py): the update section's micro-batches through a bare forward + backward + AdamW loop:
  our update tokens/s over the bare loop's.
- context (scripts/bench/context.py): train.py under each --context mode on long SciWorld and WebArena episodes: prompt
  tokens a turn (mean, max), segments, step time, episodes the budget ended, reward; a plot of the prompt by turn.

The default runs env, rollout and update; server, async and context take tens of minutes on 2 cores, weights starts
several rollout servers, trl installs TRL into a throwaway venv, engine and bare are meant for a real model: each runs
when --sections names it.

Timing on a shared machine is noisy: compare within one run. The JSON (--out) holds every figure, the
machine and the date.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl  # noqa: E402,F401 - first: sets OpenMP's wait policy before torch loads

import tyro  # noqa: E402

from bench.common import Args  # noqa: E402 - the package scripts/bench/, beside this file
from bench.run import main  # noqa: E402

if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
