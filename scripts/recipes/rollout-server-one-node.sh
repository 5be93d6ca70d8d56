#!/usr/bin/env bash
# One node of 8 GPUs, split (issue 33): a rollout server on GPUs 0-1 (vLLM at tensor parallel 2) plays every
# trajectory, FSDP2 over GPUs 2-7 (6 processes) trains; after each update the trainer's rank 0 broadcasts the weights
# to the server's two workers (NCCL) and checks them with the probe. Any paper recipe plays this way: RECIPE names its
# env and method (scripts/recipes/<env>_<method>.sh), MODEL the model. Its --tasks-per-step must divide by the 6
# training processes: TASKS_PER_STEP, 18 (the BabyAI and SciWorld recipes' 16, rounded up; 30 for those of 32).
#
# Check first, from any machine, no GPU held: the memory plan of the trainer's GPUs (no engine on them) and of the
# server's (its half of the bf16 weights, KV cache in the rest), and the split:
#   DRY_RUN=1 bash scripts/recipes/rollout-server-one-node.sh
# Then, on the node (the server starts, is waited for while it loads the model, and is stopped when training ends):
#   bash scripts/recipes/rollout-server-one-node.sh
#   RECIPE=textcraft_scalinginter-rl TASKS_PER_STEP=30 bash scripts/recipes/rollout-server-one-node.sh --epochs 1
# Not yet run on GPUs here: NCCL between the trainer's GPU and the server's is untested (rl/engines/server.py).
set -euo pipefail
export MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
RECIPE=${RECIPE:-babyai_agentgym-rl}
TASKS_PER_STEP=${TASKS_PER_STEP:-18}
PORT=${PORT:-8900}
source "$(dirname "$0")/common.sh"

if [[ -z ${DRY_RUN:-} ]]; then
  trap stop_servers EXIT
  serve 0,1 "$PORT"
  wait_for_servers "127.0.0.1:$PORT"
fi
GPUS=6 LAUNCH=configs/fsdp2.yaml CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 bash "scripts/recipes/$RECIPE.sh" \
  --rollout-server "127.0.0.1:$PORT" --vllm-tensor-parallel-size 2 --tasks-per-step "$TASKS_PER_STEP" "$@"
