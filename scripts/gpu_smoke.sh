#!/usr/bin/env bash
# GPU smoke test of the vLLM engine: two training steps of Qwen2.5-0.5B-Instruct on TextCraft on one GPU,
# then the engine's metrics per step (sampler-vs-trainer log-prob difference, weight-sync seconds and
# probe difference, generation tokens/s, prefix-cache hit rate, engine idle share).
#
#   bash scripts/gpu_smoke.sh                    # needs `bash setup.sh` (installs the CUDA vLLM build) and the hub
#   MODEL=/path/to/local/model bash scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
out=$(mktemp -d)
WANDB_MODE=${WANDB_MODE:-disabled} python train.py --model "$model" --env textcraft --engine vllm --steps 2 \
  --tasks-per-step 4 --n 4 --horizon 10 --max-new-tokens 256 --max-tokens 4096 --micro-batch-size 2 \
  --lr 1e-6 --save-every 0 --out-dir "$out" --run-name smoke
python - "$out/smoke/metrics.jsonl" <<'PY'
import json
import sys

keys = ["rollout/reward", "rollout/logprob_diff", "rollout/logprob_diff_max", "sync/seconds", "sync/probe_diff",
        "perf/tokens_per_s", "perf/prefix_hit_rate", "perf/engine_idle_share", "perf/rollout_s", "perf/step_s"]
for line in open(sys.argv[1]):
    metrics = json.loads(line)
    print(f"step {metrics['charts/step']}: " + ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics))
PY
echo "run: $out/smoke"
